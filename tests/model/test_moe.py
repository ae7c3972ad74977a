"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, the routing kernel against its
reference, batch invariance of a sparse block, packed experts, and GGUF expert tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import cast

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.kernels.cpu.moe import EXPERT_FIELDS, moe_experts, moe_route, moe_route_ref
from izh.model import load_model
from izh.model.loader import checkpoint_quant_types, load_model_config
from izh.model.moe import MoeForCausalLM, SparseMoeBlock
from izh.model.packed import GGUFBlocks, Q4Records, Q8Records
from izh.model.packing import pack_model_weights
from izh.model.parallel import check_tensor_parallel
from tests.fixtures.checkpoints import llama_cpp_permute
from tests.model.test_parity import _flat_prefill as _prefill

KINDS = ["qwen3moe", "mixtral", "qwen3moe_dense1"]
PROMPTS = [
    "Hello world, the model is here.",
    "The engine server made a request with 12345 tokens, and then it said hello again!",
]


def _check_logits(ours: torch.nn.Module, hf: torch.nn.Module, prompts: list[list[int]]) -> None:
    logits = _prefill(ours, prompts)  # every prompt in ONE flat batch
    start = 0
    with torch.inference_mode():
        for ids in prompts:
            ref = hf(torch.tensor([ids])).logits[0]
            got = logits[start : start + len(ids)]
            assert (got - ref).abs().max().item() < 1e-4
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            start += len(ids)


def _hf(path: str, **kwargs: object) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(kind: str, tiny_moe_factory, tiny_tokenizer) -> None:
    path = tiny_moe_factory(kind)
    ours, config = load_model(path, dtype=torch.float32)
    assert config.moe is not None
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    _check_logits(ours, _hf(path), prompts)


def test_config_from_hf_and_gguf(tiny_moe_factory, tiny_moe_gguf_factory) -> None:
    expected = {
        # kind: (architecture, experts, top k, expert size, renormalize, dense layers, qk norm)
        "qwen3moe": ("qwen3moe", 8, 2, 32, True, (), True),
        "mixtral": ("mixtral", 8, 2, 64, True, (), False),
        "qwen3moe_dense1": ("qwen3moe", 8, 3, 32, False, (1,), True),
    }
    for kind, (arch, experts, top_k, size, renormalize, dense, qk_norm) in expected.items():
        config = load_model_config(tiny_moe_factory(kind))
        moe = config.moe
        assert moe is not None
        got = (config.architecture, moe.num_experts, moe.num_experts_per_tok, moe.expert_intermediate_size)
        assert got == (arch, experts, top_k, size)
        assert (moe.norm_topk_prob, moe.dense_layers, config.qk_norm) == (renormalize, dense, qk_norm)
    for kind in ("qwen3moe", "mixtral"):
        from_hf = load_model_config(tiny_moe_factory(kind))
        from_gguf = load_model_config(tiny_moe_gguf_factory(kind))
        assert from_gguf.moe == from_hf.moe
        assert from_gguf.architecture == from_hf.architecture
        assert from_gguf.tie_word_embeddings == from_hf.tie_word_embeddings


def test_unsupported_uses_are_refused(tiny_moe_factory, tmp_path: Path) -> None:
    model, config = load_model(tiny_moe_factory("mixtral"), dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="LoRA"):
        model.attach_lora(2, 8)
    assert model.prepare_fused_decode() is False
    with pytest.raises(ModelLoadError, match="tensor-parallel-size 1"):
        check_tensor_parallel(config, 2)
    folder = tmp_path / "windowed"
    shutil.copytree(tiny_moe_factory("mixtral"), folder)
    spec = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**spec, "sliding_window": 128}))
    with pytest.raises(ModelLoadError, match="sliding_window"):
        load_model_config(str(folder))


# --- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_experts", "top_k", "renormalize"), [(8, 2, True), (8, 3, False), (60, 4, True)]
)
def test_route_kernel_matches_reference_and_ignores_the_batch(
    num_experts: int, top_k: int, renormalize: bool
) -> None:
    if not cpu_ops.available():
        pytest.skip("the C kernels are not loaded here")
    g = torch.Generator().manual_seed(num_experts + top_k)
    x = torch.randn(67, 96, generator=g)
    router = torch.randn(num_experts, 96, generator=g) * 0.2
    routing = moe_route(x, router, top_k, renormalize)
    ids, weights = routing.expert_ids, routing.weights
    ref_ids, ref_weights = moe_route_ref(x, router, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    assert bool((ids[:, 1:] > ids[:, :-1]).all())  # ascending expert ids per token
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(67), rtol=0, atol=1e-6)
    # The pairs grouped by expert: stable, with each group's size.
    flat = ids.reshape(-1)
    expected_order = torch.argsort(flat, stable=True)
    assert torch.equal(routing.order, expected_order)
    assert torch.equal(routing.tokens, expected_order // top_k)
    assert routing.counts == torch.bincount(flat, minlength=num_experts).tolist()
    for t in (0, 5, 66):  # a token alone, and inside other batches, routes bit-identically
        alone = moe_route(x[t : t + 1], router, top_k, renormalize)
        shifted = moe_route(x[t // 2 : t + 1], router, top_k, renormalize)
        assert torch.equal(alone.expert_ids[0], ids[t]) and torch.equal(alone.weights[0], weights[t])
        assert torch.equal(shifted.expert_ids[-1], ids[t]) and torch.equal(shifted.weights[-1], weights[t])
    assert moe_route(x.bfloat16(), router, top_k, renormalize).expert_ids.shape == (67, top_k)
    for variant in cpu_ops.runnable_variants():  # every instruction-set build routes alike
        with cpu_ops.use_variant(variant):
            other = moe_route(x, router, top_k, renormalize)
        assert torch.equal(other.expert_ids, ids) and torch.equal(other.order, routing.order)
        torch.testing.assert_close(other.weights, weights, rtol=1e-5, atol=1e-6)
    with cpu_ops.use_variant(None):  # without the library: the reference, grouped the same way
        fallback = moe_route(x, router, top_k, renormalize)
    assert torch.equal(fallback.expert_ids, ids) and torch.equal(fallback.order, routing.order)
    assert torch.equal(fallback.tokens, routing.tokens) and fallback.counts == routing.counts


def _sparse_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("quantization", ["int8", "int4", "none"])
def test_a_token_alone_equals_it_in_any_batch(quantization: str, tiny_moe_factory) -> None:
    """With izh's records (each row computed alone) a token's block output is bit-identical alone and in
    any batch. Dense float32 experts run torch's matmul, whose rounding moves with the row count: there
    the routing is still identical and the output equal up to that rounding."""
    model, config = load_model(tiny_moe_factory("qwen3moe"), dtype=torch.float32)
    if quantization != "none":
        if not cpu_ops.records_f32_available():
            pytest.skip("izh's record kernels are not loaded here")
        pack_model_weights(cast(MoeForCausalLM, model), quantization, {}, requested=quantization)
    block = _sparse_blocks(model)[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(41, config.hidden_size, generator=g)
    route = moe_route(x, block.gate.weight, block.top_k, block.renormalize)
    assert len(set(route.expert_ids.reshape(-1).tolist())) == 8  # every expert gets rows
    with torch.inference_mode():
        batched = block(x)
        for t in (0, 17, 40):
            for batch in (x[t : t + 1], x[t:], torch.cat([x[t : t + 1], x[:9]])):
                alone = moe_route(batch, block.gate.weight, block.top_k, block.renormalize)
                assert torch.equal(alone.expert_ids[0], route.expert_ids[t])
                assert torch.equal(alone.weights[0], route.weights[t])
                got = block(batch)[0]
                if quantization == "none":
                    torch.testing.assert_close(got, batched[t], rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(got, batched[t])


@pytest.mark.parametrize("weights", ["int8", "int4", "gguf Q5_0"])
def test_the_c_experts_loop_equals_the_expert_modules_bit_for_bit(
    weights: str, tiny_moe_factory, tiny_moe_gguf_factory
) -> None:
    """`moe_experts` (one C call for all experts, over izh's float32 records or a GGUF file's own blocks)
    gives the bits that running each expert's modules gives, and the block takes it where it applies."""
    if not cpu_ops.records_f32_available():
        pytest.skip("izh's record kernels are not loaded here")
    if weights.startswith("gguf"):
        path = tiny_moe_gguf_factory("qwen3moe", weights.split()[1])
        model, config = load_model(path, dtype=torch.float32, gguf_blocks=True)
        assert isinstance(_sparse_blocks(model)[0].experts[3].down_proj.packed, GGUFBlocks)
    else:
        model, config = load_model(tiny_moe_factory("qwen3moe"), dtype=torch.float32)
        pack_model_weights(cast(MoeForCausalLM, model), weights, {}, requested=weights)
    g = torch.Generator().manual_seed(7)
    for block in _sparse_blocks(model):
        table = block.expert_table()
        assert table is not None and table.shape == (len(block.experts), EXPERT_FIELDS)
        for rows in (1, 5, 41):
            x = torch.randn(rows, config.hidden_size, generator=g)
            routing = moe_route(x, block.gate.weight, block.top_k, block.renormalize)
            got = moe_experts(table, routing, x, block.experts[0].intermediate_size)
            assert got is not None
            want = torch.empty_like(got)
            tokens = routing.tokens.tolist()
            start = 0
            with torch.inference_mode():
                for expert, count in enumerate(routing.counts):
                    for i in range(start, start + count):
                        pair = int(routing.order[i])
                        assert tokens[i] == pair // block.top_k
                    mine = block.experts[expert](x[routing.tokens[start : start + count]])
                    want[routing.order[start : start + count]] = mine
                    start += count
                assert torch.equal(got, want)
                through_block = block(x)
                block._expert_table, block._expert_table_built = None, True  # the modules' loop
                assert torch.equal(block(x), through_block)
                block._expert_table = table


def test_sparse_block_equals_a_per_token_reference(tiny_moe_factory) -> None:
    """The sorted, gathered, per-expert computation equals a plain loop over tokens and their experts."""
    model, config = load_model(tiny_moe_factory("qwen3moe_dense1"), dtype=torch.float32)
    block = _sparse_blocks(model)[0]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(23, config.hidden_size, generator=g)
    routing = moe_route(x, block.gate.weight, block.top_k, block.renormalize)
    ids, weights = routing.expert_ids, routing.weights
    with torch.inference_mode():
        got = block(x)
        for t in range(x.shape[0]):
            ref = torch.zeros(config.hidden_size)
            for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True):
                expert = block.experts[e]
                gate_up = torch.nn.functional.linear(x[t : t + 1], expert.gate_up_proj.weight)
                gate, up = gate_up.chunk(2, dim=-1)
                ref += (
                    torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, expert.down_proj.weight)
                    * w
                )[0]
            torch.testing.assert_close(got[t], ref, rtol=1e-5, atol=1e-6)


# --- packing --------------------------------------------------------------------------------------


def test_experts_are_packed_one_by_one(tiny_moe_factory, tiny_tokenizer) -> None:
    if not cpu_ops.records_f32_available():
        pytest.skip("izh's record kernels are not loaded here")
    path = tiny_moe_factory("mixtral")
    dense, _ = load_model(path, dtype=torch.float32)
    packed, config = load_model(path, dtype=torch.float32)
    pack_model_weights(cast(MoeForCausalLM, packed), "int8", {}, requested="int8")
    blocks = _sparse_blocks(packed)
    assert config.moe is not None and len(blocks) == config.num_hidden_layers
    for block in blocks:
        assert (
            block.gate.weight.dtype == torch.float32 and block.gate.weight.numel() > 0
        )  # router stays dense
        for expert in block.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(linear.packed, Q8Records)
                assert linear.weight.numel() == 0  # no dense copy kept
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    ref, got = _prefill(dense, prompts), _prefill(packed, prompts)
    # int8 weights and activations per group of 32 in every linear, which the tiny model's sharp
    # attention amplifies: measured mean |diff| 0.12 against a logit std ~2.9, argmax agreement ~0.9.
    # A wrong expert or weight is far off.
    assert (got - ref).abs().mean().item() < 0.1 * ref.std().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


def test_gguf_q4_experts_pack_as_their_own_int4(tiny_moe_gguf_factory) -> None:
    if not cpu_ops.records_f32_available():
        pytest.skip("izh's record kernels are not loaded here")
    path = tiny_moe_gguf_factory("qwen3moe", "Q4_1")
    types = checkpoint_quant_types(path)
    assert types["model.layers.1.mlp.experts.7.down_proj.weight"] == "Q4_1"
    model, _ = load_model(path, dtype=torch.float32)
    pack_model_weights(cast(MoeForCausalLM, model), "int4", types, requested="auto")
    for block in _sparse_blocks(model):
        for expert in block.experts:
            assert isinstance(expert.gate_up_proj.packed, Q4Records)
            assert isinstance(expert.down_proj.packed, Q4Records)


# --- GGUF ---------------------------------------------------------------------------------------


def test_qwen3moe_gguf_matches_transformers_gguf_loader(tiny_moe_gguf_factory, tiny_tokenizer) -> None:
    path = Path(tiny_moe_gguf_factory("qwen3moe", "Q8_0"))
    ours, config = load_model(str(path), dtype=torch.float32)
    assert config.moe is not None
    # transformers' GGUF config map has no qwen3moe.expert_feed_forward_length (it would take the class
    # default, 768), so that one field is given; every tensor comes from its own GGUF loader.
    hf = _hf(str(path.parent), gguf_file=path.name, moe_intermediate_size=config.moe.expert_intermediate_size)
    assert hf.config.norm_topk_prob is True
    _check_logits(ours, hf, [tiny_tokenizer.encode(p).ids for p in PROMPTS])


def test_k_and_5_bit_experts_stay_in_the_files_blocks(tiny_moe_gguf_factory, tiny_tokenizer) -> None:
    """A GGUF whose experts are in a type izh's records do not hold exactly (Q5_0 here; Q4_K / Q6_K in
    real files) serves each expert from the 3-D tensor's own blocks, never dequantized or repacked, and
    its logits follow transformers' on the dequantized file up to the int8 activations."""
    if not cpu_ops.records_f32_available():
        pytest.skip("izh's record kernels are not loaded here")
    path = Path(tiny_moe_gguf_factory("qwen3moe", "Q5_0"))
    ours, config = load_model(str(path), dtype=torch.float32, gguf_blocks=True)
    assert config.moe is not None
    for block in _sparse_blocks(ours):
        for expert in block.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(linear.packed, GGUFBlocks)
                assert {part.ggml_type for part in linear.packed.parts} == {"Q5_0"}
                assert linear.weight.numel() == 0  # no dense copy
    hf = _hf(str(path.parent), gguf_file=path.name, moe_intermediate_size=config.moe.expert_intermediate_size)
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    got = _prefill(ours, prompts)
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([ids])).logits[0] for ids in prompts])
    # The weights are the file's exactly; the activations go in as int8 per block (as in
    # test_experts_are_packed_one_by_one, whose bound this is).
    assert (got - ref).abs().mean().item() < 0.1 * ref.std().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8


def _dequantized_mixtral_folder(gguf_path: str, hf_folder: str, out: Path) -> str:
    """The GGUF's weights, dequantized by `gguf` (q/k un-permuted, experts unstacked), as a Mixtral HF
    folder transformers loads: transformers' GGUF loader does not read a Mixtral (llama + experts)."""
    shutil.copytree(hf_folder, out)
    spec = json.loads((out / "config.json").read_text())
    heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    block = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "block_sparse_moe.gate",
    }
    experts = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
    state: dict[str, torch.Tensor] = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        stem, _, leaf = t.name.rpartition(".")
        if stem in names:
            state[f"{names[stem]}.{leaf}"] = torch.from_numpy(np.array(array, dtype=np.float32))
            continue
        _, layer, kind = stem.split(".")
        if kind in experts:
            for e in range(array.shape[0]):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{experts[kind]}.{leaf}"
                state[name] = torch.from_numpy(np.array(array[e], dtype=np.float32))
            continue
        if kind in ("attn_q", "attn_k"):
            n = heads if kind == "attn_q" else kv_heads
            source_row = llama_cpp_permute(np.arange(array.shape[0])[:, None], n)[:, 0]
            restored = np.empty_like(array)
            restored[source_row] = array  # GGUF row r came from HF row source_row[r]
            array = restored
        state[f"model.layers.{layer}.{block[kind]}.{leaf}"] = torch.from_numpy(
            np.array(array, dtype=np.float32)
        )
    (out / "model.safetensors").unlink()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_mixtral_gguf_matches_transformers_on_its_dequantized_weights(
    tiny_moe_gguf_factory, tiny_moe_factory, tiny_tokenizer, tmp_path: Path
) -> None:
    path = tiny_moe_gguf_factory("mixtral", "Q8_0")
    ours, config = load_model(path, dtype=torch.float32)
    assert config.architecture == "mixtral"
    reference = _dequantized_mixtral_folder(path, tiny_moe_factory("mixtral"), tmp_path / "dequantized")
    _check_logits(ours, _hf(reference), [tiny_tokenizer.encode(p).ids for p in PROMPTS])


def test_bfloat16_runs_close_to_float32(tiny_moe_factory, tiny_tokenizer) -> None:
    """bfloat16 activations (the router still float32), dense and with packed experts (records up to their
    row limit, the dense bfloat16 weights above it)."""
    path = tiny_moe_factory("qwen3moe")
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    ref = _prefill(load_model(path, dtype=torch.float32)[0], prompts)
    bf16, _ = load_model(path, dtype=torch.bfloat16)
    for block in _sparse_blocks(bf16):
        assert block.gate.weight.dtype == torch.float32
    got = _prefill(bf16, prompts)
    # As the dense Qwen3's bf16 check (test_parity): a broken path is far off these bounds.
    assert (got - ref).abs().mean().item() < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.85
    if cpu_ops.qgemm_available():
        pack_model_weights(cast(MoeForCausalLM, bf16), "int8", {}, requested="int8")
        packed = _prefill(bf16, prompts)
        assert (packed.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.8
