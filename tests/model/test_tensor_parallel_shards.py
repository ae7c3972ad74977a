"""Tensor-parallel shards at load time, in one process (no collectives run while loading): each rank's
slices put together give the checkpoint back, a rank holds about 1/N of the bytes, GGUF slices dequantize
to the full tensor's slices, and a model that does not split N ways is refused naming the sizes that work."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

from izh.errors import ModelLoadError
from izh.model.gguf_file import GGUFFile
from izh.model.gguf_loader import dequantize, dequantize_slice
from izh.model.llama import LlamaForCausalLM
from izh.model.loader import load_model, load_model_config
from izh.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    check_tensor_parallel,
    parameter_bytes,
    supported_sizes,
    vocab_range,
)


def _load(path: str, rank: int | None, world: int = 2) -> LlamaForCausalLM:
    tp = None if rank is None else TensorParallel(rank, world)
    model, _ = load_model(path, dtype=torch.float32, tp=tp)
    assert isinstance(model, LlamaForCausalLM)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_shards_put_together_give_the_checkpoint(
    kind: str, tiny_checkpoint_factory: Callable[[str], str]
) -> None:
    path = tiny_checkpoint_factory(kind)
    full = _load(path, None)
    shards = [_load(path, r) for r in range(2)]
    config = full.config
    for i, layer in enumerate(full.model.layers):
        parts = [s.model.layers[i] for s in shards]
        qkv = [p.self_attn.qkv_proj for p in parts]
        assert all(isinstance(q, ColumnParallelLinear) for q in qkv)
        # Each rank's qkv rows are its q heads, then its k heads, then its v heads.
        full_rows = torch.split(layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.shard_sizes)
        local_rows = [torch.split(q.weight, q.shard_sizes) for q in qkv]
        for k in range(3):
            torch.testing.assert_close(
                torch.cat([rows[k] for rows in local_rows]), full_rows[k], rtol=0, atol=0
            )
        o = [p.self_attn.o_proj for p in parts]
        assert all(isinstance(x, RowParallelLinear) for x in o)
        torch.testing.assert_close(torch.cat([x.weight for x in o], dim=1), layer.self_attn.o_proj.weight)
        down = [p.mlp.down_proj for p in parts]
        torch.testing.assert_close(torch.cat([x.weight for x in down], dim=1), layer.mlp.down_proj.weight)
        assert [p.self_attn.num_heads for p in parts] == [config.num_attention_heads // 2] * 2
        assert [p.self_attn.num_kv_heads for p in parts] == [config.num_key_value_heads // 2] * 2
        if layer.self_attn.o_proj.bias is not None:  # the row-parallel bias is whole on every rank
            torch.testing.assert_close(o[0].bias, layer.self_attn.o_proj.bias)
    embeds = [s.model.embed_tokens for s in shards]
    assert all(isinstance(e, VocabParallelEmbedding) for e in embeds)
    torch.testing.assert_close(torch.cat([e.weight for e in embeds]), full.model.embed_tokens.weight)
    if full.lm_head is not None:
        torch.testing.assert_close(torch.cat([s.lm_head.weight for s in shards]), full.lm_head.weight)  # type: ignore[union-attr]
    torch.testing.assert_close(shards[1].rotary_emb.cos_sin_cache, full.rotary_emb.cos_sin_cache)


def test_a_rank_holds_about_half_of_the_model(tiny_checkpoint_factory: Callable[[str], str]) -> None:
    path = tiny_checkpoint_factory("llama3")  # untied: the LM head is split too
    world = 2
    full_bytes = parameter_bytes(_load(path, None))
    for rank in range(world):
        local = parameter_bytes(_load(path, rank, world))
        # Only the norms (a few hundred floats) are whole on every rank.
        assert local / full_bytes == pytest.approx(1 / world, abs=0.02)


def test_gguf_shards_match_the_dequantized_checkpoint(tiny_gguf_factory: Callable[..., str]) -> None:
    path = tiny_gguf_factory("llama", "Q8_0")
    full = _load(path, None)
    shards = [_load(path, r) for r in range(2)]
    for i, layer in enumerate(full.model.layers):
        qkv = torch.cat([s.model.layers[i].self_attn.qkv_proj.weight for s in shards])
        full_rows = torch.split(layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.shard_sizes)
        local = [torch.split(s.model.layers[i].self_attn.qkv_proj.weight, (32, 16, 16)) for s in shards]
        assert qkv.shape == layer.self_attn.qkv_proj.weight.shape
        for k in range(3):  # q/k rows un-permuted per head, on each rank's heads
            torch.testing.assert_close(torch.cat([rows[k] for rows in local]), full_rows[k], rtol=0, atol=0)
        down = torch.cat([s.model.layers[i].mlp.down_proj.weight for s in shards], dim=1)
        torch.testing.assert_close(down, layer.mlp.down_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize(("dim", "start", "end"), [(0, 16, 48), (1, 32, 64), (1, 8, 40)])
def test_gguf_slices_dequantize_as_the_full_tensor(
    dim: int, start: int, end: int, tiny_gguf_factory: Callable[..., str]
) -> None:
    """Rows and block-aligned columns are cut in the quantized bytes; a column range inside a block
    (8:40 of Q8_0's 32) falls back to dequantizing the tensor; all three give the same values."""
    with GGUFFile(tiny_gguf_factory("llama", "Q8_0")) as file:
        info = next(t for t in file.tensors if t.name == "blk.0.ffn_down.weight")
        full = dequantize(file, info).numpy()
        part = dequantize_slice(file, info, dim, start, end).numpy()
    index = (slice(None),) * dim + (slice(start, end),)
    np.testing.assert_array_equal(part, full[index])


def test_a_model_that_does_not_split_is_refused_naming_the_sizes_that_work(
    tiny_checkpoint_factory: Callable[[str], str],
) -> None:
    # SmolLM2-135M's shape: 9 attention heads, 3 KV heads, MLP 1536.
    config = dataclasses.replace(
        load_model_config(tiny_checkpoint_factory("llama")),
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
    )
    assert supported_sizes(config) == [1, 3]
    with pytest.raises(ModelLoadError) as err:
        check_tensor_parallel(config, 2)
    message = err.value.message
    assert "num_attention_heads 9 and num_key_value_heads 3" in message
    assert "--tensor-parallel-size 1, 3" in message
    check_tensor_parallel(config, 3)


def test_vocab_ranges_cover_the_vocabulary_once() -> None:
    for vocab, world in ((512, 2), (49152, 8), (151_936, 3), (10, 4)):
        ranges = [vocab_range(vocab, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
