"""Mixture-of-experts models in the offline engine (float32): greedy tokens equal transformers', batched
and alone, through chunked prefill and prefix-cache hits, from safetensors and from GGUF; packed experts
give the same tokens batched and alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from izh import LLM, SamplingParams
from izh.kernels import cpu as cpu_ops
from tests.model.test_moe import _dequantized_mixtral_folder

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42",
    "Once upon a time, in a land far away, there lived",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "The capital of France is Paris. The capital of Germany is",
]


def _llm(path: str, **kwargs: object) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    kwargs.setdefault("dtype", "float32")
    return LLM(path, **kwargs)  # type: ignore[arg-type]


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
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


def _hf(path: str, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


def _check_against(llm: LLM, hf: torch.nn.Module) -> list[list[int]]:
    """Greedy tokens of every prompt in one batch equal transformers' and the prompt's alone."""
    batched = llm.generate(PROMPTS, GREEDY)
    for out in batched:
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids, GREEDY.max_tokens), out.prompt
    tokens = _tokens(batched)
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == tokens
    assert len({tuple(t) for t in tokens}) > 3  # the tiny model does depend on its prompt
    llm.engine_core.check_invariants()
    return tokens


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral", "qwen3moe_dense1"])
def test_greedy_equals_transformers_batched_and_alone(kind: str, tiny_moe_factory) -> None:
    path = tiny_moe_factory(kind)
    _check_against(_llm(path), _hf(path))


def test_chunked_prefill_and_prefix_hits_give_the_same_tokens(tiny_moe_factory) -> None:
    path = tiny_moe_factory("qwen3moe")
    whole = _llm(path, enable_prefix_caching=False)
    chunked = _llm(path, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    long_prompts = [p * 3 for p in PROMPTS]
    expected = _tokens(whole.generate(long_prompts, GREEDY))
    assert _tokens(chunked.generate(long_prompts, GREEDY)) == expected
    cached = _llm(path)
    several_blocks = [long_prompts[1], long_prompts[3]]
    first = cached.generate(several_blocks, GREEDY)
    second = cached.generate(several_blocks, GREEDY)
    assert all(o.num_cached_tokens >= 16 for o in second)
    assert _tokens(first) == _tokens(second) == [expected[1], expected[3]]
    cached.engine_core.check_invariants()


def test_qwen3moe_gguf_greedy_equals_transformers_gguf(tiny_moe_gguf_factory) -> None:
    path = Path(tiny_moe_gguf_factory("qwen3moe", "Q8_0"))
    llm = _llm(str(path), quantization="none")
    size = llm.engine_core.runner.model.config.moe.expert_intermediate_size
    _check_against(llm, _hf(str(path.parent), gguf_file=path.name, moe_intermediate_size=size))


def test_mixtral_gguf_greedy_equals_transformers(
    tiny_moe_gguf_factory, tiny_moe_factory, tmp_path: Path
) -> None:
    path = tiny_moe_gguf_factory("mixtral", "Q8_0")
    reference = _dequantized_mixtral_folder(path, tiny_moe_factory("mixtral"), tmp_path / "dequantized")
    _check_against(_llm(path, quantization="none"), _hf(reference))


def test_packed_experts_give_the_same_tokens_batched_and_alone(tiny_moe_gguf_factory) -> None:
    if not cpu_ops.records_f32_available():
        pytest.skip("izh's record kernels are not loaded here")
    llm = _llm(tiny_moe_gguf_factory("qwen3moe", "Q4_0"))  # auto: the experts packed as their own int4
    batched = _tokens(llm.generate(PROMPTS, GREEDY))
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == batched
    llm.engine_core.check_invariants()
