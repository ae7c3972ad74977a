"""Prompt-only requests (max_tokens 0, how eval harnesses score a prompt) in the offline engine: the
prompt logprobs equal max_tokens 1's and transformers', nothing is sampled, and neither batching,
chunked prefill, preemption nor the prefix cache changes any result."""

from __future__ import annotations

import math

import pytest
import torch

from izh import LLM, SamplingParams
from izh.errors import ContextLengthExceeded
from izh.frontend.output_processor import PositionLogprobs
from tests.engine.test_llm import GREEDY, PROMPTS, _llm, _tokens, small_kv_bytes

SCORE = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: str) -> LLM:
    return _llm(tiny_llama_dir)


def _flat(prompt_logprobs: list[PositionLogprobs | None] | None) -> list[tuple[int, float] | None]:
    """(token id, logprob) per prompt position: what scoring reads."""
    assert prompt_logprobs is not None
    return [None if p is None else (p.chosen.token_id, p.chosen.logprob) for p in prompt_logprobs]


def _assert_close(got: list[tuple[int, float] | None], want: list[tuple[int, float] | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert g[0] == w[0] and math.isclose(g[1], w[1], abs_tol=1e-4)


def test_prompt_logprobs_equal_max_tokens_1_and_transformers(tiny_llama_dir: str, llama: LLM) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[6]
    scored = llama.generate([prompt], SCORE)[0]
    one = llama.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    completion = scored.outputs[0]
    assert completion.token_ids == [] and completion.text == ""
    assert completion.finish_reason == "length"
    assert len(one.outputs[0].token_ids) == 1
    _assert_close(_flat(scored.prompt_logprobs), _flat(one.prompt_logprobs))
    assert scored.prompt_logprobs is not None
    assert all(p is None or len(p.top) == 2 for p in scored.prompt_logprobs)

    ids = scored.prompt_token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [None] + [(ids[pos], ref[pos - 1, ids[pos]].item()) for pos in range(1, len(ids))]
    _assert_close(_flat(scored.prompt_logprobs), want)
    assert not llama.engine_core.has_unfinished_requests()
    llama.engine_core.check_invariants()


def test_a_one_token_prompt_scores_as_one_null(llama: LLM) -> None:
    out = llama.generate([{"prompt_token_ids": [42]}], SCORE)[0]
    assert _flat(out.prompt_logprobs) == [None]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == []


def test_scoring_beside_generation_changes_neither(llama: LLM) -> None:
    generating = PROMPTS[:6]
    scoring = PROMPTS[6:12]
    alone_tokens = _tokens(llama.generate(generating, GREEDY))
    alone_scores = [_flat(o.prompt_logprobs) for o in llama.generate(scoring, SCORE)]
    # Interleaved, so the scoring prefills share steps with the decodes.
    prompts = [p for pair in zip(generating, scoring, strict=True) for p in pair]
    params = [GREEDY, SCORE] * len(generating)
    mixed = llama.generate(prompts, params)
    assert _tokens(mixed[0::2]) == alone_tokens
    for out, want in zip(mixed[1::2], alone_scores, strict=True):
        assert out.outputs[0].token_ids == []
        _assert_close(_flat(out.prompt_logprobs), want)
    assert llama.engine_core.make_stats().num_generation_tokens > 0
    llama.engine_core.check_invariants()


def test_chunked_prefill_gives_the_same_scores(tiny_llama_dir: str, llama: LLM) -> None:
    chunked = _llm(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=4)
    long_prompts = [p * 4 for p in PROMPTS[:4]]
    for got, want in zip(
        chunked.generate(long_prompts, SCORE), llama.generate(long_prompts, SCORE), strict=True
    ):
        assert got.outputs[0].token_ids == []
        _assert_close(_flat(got.prompt_logprobs), _flat(want.prompt_logprobs))
    chunked.engine_core.check_invariants()


def test_preempted_scoring_recomputes_to_the_same_scores(tiny_llama_dir: str, llama: LLM) -> None:
    # 6 blocks of 16 tokens and 16-token chunks: generations that grow preempt the later-arriving
    # scoring requests in the middle of their prefill, which then starts over.
    small = _llm(
        tiny_llama_dir,
        max_model_len=96,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=small_kv_bytes(llama, num_blocks=6),
        enable_prefix_caching=False,
    )
    tokenizer = llama.get_tokenizer()
    generating = [p for p in PROMPTS if len(tokenizer.encode(p)) < 30][:3]
    scoring = [{"prompt_token_ids": tokenizer.encode(p * 4)[:60]} for p in PROMPTS[:3]]
    grow = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = small.generate([*generating, *scoring], [grow] * len(generating) + [SCORE] * len(scoring))
    assert small.engine_core.make_stats().num_preemptions > 0
    assert _tokens(outputs[: len(generating)]) == _tokens(llama.generate(generating, grow))
    for got, want in zip(outputs[len(generating) :], llama.generate(scoring, SCORE), strict=True):
        _assert_close(_flat(got.prompt_logprobs), _flat(want.prompt_logprobs))
    assert small.engine_core.kv_cache_manager.num_free_blocks == small.engine_core.num_blocks


def test_a_prompt_only_prefill_feeds_the_prefix_cache(llama: LLM) -> None:
    prompt = " ".join(PROMPTS[8:12])  # several full blocks
    warm = llama.generate([prompt], SamplingParams(max_tokens=0))[0]
    assert warm.outputs[0].token_ids == [] and warm.prompt_logprobs is None
    hit = llama.generate([prompt], GREEDY)[0]
    assert hit.num_cached_tokens >= 16
    llama.engine_core.reset_prefix_cache()
    fresh = llama.generate([prompt], GREEDY)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_a_prompt_only_request_may_fill_the_whole_context(tiny_llama_dir: str) -> None:
    llm = _llm(tiny_llama_dir, max_model_len=64)
    ids = [(7 * i) % 400 + 20 for i in range(64)]
    out = llm.generate([{"prompt_token_ids": ids}], SCORE)[0]
    assert len(_flat(out.prompt_logprobs)) == 64
    with pytest.raises(ContextLengthExceeded):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))
