"""The offline engine against references: HF transformers, one-at-a-time runs, fresh runs."""

from __future__ import annotations

import math

import pytest
import torch

from izh import LLM, SamplingParams
from izh.engine_messages import AddRequest
from izh.errors import ContextLengthExceeded, InvalidRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42",
    "Once upon a time, in a land far away, there lived",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "a",
    "The capital of France is Paris. The capital of Germany is",
    "emoji 🙂 and 中文 text",
    "tokens tokens tokens tokens",
    "What is the meaning of life?",
    "<|im_start|>user\nhi<|im_end|>\n",
    "zzz",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
    "x = [i * i for i in range(10)]",
    "Roses are red, violets are blue",
    "The end.",
]


def _llm(path: str, **kwargs: object) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(path, **kwargs)  # type: ignore[arg-type]


def _hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: str) -> LLM:
    return _llm(tiny_llama_dir)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_greedy_equals_transformers(kind: str, tiny_checkpoint_factory) -> None:
    path = tiny_checkpoint_factory(kind)
    llm = _llm(path)
    prompts = PROMPTS[:3]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(path, out.prompt_token_ids, 16), prompt


def test_batch_equals_one_at_a_time(llama: LLM) -> None:
    batched = _tokens(llama.generate(PROMPTS, GREEDY))
    single = [_tokens(llama.generate([p], GREEDY))[0] for p in PROMPTS]
    assert batched == single
    assert len({tuple(t) for t in batched}) > 8  # the tiny model does depend on its prompt
    llama.engine_core.check_invariants()


def test_chunked_prefill_equals_whole_prefill(tiny_llama_dir: str, llama: LLM) -> None:
    chunked = _llm(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    long_prompts = [p * 4 for p in PROMPTS[:6]]
    assert _tokens(chunked.generate(long_prompts, GREEDY)) == _tokens(llama.generate(long_prompts, GREEDY))


def test_prefix_cache_hit_gives_identical_tokens(llama: LLM) -> None:
    prompt = " ".join(PROMPTS[:4])  # several full blocks
    first = llama.generate([prompt], GREEDY)[0]
    second = llama.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < second.num_cached_tokens
    assert second.num_cached_tokens >= 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llama.engine_core.make_stats()
    assert stats.prefix_cache_hits >= second.num_cached_tokens
    llama.engine_core.check_invariants()


def test_preemption_gives_identical_tokens(tiny_llama_dir: str, llama: LLM) -> None:
    # 6 blocks of 16 tokens hold one 96-token sequence; 8 prompts growing to ~60 tokens can't all fit.
    small = _llm(
        tiny_llama_dir,
        max_model_len=96,
        kv_cache_memory_bytes=small_kv_bytes(llama, num_blocks=6),
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [p for p in PROMPTS if len(llama.get_tokenizer().encode(p)) < 60][:8]
    assert _tokens(small.generate(prompts, params)) == _tokens(llama.generate(prompts, params))
    assert small.engine_core.make_stats().num_preemptions > 0
    assert small.engine_core.kv_cache_manager.num_free_blocks == small.engine_core.num_blocks


def small_kv_bytes(llm: LLM, num_blocks: int) -> int:
    return llm.engine_core.runner.kv_bytes_per_block() * num_blocks


def test_seeded_sampling_is_reproducible_across_batches(llama: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = _tokens(llama.generate([PROMPTS[1]], seeded))[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llama.generate(PROMPTS[:5], [others, seeded, others, others, others])
    assert mixed[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99, ignore_eos=True)
    assert _tokens(llama.generate([PROMPTS[1]], different_seed))[0] != alone


def test_n_children_share_the_prompt(llama: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7, ignore_eos=True)
    out = llama.generate([PROMPTS[2]], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_match_transformers(tiny_llama_dir: str, llama: LLM) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llama.generate([PROMPTS[1]], params)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    num_prompt = len(out.prompt_token_ids)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == num_prompt
    for pos in range(1, num_prompt):
        entry = out.prompt_logprobs[pos]
        assert entry is not None and entry.chosen.token_id == ids[pos]
        assert math.isclose(entry.chosen.logprob, ref[pos - 1, ids[pos]].item(), abs_tol=1e-4)
        assert len(entry.top) == 2
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 4
    for k, entry in enumerate(logprobs):
        row = ref[num_prompt - 1 + k]
        assert entry.chosen.token_id == int(row.argmax()) and entry.rank == 1
        assert [t.token_id for t in entry.top] == row.topk(3).indices.tolist()
        assert math.isclose(entry.chosen.logprob, row.max().item(), abs_tol=1e-4)


def test_stop_strings_and_stop_tokens(llama: LLM) -> None:
    free = llama.generate([PROMPTS[3]], GREEDY)[0].outputs[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    out = llama.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == free.text[: free.text.index(stop)]
    stop_id = free.token_ids[3]
    out = llama.generate(
        [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id])
    )
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert llama.engine_core.kv_cache_manager.usage == 0.0


def test_abort_frees_every_block(llama: LLM) -> None:
    core = llama.engine_core
    for i, prompt in enumerate(PROMPTS):
        ids = llama.get_tokenizer().encode(prompt)
        core.add_request(
            AddRequest(request_id=f"a{i}", prompt_token_ids=ids, sampling_params=GREEDY, arrival_time=0)
        )
    core.step()
    core.step()
    assert core.kv_cache_manager.usage > 0
    outputs = core.abort_requests([f"a{i}" for i in range(len(PROMPTS))])
    assert {o.finish_reason for o in outputs} == {"abort"}
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    core.check_invariants()


def test_bad_requests_fail_alone(llama: LLM) -> None:
    with pytest.raises(ContextLengthExceeded, match="maximum context length"):
        llama.generate([{"prompt_token_ids": [5] * 2000}], GREEDY)
    with pytest.raises(InvalidRequest, match="out of range"):
        llama.generate([{"prompt_token_ids": [10**6]}], GREEDY)
    with pytest.raises(InvalidRequest) as err:
        llama.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"
    assert _tokens(llama.generate([PROMPTS[0]], GREEDY)) == _tokens(llama.generate([PROMPTS[0]], GREEDY))
    assert not llama.engine_core.has_unfinished_requests()


@pytest.mark.slow
def test_smollm2_chat_greedy_equals_transformers(smollm2_gguf: str, smollm2_hf_reference) -> None:
    from tests.fixtures.smollm2 import NUM_GENERATED, SMOLLM2_CHAT_MESSAGES

    # Dense float32 weights, as transformers runs the dequantized GGUF (auto would pack them as int4).
    llm = LLM(smollm2_gguf, quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True)
    out = llm.chat(SMOLLM2_CHAT_MESSAGES, params)[0]
    assert out.prompt_token_ids == smollm2_hf_reference.prompt_ids
    assert out.outputs[0].token_ids == smollm2_hf_reference.greedy_tokens
    assert "Paris" in out.outputs[0].text


@pytest.mark.slow
def test_smollm2_default_int4_answers_like_transformers(smollm2_gguf: str, smollm2_hf_reference) -> None:
    """The default settings on every CPU: int4 records with float32 activations (int8 inside the
    matmuls)."""
    from tests.fixtures.smollm2 import NUM_GENERATED, SMOLLM2_CHAT_MESSAGES

    llm = LLM(smollm2_gguf, kv_cache_memory_bytes=64 << 20, max_model_len=512)
    runner = llm.engine_core.runner
    assert (runner.dtype, runner.quantization) == (torch.float32, "int4")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True)
    out = llm.chat(SMOLLM2_CHAT_MESSAGES, params)[0].outputs[0]
    # Other kernels and roundings than float32: the answer (its first 8 tokens) must still be the same.
    assert out.token_ids[:8] == smollm2_hf_reference.greedy_tokens[:8]
    assert out.text.startswith("The capital of France is Paris.")


def test_invariants_hold_after_every_step_under_preemption(tiny_llama_dir: str, llama: LLM) -> None:
    small = _llm(tiny_llama_dir, max_model_len=96, kv_cache_memory_bytes=small_kv_bytes(llama, num_blocks=6))
    core = small.engine_core
    tokenizer = small.get_tokenizer()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:10]):
        ids = tokenizer.encode(prompt)[:60]
        core.add_request(
            AddRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling_params=params, arrival_time=i)
        )
    finished = set()
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason is not None:
                finished.add(out.request_id)
        core.check_invariants()
        core.scheduler.check_invariants()
        steps += 1
        if steps == 5:
            core.abort_requests(["r3"])
            finished.add("r3")
    assert finished == {f"r{i}" for i in range(10)}
    assert core.make_stats().num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_llama_dir: str) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [_tokens(_llm(tiny_llama_dir, seed=seed).generate(PROMPTS[:4], params)) for seed in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
