"""GGUF loading: tensors equal what `gguf` dequantizes (Llama q/k un-permuted), logits equal transformers
on those weights, errors name the tensor; and the real SmolLM2 GGUF against transformers' own loader."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from izh.errors import ModelLoadError
from izh.model import AttentionMetadata, load_model, load_model_config
from izh.model.gguf_file import GGUFFile, SkippedArray
from tests.fixtures.checkpoints import (
    TINY_SPECS,
    build_gguf,
    gguf_tensor_name,
    llama_cpp_permute,
    load_hf_weights,
)
from tests.fixtures.smollm2 import NUM_GENERATED, SMOLLM2_CHAT_IDS, HFReference

PROMPTS = ["Hello world, the model is here.", "Two tokens and then 42 more words about the cache!"]


def dequantized_hf_state(gguf_path: str, hf_names: list[str], spec: dict) -> dict[str, torch.Tensor]:
    """The GGUF's tensors under transformers' names, dequantized by `gguf` and, for Llama, with q/k rows
    put back by inverting the converter's permutation as an index map (independent of izh's code)."""
    by_gguf_name = {gguf_tensor_name(n): n for n in hf_names}
    state = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        if t.name == "rope_freqs.weight":
            continue
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        name = by_gguf_name[t.name]
        if spec["model_type"] == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = spec["num_attention_heads"] if "attn_q" in t.name else spec["num_key_value_heads"]
            rows = np.arange(array.shape[0])[:, None]
            source_row = llama_cpp_permute(rows, heads)[:, 0]  # GGUF row r came from HF row source_row[r]
            restored = np.empty_like(array)
            restored[source_row] = array
            array = restored
        state[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    return state


def _hf_with_weights(hf_dir: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    return hf.eval()


def _our_logits(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = model.compute_logits(
            model(flat, positions, AttentionMetadata.for_prefill(list(map(len, prompts))))
        )
    return list(logits.split([len(p) for p in prompts]))


def _check_against_hf(gguf_path: str, hf_dir: str, kind: str, tokenizer) -> dict[str, torch.Tensor]:
    spec = TINY_SPECS[kind]
    state = dequantized_hf_state(gguf_path, list(load_hf_weights(hf_dir)), spec)
    model, _ = load_model(gguf_path, dtype=torch.float32)
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn."
    qkv = torch.cat([state[f"{attn}{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params[f"{attn}qkv_proj.weight"], qkv)
    assert torch.equal(params["model.embed_tokens.weight"], state["model.embed_tokens.weight"])

    hf = _hf_with_weights(hf_dir, state)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    with torch.inference_mode():
        for ids, got in zip(prompts, _our_logits(model, prompts), strict=True):
            ref = hf(torch.tensor([ids])).logits[0]
            assert (got - ref).abs().max().item() < 1e-4
    return state


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_1", "Q4_0", "BF16"])
def test_tiny_llama_gguf_matches_transformers_on_dequantized_weights(
    qtype: str, tiny_gguf_factory, tiny_llama_dir: str, tiny_tokenizer
) -> None:
    path = tiny_gguf_factory("llama", qtype)
    state = _check_against_hf(path, tiny_llama_dir, "llama", tiny_tokenizer)
    # The un-permuted q/k are the original weights up to quantization error: permutation undone right.
    original = load_hf_weights(tiny_llama_dir)
    # Worst-case rounding error of each format, relative to the tensor's largest magnitude.
    tolerance = {"F16": 1e-3, "BF16": 5e-3, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1}[qtype]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        ref = torch.from_numpy(original[name])
        err = (state[name] - ref).abs() / ref.abs().max()
        assert err.max().item() < tolerance
        assert err.mean().item() < tolerance / 3


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_other_tiny_ggufs_match_transformers(
    kind: str, tiny_gguf_factory, tiny_checkpoint_factory, tiny_tokenizer
) -> None:
    # llama3: rope scaling comes back from the rope_freqs tensor; qwen2/qwen3 are not permuted.
    _check_against_hf(tiny_gguf_factory(kind, "Q8_0"), tiny_checkpoint_factory(kind), kind, tiny_tokenizer)


def test_gguf_config_equals_hf_config(tiny_gguf_factory, tiny_checkpoint_factory) -> None:
    for kind in TINY_SPECS:
        from_gguf = load_model_config(tiny_gguf_factory(kind, "Q8_0"))
        from_hf = load_model_config(tiny_checkpoint_factory(kind))
        for field in (
            "architecture",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rope_theta",
            "max_position_embeddings",
            "tie_word_embeddings",
            "attention_bias",
            "qk_norm",
        ):
            assert getattr(from_gguf, field) == getattr(from_hf, field), (kind, field)
        assert math.isclose(from_gguf.rms_norm_eps, from_hf.rms_norm_eps, rel_tol=1e-6)
    llama3 = load_model_config(tiny_gguf_factory("llama3", "Q8_0")).rope_scaling
    assert llama3 is not None and llama3["rope_type"] == "freq_factors" and len(llama3["freq_factors"]) == 8


def test_tiny_gguf_has_full_tokenizer_metadata(tiny_llama_gguf: str, tiny_tokenizer) -> None:
    with GGUFFile(tiny_llama_gguf, skip_arrays_prefix="") as file:
        meta = file.metadata
    with GGUFFile(tiny_llama_gguf) as file:  # by default the vocabulary arrays are only skipped over
        assert file.metadata["tokenizer.ggml.tokens"] == SkippedArray(512)
        assert file.metadata["tokenizer.ggml.model"] == "gpt2"
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == tiny_tokenizer.get_vocab_size() == 512
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1]
    assert len(meta["tokenizer.ggml.merges"]) == 512 - 256 - 3
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_gguf_missing_unexpected_and_misshaped_tensors(tiny_llama_dir: str, tmp_path: Path) -> None:
    missing = build_gguf(
        tiny_llama_dir, tmp_path / "missing.gguf", "F16", skip_tensors=["blk.1.ffn_up.weight"]
    )
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(missing, dtype=torch.float32)
    extra = {"blk.0.attn_frob.weight": np.zeros((4, 64), np.float32)}
    unexpected = build_gguf(tiny_llama_dir, tmp_path / "unexpected.gguf", "F16", extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"unexpected.*blk\.0\.attn_frob\.weight"):
        load_model(unexpected, dtype=torch.float32)
    wrong = {"blk.0.ffn_down.weight": np.zeros((64, 100), np.float32)}
    misshaped = build_gguf(tiny_llama_dir, tmp_path / "misshaped.gguf", "F16", extra_tensors=wrong)
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight has shape \[64, 100\]"
    ):
        load_model(misshaped, dtype=torch.float32)


def test_gguf_progress_and_unknown_architecture(
    tiny_llama3_dir: str, tiny_gguf_factory, tmp_path: Path
) -> None:
    calls: list[tuple[int, int, str]] = []
    path = tiny_gguf_factory("llama3", "Q8_0")
    load_model(path, dtype=torch.bfloat16, progress=lambda d, t, n: calls.append((d, t, n)))
    with GGUFFile(path) as file:
        weights = [t.name for t in file.tensors if t.name != "rope_freqs.weight"]
    assert [c[0] for c in calls] == list(range(1, len(weights) + 1))
    assert {c[1] for c in calls} == {len(weights)}
    assert "lm_head.weight" in {c[2] for c in calls}

    folder = tmp_path / "gemma"
    shutil.copytree(tiny_llama3_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    gemma = build_gguf(folder, tmp_path / "gemma.gguf", "F16")
    with pytest.raises(ModelLoadError, match=r"'gemma' \(supported: .*llama.*qwen2.*qwen3"):
        load_model(gemma, dtype=torch.float32)


def _random_k_quant(
    rows: int, cols: int, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """Valid K-quant bytes (random quants, sane fp16 scales): gguf can dequantize but not quantize these."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin, scales[12], qs[128]
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
        blocks[:, -2:] = scale
    return blocks.reshape(rows, cols // 256 * block_bytes)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_gguf_loads_dequantized(qtype: str, tmp_path: Path) -> None:
    # K-quants need rows of 256: a one-layer llama of width 256, weights random K-quant blocks.
    quant = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, inter, vocab = 256, 4, 2, 256, 64
    path = str(tmp_path / "k.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for add, value in (
        (w.add_context_length, 128),
        (w.add_embedding_length, hidden),
        (w.add_block_count, 1),
        (w.add_feed_forward_length, inter),
        (w.add_head_count, heads),
        (w.add_head_count_kv, kv_heads),
        (w.add_vocab_size, vocab),
    ):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (inter, hidden),
        "blk.0.ffn_up.weight": (inter, hidden),
        "blk.0.ffn_down.weight": (hidden, inter),
    }
    for name, (rows, cols) in shapes.items():
        w.add_tensor(name, _random_k_quant(rows, cols, quant, rng), raw_dtype=quant)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    model, config = load_model(path, dtype=torch.float32)
    assert config.tie_word_embeddings and config.head_dim == 64
    params = dict(model.named_parameters())
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    down = by_name["blk.0.ffn_down.weight"]
    expected = gguf.quants.dequantize(down.data, down.tensor_type).reshape(hidden, inter)
    assert np.array_equal(params["model.layers.0.mlp.down_proj.weight"].numpy(), expected)
    k = by_name["blk.0.attn_k.weight"]
    k_gguf = gguf.quants.dequantize(k.data, k.tensor_type).reshape(hidden // 2, hidden)
    k_ours = params["model.layers.0.self_attn.qkv_proj.weight"][hidden : hidden + hidden // 2].numpy()
    # Re-permuting our un-permuted rows gives the file's rows back.
    assert np.array_equal(llama_cpp_permute(k_ours, kv_heads), k_gguf)
    logits = _our_logits(model, [[1, 5, 9, 3]])[0]
    assert torch.isfinite(logits).all()


# --- the real default model -------------------------------------------------------------------------

# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
#  <|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n
#  <|im_start|>assistant\n", as SmolLM2's tokenizer and chat template encode it.


def _our_greedy(model: torch.nn.Module, config, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Same with the paged backend: a hand-made cache and scattered block table, prompt in 2 chunks."""
    block_size = 16
    table = [5, 0, 3, 1, 7, 2]
    assert len(table) * block_size >= len(prompt) + n
    caches = [
        torch.zeros(2, 8, block_size, config.num_key_value_heads, config.head_dim)
        for _ in range(config.num_hidden_layers)
    ]
    model.bind_kv_caches(caches)

    def step(token_ids: list[int], start: int) -> torch.Tensor:
        end = start + len(token_ids)
        meta = AttentionMetadata.from_block_tables([len(token_ids)], [end], [table], block_size)
        hidden = model(torch.tensor(token_ids), torch.arange(start, end), meta)
        return model.compute_logits(hidden)

    try:
        with torch.inference_mode():
            split = 27
            prefill_logits = torch.cat([step(prompt[:split], 0), step(prompt[split:], split)])
            tokens: list[int] = []
            next_id = int(prefill_logits[-1].argmax())
            for _ in range(n):
                tokens.append(next_id)
                next_id = int(step([next_id], len(prompt) + len(tokens) - 1)[-1].argmax())
    finally:
        model.bind_kv_caches(None)
    return prefill_logits, tokens


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2_gguf: str, smollm2_hf_reference: HFReference) -> None:
    model, config = load_model(smollm2_gguf, dtype=torch.float32)
    assert (config.architecture, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert config.tie_word_embeddings
    ours_ref = _our_logits(model, [SMOLLM2_CHAT_IDS])[0]
    ours_paged, our_tokens = _our_greedy(model, config, SMOLLM2_CHAT_IDS, NUM_GENERATED)
    del model
    hf_logits, hf_tokens = smollm2_hf_reference.prefill_logits, smollm2_hf_reference.greedy_tokens

    # Measured: 0 for the reference path (same ops as transformers' sdpa path), ~7e-5 for the paged
    # path (different summation order), logits up to ~38 in magnitude.
    assert (ours_ref - hf_logits).abs().max().item() < 2e-3
    assert (ours_paged - hf_logits).abs().max().item() < 2e-3
    assert our_tokens == hf_tokens
