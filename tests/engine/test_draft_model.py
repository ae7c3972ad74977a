"""Speculative decoding with a draft model (izh.engine.draft_model): rejection sampling against the draft's
distribution, and the engine's tokens with a draft model against the same engine without one, for a draft
that is mostly right (the target's own weights) and one mostly wrong (another random model of the same
tokenizer); the refusal of a draft whose tokenizer differs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from izh import LLM, SamplingParams
from izh.config import SpeculativeConfig
from izh.engine.spec_decode import sample_draft, verify_random
from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.sampling_params import StructuredOutputsParams
from tests.engine.test_spec_decode import PROMPTS, _spec_counts, _tokens
from tests.fixtures.draft import build_tiny_draft, swap_two_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _draft(path: str, k: int = 4) -> SpeculativeConfig:
    """A draft model at any load (the tests' batches are bigger than the default pause threshold)."""
    return SpeculativeConfig(
        method="draft_model", model=path, num_speculative_tokens=k, disable_by_batch_size=None
    )


def _llm(path: str, speculative: SpeculativeConfig | None, **kwargs: object) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(path, speculative=speculative, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base(tiny_llama_dir: str) -> LLM:
    return _llm(tiny_llama_dir, None)


@pytest.fixture(scope="module")
def right(tiny_llama_dir: str) -> LLM:
    """Drafts by the target's own weights: mostly right."""
    return _llm(tiny_llama_dir, _draft(tiny_llama_dir))


@pytest.fixture(scope="module")
def wrong(tiny_llama_dir: str, tiny_qwen2_dir: str) -> LLM:
    """Drafts by another random model of the same tokenizer: mostly wrong."""
    return _llm(tiny_llama_dir, _draft(tiny_qwen2_dir))


# --- the rejection sampler with a draft distribution -------------------------------------------------


def _chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    keep = p > 0
    expected = counts.sum() * p[keep] / p[keep].sum()
    return float(chisquare(counts[keep], expected).pvalue)


def test_rejection_sampling_with_a_draft_model_follows_the_target() -> None:
    """A tiny random target and draft over 5 tokens (bigram models: row t is the next token's distribution
    after t): each round the draft samples k = 3 tokens from q autoregressively and the target verifies
    them, the next round starting after the last token emitted, as the engine runs. The first three tokens
    emitted follow the target's joint distribution (chi-square over 125 cells), whatever the draft; a token
    the target never gives is never emitted, though the draft proposes it often. Seeded rounds repeat."""
    vocab, k = 5, 3
    g = torch.Generator().manual_seed(3)
    target = torch.rand(vocab, vocab, generator=g) ** 2
    target[:, 4] = 0.0
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(vocab, vocab, generator=g) + 0.1
    draft /= draft.sum(-1, keepdim=True)

    def one_round(last: int, generator: torch.Generator) -> list[int]:
        tokens, qs = [], []
        for _ in range(k):
            token, q = sample_draft(draft[tokens[-1] if tokens else last], generator)
            tokens.append(token)
            qs.append(q)
        # The target's rows at each draft position and after the last draft.
        return verify_random(target[[last, *tokens]], tokens, generator, torch.stack(qs)).token_ids

    generator = torch.Generator().manual_seed(1234)
    counts = np.zeros(vocab**3)
    for _ in range(15000):
        sequence: list[int] = []
        while len(sequence) < 3:
            sequence += one_round(sequence[-1] if sequence else 0, generator)
        a, b, c = sequence[:3]
        counts[(a * vocab + b) * vocab + c] += 1
    t = target.double()
    joint = (t[0][:, None, None] * t[:, :, None] * t[None, :, :]).flatten().numpy()
    assert _chi2_pvalue(counts, joint) > 1e-3
    assert counts.reshape(vocab, vocab, vocab)[..., 4].sum() == 0
    runs = [[one_round(0, torch.Generator().manual_seed(9)) for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]


# --- the engine: the same tokens with a draft model as without ---------------------------------------


@pytest.fixture(scope="module")
def wrong_p_min(tiny_llama_dir: str, tiny_qwen2_dir: str) -> LLM:
    """The wrong draft, stopping at drafts it gives less than 0.02 (its flat random distributions)."""
    config = SpeculativeConfig(
        method="draft_model",
        model=tiny_qwen2_dir,
        num_speculative_tokens=4,
        disable_by_batch_size=None,
        draft_p_min=0.02,
    )
    return _llm(tiny_llama_dir, config)


@pytest.mark.parametrize("which", ["right", "wrong", "wrong_p_min"])
def test_greedy_tokens_identical_with_a_draft_model(
    base: LLM, which: str, request: pytest.FixtureRequest
) -> None:
    spec: LLM = request.getfixturevalue(which)
    expected = _tokens(base.generate(PROMPTS, GREEDY))
    drafted_before, accepted_before = _spec_counts(spec)
    assert _tokens(spec.generate(PROMPTS, GREEDY)) == expected
    drafted, accepted = _spec_counts(spec)
    drafted, accepted = drafted - drafted_before, accepted - accepted_before
    assert drafted > 0
    stats = spec.engine_core.make_stats()
    if which == "right":
        assert accepted > 0.8 * drafted  # its KV follows the accepted tokens: the drafts stay right
    else:
        assert accepted < 0.5 * drafted
    if which == "wrong_p_min":  # some rounds stopped early
        assert stats.spec_decode_num_draft_tokens < 4 * stats.spec_decode_num_drafts
    # One at a time too.
    assert [_tokens(spec.generate([p], GREEDY))[0] for p in PROMPTS[:2]] == expected[:2]
    spec.engine_core.check_invariants()
    spec.engine_core.scheduler.check_invariants()


def test_logprobs_stop_strings_and_penalties_match(base: LLM, right: LLM) -> None:
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["e f", "7 8"]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, min_tokens=5),
    ]
    for params in cases:
        want = base.generate(PROMPTS, params)
        got = right.generate(PROMPTS, params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, params
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            if params.logprobs:
                got_lp = [p.chosen.logprob for p in g.outputs[0].logprobs]
                want_lp = [p.chosen.logprob for p in w.outputs[0].logprobs]
                assert np.allclose(got_lp, want_lp, atol=1e-5)


def test_structured_outputs_with_a_draft_model_match(base: LLM, right: LLM, wrong: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    for structured in (
        StructuredOutputsParams(regex=r"(a b c d e f g ){3}[0-9]{2}"),
        StructuredOutputsParams(json=json.dumps(schema)),
    ):
        params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=structured)
        want = _tokens(base.generate(PROMPTS[:3], params))
        assert _tokens(right.generate(PROMPTS[:3], params)) == want
        assert _tokens(wrong.generate(PROMPTS[:3], params)) == want
    right.engine_core.check_invariants()
    wrong.engine_core.check_invariants()


def test_seeded_sampling_reproducible_and_n_children(right: LLM, wrong: LLM) -> None:
    """Seeded requests repeat their tokens with sampled drafts (q kept for verification); with the
    target's own weights as draft q = p, so sampled drafts are accepted (almost) always."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=11)
    for llm in (right, wrong):
        drafted_before, accepted_before = _spec_counts(llm)
        first = _tokens(llm.generate(PROMPTS, params))
        assert _tokens(llm.generate(PROMPTS, params)) == first
        drafted, accepted = _spec_counts(llm)
        assert drafted > drafted_before
        if llm is right:
            assert accepted - accepted_before > 0.8 * (drafted - drafted_before)
    out = wrong.generate(PROMPTS[0], SamplingParams(temperature=1.0, n=3, max_tokens=20, ignore_eos=True))
    assert len(out[0].outputs) == 3 and all(len(c.token_ids) == 20 for c in out[0].outputs)
    wrong.engine_core.check_invariants()


def test_prefix_cache_and_preemption_with_a_draft_model(tiny_llama_dir: str, base: LLM) -> None:
    """A second request hitting blocks the first computed with drafts continues exactly as without; with
    room for about two sequences the others are preempted (the draft's KV goes with their blocks) and
    recomputed: the same tokens, and the draft still right afterwards."""
    llm = _llm(tiny_llama_dir, _draft(tiny_llama_dir), block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        first = llm.generate(prompt, params)[0]
        assert first.outputs[0].token_ids == base.generate(prompt, params)[0].outputs[0].token_ids
        follow = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids[:45]}
        draft = llm.engine_core.draft
        assert draft is not None
        caught_up = draft.num_catch_up_tokens
        hit = llm.generate(follow, params)[0]
        assert hit.num_cached_tokens > 0
        # The hit's blocks held the draft's KV of their tokens too: the draft computed only the rest.
        assert (
            draft.num_catch_up_tokens - caught_up
            < len(follow["prompt_token_ids"]) - hit.num_cached_tokens + 48
        )
        assert hit.outputs[0].token_ids == base.generate(follow, params)[0].outputs[0].token_ids
    llm.engine_core.check_invariants()
    # The budget holds both models' KV: 30 blocks of the target's and the draft's bytes.
    per_block = 2 * llm.engine_core.runner.kv_bytes_per_block()
    tight = _llm(tiny_llama_dir, _draft(tiny_llama_dir), block_size=4, max_model_len=96, kv_cache_memory_bytes=30 * per_block)  # fmt: skip
    assert tight.engine_core.num_blocks == 30
    assert _tokens(tight.generate(PROMPTS, GREEDY)) == _tokens(base.generate(PROMPTS, GREEDY))
    assert tight.engine_core.scheduler.num_preemptions > 0
    drafted, accepted = _spec_counts(tight)
    assert accepted > 0.8 * drafted
    tight.engine_core.check_invariants()


def test_lora_requests_with_a_draft_model_match(tiny_llama_dir: str, tmp_path: Path) -> None:
    """The draft proposes as the base model; the adapter's requests still get the adapter's tokens."""
    from tests.fixtures.lora import build_peft_adapter

    adapter = build_peft_adapter(tiny_llama_dir, tmp_path / "r8", r=8, alpha=16, seed=1)
    names = ["a", None, "a", None]
    results = []
    for speculative in (None, _draft(tiny_llama_dir)):
        llm = _llm(tiny_llama_dir, speculative, lora_modules={"a": adapter})
        results.append(_tokens(llm.generate(PROMPTS[:4], GREEDY, lora_name=names)))
        if speculative is not None:
            assert _spec_counts(llm)[1] > 0
    assert results[1] == results[0]


VARIANTS = ["generic", "avx2", "avx512", "amx"]


def _skip_without(variant: str) -> None:
    try:
        with cpu_ops.use_variant(variant):
            pass
    except Exception as exc:  # the CPU lacks the variant's flags
        pytest.skip(f"{variant}: {exc}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_greedy_identical_on_every_cpu_variant(
    tiny_gguf_factory: Callable[..., str], variant: str
) -> None:
    """Q8_0 GGUFs on the packed record path of each C kernel variant this CPU runs: the target's own
    weights as draft (every draft accepted: the draft's KV follows the accepted tokens exactly) and
    another model's (mostly rejected), the same tokens as without a draft."""
    _skip_without(variant)
    target = tiny_gguf_factory("llama")
    results = []
    counts = []
    for draft in (None, target, tiny_gguf_factory("qwen2")):
        llm = _llm(target, None if draft is None else _draft(draft), cpu_kernels=variant)
        results.append(_tokens(llm.generate(PROMPTS, GREEDY)))
        counts.append(_spec_counts(llm))
        del llm
    assert results[1] == results[0]
    assert results[2] == results[0]
    (_, _), (right_drafted, right_accepted), (wrong_drafted, wrong_accepted) = counts
    assert right_drafted > 0 and right_accepted == right_drafted
    assert wrong_drafted > 0 and wrong_accepted < 0.5 * wrong_drafted


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", VARIANTS[1:]
)  # generic: the packed tiny GGUFs above (SmolLM2 through the generic C kernels is slow)
def test_smollm2_greedy_identical_with_a_draft_model(smollm2_gguf: str, tmp_path: Path, variant: str) -> None:
    """SmolLM2 drafted for by itself (mostly right) and by a tiny random model of its tokenizer (mostly
    wrong), on each C kernel variant: a code-editing prompt and a free one, the tokens without drafts."""
    _skip_without(variant)
    from izh.model.loader import load_model_config

    tiny = build_tiny_draft(tmp_path / "tiny", smollm2_gguf, load_model_config(smollm2_gguf).vocab_size)
    function = (
        "def area(w, h):\n    if w < 0 or h < 0:\n        raise ValueError('negative')\n    return w * h\n"
    )
    prompts = [
        [
            {
                "role": "user",
                "content": f"```python\n{function}```\nRepeat this function, renaming w to width.",
            }
        ],
        [{"role": "user", "content": "Write two sentences about the sea."}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    results = []
    for draft in (None, smollm2_gguf, tiny):
        speculative = None if draft is None else _draft(draft, k=5)
        # One thread: a 2-thread OpenMP team on a host whose other work takes a core waits at every barrier
        # (minutes instead of seconds); the bits do not depend on the thread count (test_gguf_blocks).
        llm = LLM(smollm2_gguf, speculative=speculative, cpu_kernels=variant, max_model_len=512,
                  kv_cache_memory_bytes=64 << 20, num_threads=1)  # fmt: skip
        results.append([_tokens(llm.chat(p, params))[0] for p in prompts])
        if draft is not None:
            drafted, accepted = _spec_counts(llm)
            assert drafted > 0 and (accepted == drafted if draft == smollm2_gguf else accepted < drafted)
        del llm
    assert results[1] == results[0]
    assert results[2] == results[0]


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama_dir: str, tmp_path: Path) -> None:
    swapped = swap_two_tokens(tiny_llama_dir, tmp_path / "swapped")
    with pytest.raises(ModelLoadError, match=r"tokenizer differs from the served model's \(2 tokens differ"):
        _llm(tiny_llama_dir, _draft(swapped))
    bigger = build_tiny_draft(tmp_path / "bigger", tiny_llama_dir, vocab_size=640)
    with pytest.raises(ModelLoadError, match="vocabulary has 640 tokens, the served model's 512"):
        _llm(tiny_llama_dir, _draft(bigger))
    with pytest.raises(ModelLoadError, match="the draft model: "):
        _llm(tiny_llama_dir, _draft(str(tmp_path / "missing.gguf")))
