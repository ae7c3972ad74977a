"""Phi-3 (fused qkv / gate_up checkpoints, LongRoPE, a sliding window of 8 keys) against transformers:
prefill logits, the rotary tables past the original context, and greedy tokens through the engine
batched, alone (prefix-cache hits) and in chunks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from izh import LLM, SamplingParams
from izh.model import AttentionMetadata, load_model
from izh.model.layers import RotaryEmbedding
from tests.engine.test_gemma import PROMPTS, _hf_greedy, _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_phi3_matches_transformers(
    tiny_checkpoint_factory: Callable[[str], str], tiny_gguf_factory: Callable[..., str], tiny_tokenizer
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_factory("phi3")
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    assert max(map(len, prompts)) + GREEDY.max_tokens < 64  # inside the original context: short factors
    ours, config = load_model(path, dtype=torch.float32)
    assert (config.architecture, config.sliding_window) == ("phi3", 8)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = ours.compute_logits(
            ours(flat, positions, AttentionMetadata.for_prefill(list(map(len, prompts))))
        )
        start = 0
        for ids in prompts:
            assert (logits[start : start + len(ids)] - hf(torch.tensor([ids])).logits[0]).abs().max() < 1e-4
            start += len(ids)

    expected = _hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    from_gguf = LLM(tiny_gguf_factory("phi3", "F32"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    gguf_scaling = from_gguf.engine_core.runner.model_config.rope_scaling
    assert gguf_scaling is not None and gguf_scaling["rope_type"] == "longrope"
    assert list(gguf_scaling["long_factor"]) == pytest.approx(config.rope_scaling["long_factor"])
    assert gguf_scaling["attention_factor"] == pytest.approx(1.2910, abs=1e-4)  # sqrt(1 + ln 16 / ln 64)
    assert _tokens(from_gguf.generate(PROMPTS, GREEDY)) == expected
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == expected
    chunked = LLM(
        path, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=5, max_num_seqs=2
    )
    assert _tokens(chunked.generate(PROMPTS, GREEDY)) == expected
    llm.engine_core.check_invariants()


def test_longrope_tables_match_transformers(tiny_checkpoint_factory: Callable[[str], str]) -> None:
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    path = tiny_checkpoint_factory("phi3")
    config = load_model(path, dtype=torch.float32)[1]
    ours = RotaryEmbedding(config.head_dim, 1024, config.rope_theta, config.rope_scaling, dtype=torch.float32)
    hf_rope = Phi3RotaryEmbedding(AutoConfig.from_pretrained(path))
    half = config.head_dim // 2
    # Inside the original context transformers uses the short factors, past it the long ones.
    for positions in (torch.tensor([0, 1, 30, 63]), torch.tensor([64, 100, 500, 1023])):
        seq = torch.zeros(1, int(positions.max()) + 1, dtype=torch.float32)
        cos, sin = hf_rope(seq, positions[None])
        got = ours(positions)
        torch.testing.assert_close(got[:, :half], cos[0, :, :half], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[:, half:], sin[0, :, :half], rtol=0, atol=1e-5)


def test_phi4_mini_partial_rotary_matches_transformers(
    tiny_checkpoint_factory: Callable[[str], str], tiny_gguf_factory: Callable[..., str], tiny_tokenizer
) -> None:
    """Phi-4-mini's layout (RoPE over 12 of 16 dimensions per head, LongRoPE, tied embeddings, a window
    longer than the context): prefill logits and greedy tokens equal transformers', from the HF folder
    and from GGUF files whose rope dimension count (12) is below the head size, batched, alone, chunked
    and through the prefix cache."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_factory("phi4")
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    assert max(map(len, prompts)) + GREEDY.max_tokens < 64  # inside the original context: short factors
    ours, config = load_model(path, dtype=torch.float32)
    assert (config.architecture, config.head_dim, config.rope_dim) == ("phi3", 16, 12)
    assert config.tie_word_embeddings and config.sliding_window is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = ours.compute_logits(
            ours(flat, positions, AttentionMetadata.for_prefill(list(map(len, prompts))))
        )
        start = 0
        for ids in prompts:
            assert (logits[start : start + len(ids)] - hf(torch.tensor([ids])).logits[0]).abs().max() < 1e-4
            start += len(ids)

    expected = _hf_greedy(path, prompts, GREEDY.max_tokens)
    assert len({tuple(e) for e in expected}) > 2  # the tiny model does depend on its prompt
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == expected  # prefix-cache hits
    chunked = LLM(
        path, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=5, max_num_seqs=2
    )
    assert _tokens(chunked.generate(PROMPTS, GREEDY)) == expected
    llm.engine_core.check_invariants()

    from_gguf = LLM(tiny_gguf_factory("phi4", "F32"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    gguf_config = from_gguf.engine_core.runner.model_config
    assert (gguf_config.rope_dim, gguf_config.tie_word_embeddings) == (12, True)
    gguf_scaling = gguf_config.rope_scaling
    assert gguf_scaling is not None and len(gguf_scaling["long_factor"]) == 6
    assert _tokens(from_gguf.generate(PROMPTS, GREEDY)) == expected


def test_partial_rotary_is_refused_outside_phi3() -> None:
    """A GGUF rope dimension count below the head size is Phi-4-mini's partial rotary, served for phi3
    only; elsewhere (a llama file) it is refused, naming the key, not served as a whole-head rotary."""
    from izh.errors import UnsupportedModel
    from izh.model.config import ModelConfig

    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "llama.attention.head_count": 4,
        "llama.vocab_size": 512,
        "llama.rope.dimension_count": 12,
    }
    with pytest.raises(UnsupportedModel, match=r"rope\.dimension_count 12"):
        ModelConfig.from_gguf_metadata(metadata, {"token_embd.weight": [512, 64]})
    phi3 = {k.replace("llama.", "phi3."): v for k, v in metadata.items()} | {"general.architecture": "phi3"}
    config = ModelConfig.from_gguf_metadata(phi3, {"token_embd.weight": [512, 64]})
    assert (config.head_dim, config.rope_dim) == (16, 12)
