"""The engine on a GGUF served in its own blocks (a tiny Qwen2 in Q5_0, which izh's records cannot hold):
the runner keeps the file's blocks, and a request's greedy tokens are the same alone and in a batch."""

from __future__ import annotations

import pytest

from izh import LLM, SamplingParams
from izh.kernels import cpu as cpu_ops
from izh.model.packed import GGUFBlocks

PROMPTS = ["def main():\n    return 42", "The capital of France is", "1, 2, 3, 4,"]

pytestmark = pytest.mark.skipif(
    not cpu_ops.records_f32_available(), reason="izh's C kernels are not built here"
)


def test_a_q5_0_gguf_runs_in_its_own_blocks_and_alone_equals_batched(tiny_gguf_factory) -> None:
    llm = LLM(
        tiny_gguf_factory("qwen2", "Q5_0"), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256
    )
    model = llm.engine_core.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.packed, GGUFBlocks)
    assert isinstance(layer.mlp.down_proj.packed, GGUFBlocks)
    assert model.model.embed_tokens.packed is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in PROMPTS]
    assert batched == alone


def test_the_fused_decode_stack_reads_the_blocks_and_gives_the_module_paths_logprobs(
    tiny_gguf_factory,
) -> None:
    """A float32 model in GGUF blocks (Qwen2: qkv bias) decodes through the fused C stack, and its tokens
    and logprobs are exactly the module path's."""
    llm = LLM(
        tiny_gguf_factory("qwen2", "Q5_0"), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256
    )
    model = llm.engine_core.runner.model
    fused = model.fused_stack
    assert fused is not None
    calls: list[int] = []
    run = fused.run
    fused.run = lambda *a, _run=run: calls.append(1) or _run(*a)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    with_stack = llm.generate(PROMPTS, params)
    assert len(calls) == 7  # every decode step after the prefill
    model.fused_stack = None
    llm.engine_core.reset_prefix_cache()
    without = llm.generate(PROMPTS, params)
    for a, b in zip(with_stack, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
