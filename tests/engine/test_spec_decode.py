"""Speculative decoding (izh.engine.spec_decode): the proposer, the rejection sampler's distribution, and
the engine's tokens with drafts against the same engine without them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from izh import LLM, SamplingParams
from izh.config import SpeculativeConfig
from izh.engine.spec_decode import NgramProposer, verify_greedy, verify_random
from izh.kernels import cpu as cpu_ops
from izh.sampling_params import StructuredOutputsParams

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
ALWAYS = SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None
)
"""Drafting at any load: the tests' batches are bigger than the default pause threshold."""

# Prompts whose continuation repeats them (drafts mostly right) and prompts that do not (mostly wrong).
PROMPTS = [
    "a b c d e f g a b c d e f g a b c d e f g a b c",
    "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9",
    "def f(x):\n    return x + 1\n\ndef f(x):\n    return x",
    "Once upon a time, in a land far away, there lived",
    "The capital of France is Paris. The capital of Germany is",
    "zzz",
]


def _llm(path: str, speculative: SpeculativeConfig | None, **kwargs: object) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(path, speculative=speculative, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base(tiny_llama_dir: str) -> LLM:
    return _llm(tiny_llama_dir, None)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir: str) -> LLM:
    return _llm(tiny_llama_dir, ALWAYS)


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine_core.make_stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


# --- the proposer and the verification, alone ------------------------------------------------------


def test_ngram_proposer_takes_the_longest_latest_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    # Suffix [7, 8, 9] occurs at 1 (then 10, 11, 12) and at 6 (then 13, 14): the latest one wins.
    tokens = [0, 7, 8, 9, 10, 11, 7, 8, 9, 13, 14, 5, 7, 8, 9]
    assert proposer.propose(tokens, 10) == [13, 14, 5]
    assert proposer.propose(tokens, 2) == [13, 14]  # capped by the room left
    assert proposer.propose(tokens, 0) == []
    # Only a 1-token suffix matches: below prompt_lookup_min, no draft.
    assert proposer.propose([1, 2, 3, 4, 2], 5) == []
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4, 2], 5) == [3, 4, 2]
    # A 2-token match [5, 6] beats a 3-token suffix that never occurred.
    assert proposer.propose([5, 6, 1, 9, 5, 6], 5) == [1, 9, 5]
    assert proposer.propose([1, 2], 5) == []


def test_greedy_verification_accepts_the_longest_agreeing_prefix() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]).token_ids == [5, 6, 7, 8]
    result = verify_greedy([5, 9, 7, 8], [5, 6, 7])
    assert (result.token_ids, result.num_accepted) == ([5, 9], 1)
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]).token_ids == [4]


def _chi2_pvalue(counts: np.ndarray, p: torch.Tensor) -> float:
    """Chi-square p-value of `counts` against the distribution `p` (its zero cells left out)."""
    p64 = p.double().numpy()
    keep = p64 > 0
    expected = counts.sum() * p64[keep] / p64[keep].sum()
    return float(chisquare(counts[keep], expected).pvalue)


def test_rejection_sampling_follows_the_target_distribution() -> None:
    """Chi-square over a 6-token vocabulary: the first emitted token follows p0 whatever the draft, the
    second (after an accepted first draft) follows p1; a draft the target gives probability 0 is never
    accepted. Seeded draws repeat."""
    probs = torch.tensor(
        [
            [0.05, 0.10, 0.40, 0.15, 0.00, 0.30],
            [0.30, 0.20, 0.10, 0.05, 0.25, 0.10],
            [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
        ]
    )
    draft = [2, 4]
    generator = torch.Generator().manual_seed(1234)
    trials = 20000
    first = np.zeros(6)
    second = np.zeros(6)
    for _ in range(trials):
        tokens = verify_random(probs, draft, generator).token_ids
        first[tokens[0]] += 1
        if tokens[0] == 2:
            second[tokens[1]] += 1
    assert _chi2_pvalue(first, probs[0]) > 1e-3
    assert first[4] == 0
    assert _chi2_pvalue(second, probs[1]) > 1e-3
    # A draft of a zero-probability token is always rejected, and the residual is p itself.
    zero = np.zeros(6)
    for _ in range(5000):
        zero[verify_random(probs[:2], [4], generator).token_ids[0]] += 1
    assert zero[4] == 0
    assert _chi2_pvalue(zero, probs[0]) > 1e-3
    runs = [
        [verify_random(probs, draft, g).token_ids for _ in range(50)]
        for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


# --- the engine: the same tokens with drafts as without ---------------------------------------------


def test_greedy_tokens_identical_with_drafts(base: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(base.generate(PROMPTS, params))
    drafted_before, accepted_before = _spec_counts(spec)
    got = _tokens(spec.generate(PROMPTS, params))
    assert got == expected
    drafted, accepted = _spec_counts(spec)
    # Both kinds of draft happened: accepted ones (the steps gained) and rejected ones (rolled back).
    assert accepted - accepted_before > 0
    assert drafted - drafted_before > accepted - accepted_before
    # One at a time too (drafting below any threshold), and with the default threshold.
    assert [_tokens(spec.generate([p], params))[0] for p in PROMPTS[:3]] == expected[:3]
    spec.engine_core.check_invariants()
    spec.engine_core.scheduler.check_invariants()


def test_logprobs_stop_strings_and_penalties_match(base: LLM, spec: LLM) -> None:
    """The target's logprobs for every accepted token, stop strings cut where one token a step would,
    max_tokens, min_tokens, penalties and bad words see the drafts as sampled output."""
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=["e f", "7 8"]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.5, bad_words=["a b"]),
    ]
    for params in cases:
        want = base.generate(PROMPTS, params)
        got = spec.generate(PROMPTS, params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, params
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            if params.logprobs:
                got_lp = [(p.chosen.token_id, p.chosen.logprob) for p in g.outputs[0].logprobs]
                want_lp = [(p.chosen.token_id, p.chosen.logprob) for p in w.outputs[0].logprobs]
                assert [t for t, _ in got_lp] == [t for t, _ in want_lp]
                assert np.allclose([v for _, v in got_lp], [v for _, v in want_lp], atol=1e-5)
                assert [len(p.top) for p in g.outputs[0].logprobs] == [3] * len(got_lp)


def test_seeded_sampling_reproducible_and_n_children(spec: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=11)
    first = _tokens(spec.generate(PROMPTS, params))
    assert _tokens(spec.generate(PROMPTS, params)) == first
    drafted, _ = _spec_counts(spec)
    assert drafted > 0
    out = spec.generate(PROMPTS[0], SamplingParams(temperature=1.0, n=3, max_tokens=20, ignore_eos=True))
    assert len(out[0].outputs) == 3 and all(len(c.token_ids) == 20 for c in out[0].outputs)


def test_prefix_cache_never_holds_rejected_drafts(tiny_llama_dir: str, base: LLM) -> None:
    """A second request that hits the blocks the first one computed with drafts continues exactly as
    without drafts: no block cached under a known prefix held a rejected draft's KV."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm = _llm(tiny_llama_dir, ALWAYS, block_size=4)
    reference = _llm(tiny_llama_dir, None, block_size=4, enable_prefix_caching=False)
    for prompt in PROMPTS[:4]:
        first = llm.generate(prompt, params)[0]
        assert first.outputs[0].token_ids == reference.generate(prompt, params)[0].outputs[0].token_ids
        follow = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids[:45]}
        hit = llm.generate(follow, params)[0]
        assert hit.num_cached_tokens > 0
        assert hit.outputs[0].token_ids == reference.generate(follow, params)[0].outputs[0].token_ids
    llm.engine_core.check_invariants()


def test_preemption_with_drafts_gives_identical_tokens(tiny_llama_dir: str, base: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(base.generate(PROMPTS, params))
    # Room for about two sequences: the others are preempted and recomputed, drafts and all.
    tight = _llm(tiny_llama_dir, ALWAYS, block_size=4, max_model_len=96, kv_cache_memory_bytes=30 * 2048)
    core = tight.engine_core
    assert core.num_blocks == 30
    assert _tokens(tight.generate(PROMPTS, params)) == expected
    assert core.scheduler.num_preemptions > 0
    assert _spec_counts(tight)[1] > 0
    core.check_invariants()


def test_opt_out_and_threshold_draft_nothing(tiny_llama_dir: str, base: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = _llm(tiny_llama_dir, NGRAM)  # pauses above 4 running requests
    want = _tokens(base.generate(PROMPTS, params))
    assert _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         speculative_decoding=False))) == want  # fmt: skip
    assert _spec_counts(llm) == (0, 0)
    assert _tokens(llm.generate(PROMPTS, params)) == want
    # 6 requests > 4: drafting starts only once two of them finished (they all run to 24 tokens: never).
    assert _spec_counts(llm) == (0, 0)
    assert _tokens(llm.generate(PROMPTS[:1], params)) == want[:1]
    assert _spec_counts(llm)[0] > 0


def test_structured_outputs_with_drafts_match(base: LLM, spec: LLM) -> None:
    """Drafts the grammar forbids are cut before verification, the masks follow the drafts: the same
    constrained outputs as without drafts, and drafts were verified for them."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    specs = [
        StructuredOutputsParams(choice=["a b c d e f g a b c d e f g", "zzz zzz zzz"]),
        StructuredOutputsParams(regex=r"(a b c d e f g ){3}[0-9]{2}"),
        StructuredOutputsParams(json=json.dumps(schema)),
    ]
    for structured in specs:
        params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=structured)
        before = _spec_counts(spec)
        want = base.generate(PROMPTS[:3], params)
        got = spec.generate(PROMPTS[:3], params)
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, structured
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if structured.json is None:
            assert _spec_counts(spec)[1] > before[1], structured  # repeated text: drafts accepted
    spec.engine_core.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    ["generic", "avx2", "avx512"],
)
def test_smollm2_greedy_identical_on_every_cpu_variant(smollm2_gguf: str, variant: str) -> None:
    """The real model on each C kernel variant this CPU runs (each on the float32 record path, the CPU
    default): a code-editing prompt (drafts mostly right) and a free one
    (mostly wrong), with and without drafts."""
    try:
        with cpu_ops.use_variant(variant):
            pass
    except Exception as exc:  # the CPU lacks the variant's flags
        pytest.skip(f"{variant}: {exc}")
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
    for speculative in (None, SpeculativeConfig()):
        llm = LLM(smollm2_gguf, speculative=speculative, cpu_kernels=variant, max_model_len=512,
                  kv_cache_memory_bytes=32 << 20)  # fmt: skip
        results.append([_tokens(llm.chat(p, params))[0] for p in prompts])
        if speculative is not None:
            drafted, accepted = _spec_counts(llm)
            assert 0 < accepted < drafted
        del llm
    assert results[1] == results[0]


def test_lora_requests_with_drafts_match(tiny_llama_dir: str, tmp_path) -> None:
    """Adapter and base requests in one batch, drafting: the same tokens as without drafts."""
    from tests.fixtures.lora import build_peft_adapter

    adapter = build_peft_adapter(tiny_llama_dir, tmp_path / "r8", r=8, alpha=16, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    names = ["a", None, "a", None]
    results = []
    for speculative in (None, ALWAYS):
        llm = _llm(tiny_llama_dir, speculative, lora_modules={"a": adapter})
        results.append(_tokens(llm.generate(PROMPTS[:4], params, lora_name=names)))
        if speculative is not None:
            assert _spec_counts(llm)[1] > 0
    assert results[1] == results[0]
