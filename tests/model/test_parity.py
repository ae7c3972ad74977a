"""Our models against transformers on the same tiny random weights (float32, eager attention)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from izh.model import AttentionMetadata, load_model
from izh.model.layers import RotaryEmbedding
from izh.model.loader import load_model_config

KINDS = ["llama", "llama3", "qwen2", "qwen3"]
PROMPTS = [
    "Hello world, the model is here.",
    "The engine server made a request with 12345 tokens, and then it said hello again!",
]


@pytest.fixture(scope="module")
def tiny_dirs(tiny_checkpoint_factory) -> dict[str, str]:
    return {kind: tiny_checkpoint_factory(kind) for kind in KINDS}


def _hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _flat_prefill(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    meta = AttentionMetadata.for_prefill([len(p) for p in prompts])
    with torch.inference_mode():
        return model.compute_logits(model(flat, positions, meta))


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(kind: str, tiny_dirs: dict[str, str], tiny_tokenizer) -> None:
    path = tiny_dirs[kind]
    ours, config = load_model(path, dtype=torch.float32)
    hf = _hf_model(path)
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])

    logits = _flat_prefill(ours, prompts)  # both prompts in ONE flat batch
    assert logits.dtype == torch.float32
    assert logits.shape == (sum(map(len, prompts)), config.vocab_size)
    start = 0
    with torch.inference_mode():
        for ids in prompts:
            ref = hf(torch.tensor([ids])).logits[0]
            got = logits[start : start + len(ids)]
            assert (got - ref).abs().max().item() < 1e-4
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            start += len(ids)


def test_config_matches_transformers_view(tiny_dirs: dict[str, str]) -> None:
    expected = {
        "llama": ("llama", True, False, False, 16, None),
        "llama3": ("llama", False, False, False, 16, "llama3"),
        "qwen2": ("qwen2", False, True, False, 16, None),
        "qwen3": ("qwen3", True, False, True, 24, None),
    }
    for kind, (arch, tied, bias, qk_norm, head_dim, rope_type) in expected.items():
        config = load_model_config(tiny_dirs[kind])
        hf = AutoConfig.from_pretrained(tiny_dirs[kind])
        assert (config.architecture, config.tie_word_embeddings, config.attention_bias) == (arch, tied, bias)
        assert (config.qk_norm, config.head_dim) == (qk_norm, head_dim)
        assert (config.rope_scaling or {}).get("rope_type") == rope_type
        assert config.num_key_value_heads == hf.num_key_value_heads
        assert config.rms_norm_eps == hf.rms_norm_eps


def test_rope_cache_matches_transformers_at_long_positions(tiny_dirs: dict[str, str]) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for kind in ("llama", "llama3"):
        config = load_model_config(tiny_dirs[kind])
        hf_rope = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tiny_dirs[kind]))
        ours = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype=torch.float32,
        )
        positions = torch.tensor([0, 1, 63, 64, 500, config.max_position_embeddings - 1])
        cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
        half = config.head_dim // 2
        got = ours(positions)
        torch.testing.assert_close(got[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)


def test_bfloat16_runs_close_to_float32(tiny_qwen3_dir: str, tiny_tokenizer) -> None:
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    fp32, _ = load_model(tiny_qwen3_dir, dtype=torch.float32)
    bf16, _ = load_model(tiny_qwen3_dir, dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    ref = _flat_prefill(fp32, prompts)
    got = _flat_prefill(bf16, prompts)
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    # bf16 keeps ~3 significant digits, and the tiny model's sharp attention amplifies that: measured
    # mean |diff| 0.03 (logit std ~1.5), max 0.35, argmax agreement 0.97. A broken path is far off.
    diff = (got - ref).abs()
    assert diff.mean().item() < 0.1
    assert diff.max().item() < 1.0
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.85


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },  # Qwen2.5 / Qwen3 long context
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ],
)
def test_yarn_rope_matches_transformers(rope_scaling: dict[str, object]) -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from izh.model.config import ModelConfig

    hf_config = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_theta=1e6,
        rope_scaling=rope_scaling,
    )
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_theta": 1e6,
        "rope_scaling": rope_scaling,
    }
    config = ModelConfig.from_hf_config(d)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    ours = RotaryEmbedding(
        config.head_dim,
        config.max_position_embeddings,
        config.rope_theta,
        config.rope_scaling,
        dtype=torch.float32,
    )
    positions = torch.tensor([0, 1, 63, 64, 500, 1023])
    cos, sin = Qwen2RotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions[None])
    half = config.head_dim // 2
    got = ours(positions)
    torch.testing.assert_close(got[:, :half], cos[0, :, :half], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[:, half:], sin[0, :, :half], rtol=0, atol=1e-5)
    assert not torch.allclose(
        got, RotaryEmbedding(config.head_dim, 1024, 1e6, None, dtype=torch.float32)(positions)
    )
