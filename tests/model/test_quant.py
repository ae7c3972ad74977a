"""Weight-only packed matmuls: the formats (izh.model.packed), the packing pass and auto policy
(izh.model.packing), and the engine using them."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch

from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.llm import LLM
from izh.model.layers import Linear
from izh.model.loader import checkpoint_quant_types, load_model
from izh.model.packed import (
    Int4Weight,
    Int8Weight,
    Q4Records,
    Q8Records,
    quantize_int4,
    quantize_int8,
    quantize_q4_records,
    quantize_q8_records,
)
from izh.model.packing import pack_model_weights, resolve_quantization
from izh.sampling_params import SamplingParams

CPU = torch.device("cpu")


needs_records = pytest.mark.skipif(
    not cpu_ops.qgemm_available(), reason="izh's record kernels need AVX512-BF16 and the C kernels"
)
# The packed kinds this machine gets: izh's records where its kernels run, else PyTorch's formats.
INT4_KIND, INT8_KIND = (Q4Records, Q8Records) if cpu_ops.qgemm_available() else (Int4Weight, Int8Weight)


def _gguf_values(rows: int, cols: int, qtype: str = "Q4_1", seed: int = 0) -> torch.Tensor:
    """A weight exactly as a GGUF tensor of `qtype` stores it, dequantized (by the gguf package)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), kind)
    return torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(rows, cols).copy())


def _q4_1_values(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return _gguf_values(rows, cols, "Q4_1", seed)


def _int4_llm(path: str, kv_cache_memory_bytes: int = 4 << 20, dtype: str = "bfloat16") -> LLM:
    """An engine (bfloat16 unless said) with every linear packed as int4 (explicitly, so float checkpoints
    too)."""
    return LLM(
        path,
        dtype=dtype,
        quantization="int4",
        kv_cache_memory_bytes=kv_cache_memory_bytes,
    )


def test_int4_packing_of_q4_1_values_recovers_them() -> None:
    weight = _q4_1_values(64, 128)
    packed = quantize_int4(weight.bfloat16())
    # Multiplying by the identity reads the packed weight back: w = (q - 8) * scale + zero.
    eye = torch.eye(128, dtype=torch.bfloat16)
    unpacked = packed.matmul(eye).float().t()
    # Exact but for bfloat16 rounding of the scales, zeros and the output (relative 2^-8 each).
    err = (unpacked - weight).abs()
    assert err.max() <= 0.01 * weight.abs().max(), err.max()
    assert packed.nbytes < weight.numel() * 2 / 3  # 4-bit codes + bf16 scale/zero per 32 weights


def test_int4_and_int8_matmuls_match_the_dense_product() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * 0.1
    x = torch.randn(3, 64).bfloat16()
    dense = x.float() @ weight.t()
    for packed, tolerance in (
        (quantize_int4(weight.bfloat16()), 0.12),
        (quantize_int8(weight.bfloat16()), 0.02),
    ):
        out = packed.matmul(x).float()
        assert out.shape == (3, 96)
        rel = (out - dense).norm() / dense.norm()
        assert rel < tolerance, (type(packed).__name__, rel)


def test_constant_group_and_zero_row_pack_without_nan() -> None:
    weight = torch.zeros(16, 64, dtype=torch.bfloat16)
    weight[0, :32] = 0.5
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    for packed in (quantize_int4(weight), quantize_int8(weight)):
        out = packed.matmul(x).float()
        assert torch.isfinite(out).all()
        assert out[0, 0].item() == pytest.approx(16.0) and out[0, 1:].abs().max() == 0


def test_int4_rejects_shapes_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="out % 16"):
        quantize_int4(torch.zeros(24, 64))


def test_resolve_quantization_policy() -> None:
    gguf_q4 = {"model.layers.0.mlp.up_proj.weight": "Q4_1"}
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_quantization("auto", device=CPU, dtype=bf16, source_types=gguf_q4) == "int4"
    assert resolve_quantization("auto", device=CPU, dtype=bf16, source_types={}) == "none"
    assert resolve_quantization("none", device=CPU, dtype=bf16, source_types=gguf_q4) == "none"
    assert resolve_quantization("int8", device=CPU, dtype=bf16, source_types={}) == "int8"
    assert resolve_quantization("auto", device=CPU, dtype=fp32, source_types={}) == "none"
    # float32 packs on every CPU where izh's C kernels run (every variant has the float32 records) ...
    with cpu_ops.use_variant("generic"):
        assert resolve_quantization("auto", device=CPU, dtype=fp32, source_types=gguf_q4) == "int4"
        assert resolve_quantization("int8", device=CPU, dtype=fp32, source_types={}) == "int8"
    # ... and not without them.
    with cpu_ops.use_variant("off"):
        assert resolve_quantization("auto", device=CPU, dtype=fp32, source_types=gguf_q4) == "none"
        with pytest.raises(ModelLoadError, match=r"float32 needs izh's C kernels.*--quantization none"):
            resolve_quantization("int4", device=CPU, dtype=fp32, source_types={})
    with pytest.raises(ModelLoadError, match=r"cuda, float32.*--quantization none"):
        resolve_quantization("int4", device=torch.device("cuda"), dtype=fp32, source_types={})
    with pytest.raises(ModelLoadError, match="unknown quantization 'int3'"):
        resolve_quantization("int3", device=CPU, dtype=bf16, source_types={})


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_packing_follows_the_stored_types(tiny_gguf_factory, qtype: str) -> None:
    path = tiny_gguf_factory("llama", qtype)
    types = checkpoint_quant_types(path)
    assert types and set(types.values()) == {qtype}
    model, _ = load_model(path, dtype=torch.bfloat16)
    added = pack_model_weights(model, "int4", types, requested="auto")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kinds = {type(m.packed) for m in linears}
    # Q4_1 holds exactly in int4; Q8_0 would lose precision there, so it gets int8.
    assert kinds == ({INT4_KIND} if qtype == "Q4_1" else {INT8_KIND})
    assert isinstance(model.packed_lm_head, INT8_KIND)
    assert added == sum(m.packed.nbytes for m in linears) + model.packed_lm_head.nbytes


def test_small_batches_use_the_packed_weights_and_stay_close_to_dense(tiny_gguf_factory) -> None:
    path = tiny_gguf_factory("llama", "Q4_1")
    model, _ = load_model(path, dtype=torch.bfloat16)
    pack_model_weights(model, "int4", checkpoint_quant_types(path), requested="auto")
    linear = model.model.layers[0].mlp.gate_up_proj
    assert linear.packed is not None
    rows = linear.packed.max_rows
    assert rows == (cpu_ops.qgemm_max_rows() if cpu_ops.qgemm_available() else 8)
    torch.manual_seed(1)
    x = torch.randn(rows + 1, linear.in_features).bfloat16()
    small = linear(x[:rows])
    big = linear(x)  # over the threshold: the dense bfloat16 weight
    assert torch.equal(big, torch.nn.functional.linear(x, linear.weight))
    assert torch.equal(small, linear.packed.matmul(x[:rows]))
    assert torch.allclose(small.float(), big[:rows].float(), rtol=0.05, atol=0.02)


def test_engine_picks_float32_and_int4_for_a_q4_gguf_and_generates_like_dense(
    tiny_gguf_factory,
) -> None:
    """auto: float32 activations over int4 records on every CPU with the C kernels (one packed path, the
    integer record kernels, at every batch size and on every variant)."""
    path = tiny_gguf_factory("llama", "Q4_1")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompt = [{"prompt_token_ids": [5, 17, 33, 9, 61, 2]}]
    auto = LLM(path, kv_cache_memory_bytes=4 << 20)
    runner = auto.engine_core.runner
    assert (runner.dtype, runner.quantization) == (torch.float32, "int4")
    dense = LLM(path, kv_cache_memory_bytes=4 << 20, quantization="none")
    assert (dense.engine_core.runner.dtype, dense.engine_core.runner.quantization) == (torch.float32, "none")
    packed_out = auto.generate(prompt, params)[0].outputs[0]
    dense_out = dense.generate(prompt, params)[0].outputs[0]
    assert len(packed_out.token_ids) == 8
    # Same weights, different kernels and roundings: the first token agrees, with a close log-probability.
    assert packed_out.token_ids[0] == dense_out.token_ids[0]
    assert packed_out.logprobs[0].chosen.logprob == pytest.approx(
        dense_out.logprobs[0].chosen.logprob, abs=0.1
    )


def test_float32_records_serve_every_step_and_replace_the_dense_weights(tiny_gguf_factory) -> None:
    """float32 records take prefills too, so the dense weights are freed; a row's result does not depend
    on its batch, so tokens are the same whether prompts run together or one at a time."""
    path = tiny_gguf_factory("llama", "Q4_1")
    llm = LLM(path, kv_cache_memory_bytes=8 << 20, dtype="float32")
    model = llm.engine_core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, Q4Records | Q8Records) for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)  # dense copies dropped
    assert isinstance(model.packed_lm_head, Q8Records)
    assert model.fused_stack is not None and model.fused_stack.max_tokens > 4096
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [3 + i, 40, 7 * i % 500, 11, 90][: 2 + i % 4]} for i in range(7)]
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together, strict=True):
        llm.engine_core.reset_prefix_cache()
        alone = llm.generate([prompt], params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs


@needs_records
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_records_hold_gguf_values_up_to_bfloat16_scales(qtype: str) -> None:
    weight = _gguf_values(48, 96, qtype, seed=3)
    if qtype == "Q4_1":
        packed = quantize_q4_records(weight.bfloat16())
        held = cpu_ops.unpack_q4(packed.records, 48, 96)
    else:
        packed = quantize_q8_records(weight.bfloat16())
        held = cpu_ops.unpack_q8(packed.records, 48, 96)
    # The file's codes come back; only the per-group scale (and minimum) are rounded to bfloat16.
    err = (held - weight).abs()
    assert err.max() <= 2**-7 * weight.abs().max(), err.max()
    assert packed.nbytes == 48 * 96 * (5 / 8 if qtype == "Q4_1" else 17 / 16)


@needs_records
def test_record_matmuls_match_the_dense_product_of_what_they_hold() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * 0.1
    x = torch.randn(5, 64).bfloat16()
    for packed, unpack, kind in (
        (quantize_q4_records(weight.bfloat16()), cpu_ops.unpack_q4, 4),
        (quantize_q8_records(weight.bfloat16()), cpu_ops.unpack_q8, 8),
    ):
        held = unpack(packed.records, 96, 64)
        if cpu_ops.qgemm_uses_amx(kind, 5):
            held = held.bfloat16().float()  # the AMX kernel multiplies the weights rounded to bfloat16
        expected = x.float() @ held.t()
        out = packed.matmul(x)
        assert out.dtype == torch.bfloat16 and out.shape == (5, 96)
        assert torch.allclose(out.float(), expected, rtol=2**-8, atol=1e-5)
        logits = torch.full((8, 96), float("nan"))
        assert packed.matmul(x, out=logits) is not None
        assert torch.allclose(logits[:5], expected, rtol=1e-5, atol=1e-5)
        assert logits[5:].isnan().all()  # rows past M untouched


def test_fused_decode_stack_gives_the_module_path_tokens(tiny_checkpoint_factory) -> None:
    """Explicit int4 packing of float checkpoints (Llama untied, Qwen2 with qkv bias): the fused C stack
    runs the small decode steps and gives exactly the modules' tokens and logprobs; Qwen3 (q/k norm)
    keeps the modules."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    for dtype, kind in itertools.product(("bfloat16", "float32"), ("llama3", "qwen2", "qwen3")):
        # 12 sequences where the stack takes them (float32, or AMX), else 6 (AVX-512 only).
        count = 12 if dtype == "float32" or cpu_ops.qgemm_max_rows() >= 12 else 6
        prompts = [
            {"prompt_token_ids": [5 + i, 17, 33 * i % 500, 9, 61, 2][: 3 + i % 4]} for i in range(count)
        ]
        llm = _int4_llm(tiny_checkpoint_factory(kind), dtype=dtype)
        model = llm.engine_core.runner.model
        fused = model.fused_stack
        kernels = cpu_ops.records_f32_available() if dtype == "float32" else cpu_ops.qgemm_available()
        if kind == "qwen3" or not kernels:
            assert fused is None
            continue
        assert fused is not None
        calls: list[int] = []
        run = fused.run
        fused.run = lambda *a, _run=run, _calls=calls: _calls.append(1) or _run(*a)  # type: ignore[method-assign]
        with_stack = llm.generate(prompts, params)
        assert len(calls) == 11  # every decode step after the prefill
        model.fused_stack = None
        llm.engine_core.reset_prefix_cache()
        without = llm.generate(prompts, params)
        for a, b in zip(with_stack, without, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_binding_new_kv_caches_drops_the_fused_stack(tiny_checkpoint_factory, dtype: str) -> None:
    llm = _int4_llm(tiny_checkpoint_factory("llama"), dtype=dtype)
    runner = llm.engine_core.runner
    model = runner.model
    kernels = cpu_ops.records_f32_available() if dtype == "float32" else cpu_ops.qgemm_available()
    assert (model.fused_stack is not None) == kernels
    model.bind_kv_caches(runner.kv_caches)
    assert model.fused_stack is None
    assert model.prepare_fused_decode() == kernels


@needs_records
def test_fused_decode_stack_rejects_a_slot_outside_the_cache(tiny_checkpoint_factory) -> None:
    from izh.model.attention import AttentionMetadata

    llm = _int4_llm(tiny_checkpoint_factory("llama"))
    runner = llm.engine_core.runner
    model = runner.model
    num_slots = runner.num_blocks * runner.block_size
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        slot_mapping=torch.tensor([num_slots], dtype=torch.int64),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1,
    )
    caches_before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode(), pytest.raises(IndexError, match="slot_mapping points past the end"):
        model(torch.tensor([5]), torch.tensor([0]), metadata)
    assert all(torch.equal(a, b) for a, b in zip(caches_before, runner.kv_caches, strict=True))


def test_fused_decode_stack_chunks_large_steps_by_sequence(tiny_checkpoint_factory, monkeypatch) -> None:
    """A step over `qgemm_max_rows()` decodes runs the stack on consecutive chunks of sequences: with AMX
    (rows independent of the batch) that gives exactly the one-call tokens and logprobs."""
    if cpu_ops.qgemm_max_rows() < 16:
        pytest.skip("needs AMX (16 decodes in one stack call)")
    from izh.model import fused_stack

    llm = _int4_llm(tiny_checkpoint_factory("llama"), kv_cache_memory_bytes=8 << 20)
    stack = llm.engine_core.runner.model.fused_stack
    assert stack is not None
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [3 + i, 40, 7 * i % 500, 11]} for i in range(16)]
    calls: list[int] = []
    decode_stack = cpu_ops.decode_stack
    monkeypatch.setattr(cpu_ops, "decode_stack", lambda *a: calls.append(a[4].shape[0]) or decode_stack(*a))
    whole = llm.generate(prompts, params)
    assert calls == [16] * 5
    calls.clear()
    monkeypatch.setattr(fused_stack.cpu_ops, "qgemm_max_rows", lambda: 8)
    assert stack.max_tokens == 8 * fused_stack.MAX_CHUNKS
    llm.engine_core.reset_prefix_cache()
    chunked = llm.generate(prompts, params)
    assert calls == [8, 8] * 5
    for a, b in zip(whole, chunked, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
