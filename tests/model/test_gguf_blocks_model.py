"""GGUF models served in their files' own blocks: every linear, the LM head and the token embedding of a
tiny random checkpoint in each format (and a Q4_K_M-like mix) run on izh's block kernels, and greedy
tokens equal transformers' on the same GGUF dequantized to float32 (a divergence accepted only at a near
tie: the reference's top-2 log-probabilities within 0.05 nats)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from izh.kernels import cpu as cpu_ops
from izh.model import AttentionMetadata, load_model
from izh.model.gguf_file import GGUFFile
from izh.model.gguf_loader import quantized_tensor_types
from izh.model.packed import GGUFBlocks, Q4Records, Q8Records
from izh.model.packing import pack_model_weights
from tests.fixtures.checkpoints import llama_cpp_permute
from tests.gguf_blocks_helpers import random_blocks

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 256, 4, 2, 512, 300, 2
NEAR_TIE_NATS = 0.05
RECORD_EXACT = ("Q4_0", "Q4_1", "Q8_0")
# What llama.cpp's Q4_K_M gives each tensor of a small model (attn_v / ffn_down one step up, and the
# formats for tensors whose rows are not whole 256-blocks).
Q4_K_M = {
    "token_embd": "Q6_K",
    "attn_q": "Q4_K",
    "attn_k": "Q5_0",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q8_0",
    "ffn_down": "Q6_K",
    "output": "Q6_K",
}


def _shapes(tied: bool) -> dict[str, tuple[int, int]]:
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
    if not tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for layer in range(LAYERS):
        shapes |= {
            f"blk.{layer}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{layer}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{layer}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{layer}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{layer}.ffn_gate.weight": (INTER, HIDDEN),
            f"blk.{layer}.ffn_up.weight": (INTER, HIDDEN),
            f"blk.{layer}.ffn_down.weight": (HIDDEN, INTER),
        }
    return shapes


def write_random_gguf(
    path: Path,
    arch: str,
    types: dict[str, str],
    *,
    tied: bool,
    seed: int = 0,
    replace: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> str:
    """A tiny `arch` GGUF whose 2-D tensors are random blocks of the type `types` gives their role;
    `replace` substitutes raw bytes of a given type for named tensors (to make bad files)."""
    replace = replace or {}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    for name, (rows, cols) in _shapes(tied).items():
        qtype = types[name.split(".")[-2]]
        scale = 0.5 if name.startswith(("token_embd", "output")) else 0.08
        if name in replace:
            data, raw_type = replace[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
            continue
        w.add_tensor(
            name, random_blocks(qtype, rows, cols, rng, scale), raw_dtype=gguf.GGMLQuantizationType[qtype]
        )
        if arch == "qwen2" and name.split(".")[-2] in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(name.replace(".weight", ".bias"), rng.normal(0, 0.1, rows).astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


_HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def transformers_model(path: str, arch: str, tied: bool) -> torch.nn.Module:
    """transformers' model with the GGUF's tensors dequantized by gguf-py to float32 (q/k rows of Llama put
    back by inverting the converter's permutation, independently of izh)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="eager"))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation="eager"))
    state = {}
    for t in gguf.GGUFReader(path).tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        parts = t.name.split(".")
        if parts[0] == "blk":
            role = parts[2]
            name = f"model.layers.{parts[1]}.{_HF_NAMES[role]}.{parts[3]}"
            if arch == "llama" and role in ("attn_q", "attn_k"):
                heads = HEADS if role == "attn_q" else KV_HEADS
                source_row = llama_cpp_permute(np.arange(array.shape[0])[:, None], heads)[:, 0]
                restored = np.empty_like(array)
                restored[source_row] = array
                array = restored
        else:
            name = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}[
                parts[0]
            ]
            name += ".weight"
        state[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


def load_served(path: str) -> torch.nn.Module:
    """izh's model as the engine packs it (quantization auto)."""
    model, _ = load_model(path, dtype=torch.float32, gguf_blocks=True)
    with GGUFFile(path) as file:
        types = quantized_tensor_types(file)
    pack_model_weights(model, "int4", types, requested="auto")
    return model


def greedy_matches(ours: torch.nn.Module, hf: torch.nn.Module, prompt: list[int], steps: int) -> int:
    """Greedy decode both (izh recomputing the whole prefix each step through its reference attention);
    returns how many tokens agreed before the first divergence, which must be a near tie (or none)."""
    ids = list(prompt)
    for step in range(steps):
        with torch.inference_mode():
            meta = AttentionMetadata.for_prefill([len(ids)])
            ours_logits = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), meta))[-1]
            ref_logits = hf(torch.tensor([ids])).logits[0, -1]
        ours_token, ref_token = int(ours_logits.argmax()), int(ref_logits.argmax())
        if ours_token != ref_token:
            logprobs = ref_logits.log_softmax(-1)
            gap = float(logprobs[ref_token] - logprobs[ours_token])
            assert gap <= NEAR_TIE_NATS, f"step {step}: {ours_token} vs {ref_token}, {gap:.3f} nats apart"
            return step
        ids.append(ref_token)
    return steps


PROMPTS = [[1, 17, 250, 3, 99, 4, 42], [5, 6, 7], list(range(100, 140))]
ARCH_CASES = [("llama", True), ("qwen2", False)]


@pytest.mark.skipif(not cpu_ops.records_f32_available(), reason="izh's C kernels are not built here")
@pytest.mark.parametrize("fmt", [*sorted(set(Q4_K_M.values())), "Q4_0", "Q4_1",
                                 "Q5_1", "IQ4_NL", "IQ4_XS", "Q5_K", "Q4_K_M"])  # fmt: skip
def test_each_format_serves_in_its_own_blocks_with_transformers_greedy_tokens(
    fmt: str, tmp_path: Path
) -> None:
    arch, tied = ARCH_CASES[len(fmt) % 2]
    types = Q4_K_M if fmt == "Q4_K_M" else dict.fromkeys(Q4_K_M, fmt)
    if fmt in RECORD_EXACT:
        types["ffn_down"] = "Q6_K"  # else the file keeps izh's records (next test)
    path = write_random_gguf(tmp_path / f"{fmt}.gguf", arch, types, tied=tied)
    ours, hf = load_served(path), transformers_model(path, arch, tied)
    layer = ours.model.layers[0]
    for linear in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert isinstance(linear.packed, GGUFBlocks) and linear.weight.numel() == 0
    assert isinstance(ours.packed_lm_head, GGUFBlocks)
    assert ours.model.embed_tokens.packed is not None and ours.model.embed_tokens.weight.numel() == 0
    if fmt == "Q4_K_M":
        qkv = layer.self_attn.qkv_proj.packed
        assert [p.ggml_type for p in qkv.parts] == ["Q4_K", "Q5_0", "Q6_K"]
    agreed = [greedy_matches(ours, hf, prompt, 12) for prompt in PROMPTS]
    assert sum(agreed) >= 24, agreed  # most of the way: a near tie ends a comparison early


@pytest.mark.skipif(not cpu_ops.records_f32_available(), reason="izh's C kernels are not built here")
def test_a_file_of_q4_0_q4_1_and_q8_0_linears_keeps_izhs_records(tmp_path: Path) -> None:
    types = dict.fromkeys(Q4_K_M, "Q4_1") | {"ffn_up": "Q8_0", "attn_v": "Q4_0"}
    path = write_random_gguf(tmp_path / "legacy.gguf", "qwen2", types, tied=True)
    ours, hf = load_served(path), transformers_model(path, "qwen2", True)
    layer = ours.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.packed, Q4Records)  # Q4_1 and Q4_0 rows: int4
    assert isinstance(layer.mlp.gate_up_proj.packed, Q8Records)  # Q4_1 and Q8_0 rows: int8
    assert ours.model.embed_tokens.packed is None and not isinstance(ours.packed_lm_head, GGUFBlocks)
    assert sum(greedy_matches(ours, hf, prompt, 8) for prompt in PROMPTS) >= 16


@pytest.mark.skipif(not cpu_ops.records_f32_available(), reason="izh's C kernels are not built here")
def test_the_embedding_gathers_the_files_rows_and_the_model_holds_about_the_files_bytes(
    tmp_path: Path,
) -> None:
    path = write_random_gguf(tmp_path / "mix.gguf", "qwen2", Q4_K_M, tied=False)
    ours, hf = load_served(path), transformers_model(path, "qwen2", False)
    ids = torch.tensor([0, 299, 17, 17])
    assert torch.equal(ours.model.embed_tokens(ids), hf.model.embed_tokens(ids))
    with GGUFFile(path) as file:
        quantized = sum(t.num_bytes for t in file.tensors if t.ggml_type.name in Q4_K_M.values())
    packed = {id(m.packed): m.packed.nbytes for m in ours.modules() if getattr(m, "packed", None) is not None}
    packed[id(ours.packed_lm_head)] = ours.packed_lm_head.nbytes
    assert sum(packed.values()) == quantized  # every quantized tensor once, in its own bytes
