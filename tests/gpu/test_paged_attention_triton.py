"""The Triton paged-attention kernels against their torch references on CUDA, at realistic sizes."""

from __future__ import annotations

import pytest
import torch

from izh.kernels.paged_attention import (
    is_available,
    paged_attention,
    paged_attention_reference,
    write_kv_cache,
    write_kv_cache_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not is_available(), reason="needs CUDA and triton"),
]

TOLERANCE = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
BLOCK_SIZE = 16


def make_batch(
    lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q, kv_cache, query_start_loc, seq_lens, block_tables) of random sequences in shuffled blocks; the
    slots nobody owns hold NaN, so any read outside a context poisons the output."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for _, seq_len in lens]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, generator=gen, device="cuda")
    kv_cache = torch.full(
        (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda"
    )
    width = max(blocks_per_seq) + 2
    block_tables = torch.full((len(lens), width), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, ((_, seq_len), n) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        table = order[used : used + n]
        used += n
        block_tables[i, :n] = table.to(torch.int32)
        pos = torch.arange(seq_len, device="cuda")
        for kv in (0, 1):
            data = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device="cuda")
            kv_cache[kv, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = data.to(dtype)
    query_lens = torch.tensor([q for q, _ in lens])
    query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    num_tokens = int(query_lens.sum())
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32, device="cuda")
    return q, kv_cache, query_start_loc.cuda(), seq_lens, block_tables


def serving_mix(num_seqs: int, max_context: int, seed: int) -> list[tuple[int, int]]:
    """(query_len, seq_len) of a serving step: a few prefill chunks (some over cached prefixes), the rest
    decodes, contexts up to max_context."""
    gen = torch.Generator().manual_seed(seed)
    lens = []
    for i in range(num_seqs):
        seq_len = int(torch.randint(1, max_context + 1, (1,), generator=gen))
        if i % 8 == 0:
            lens.append((seq_len, seq_len))  # fresh prefill
        elif i % 8 == 1:
            lens.append((min(seq_len, 97), seq_len))  # chunk over a cached prefix
        else:
            lens.append((1, seq_len))
    return lens


def check(
    lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_segments: int | None = None,
) -> None:
    q, kv_cache, qsl, seq_lens, tables = make_batch(lens, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    max_q, max_s = max(n for n, _ in lens), max(s for _, s in lens)
    out = paged_attention(q, kv_cache, qsl, seq_lens, tables, scale, max_q, max_s, num_segments=num_segments)
    ref = paged_attention_reference(q, kv_cache, qsl, seq_lens, tables, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 128), (14, 2, 64), (9, 3, 64), (16, 16, 128)],  # Llama-3-8B, Qwen2.5-0.5B, SmolLM2-135M, MHA
)
def test_mixed_batch_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check(serving_mix(32, 2048, seed=num_heads), num_heads, num_kv_heads, head_dim, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_long_prefill_chunks_match_reference(dtype: torch.dtype) -> None:
    lens = [(2048, 2048), (512, 2000), (1, 1999), (300, 300)]
    check(lens, 32, 8, 128, dtype)


@pytest.mark.parametrize("num_segments", [None, 1, 2, 8, 16])
def test_decode_split_context_matches_reference(num_segments: int | None) -> None:
    """Few sequences over long contexts: the case the split path exists for (None lets it choose)."""
    lens = [(1, 2048), (1, 1500), (1, 17), (1, 1)]
    check(lens, 32, 8, 128, torch.bfloat16, num_segments=num_segments)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_cache = torch.randn(2, 64, BLOCK_SIZE, 8, 128, generator=gen, device="cuda").to(dtype)
    qkv = torch.randn(300, 32 + 2 * 8, 128, generator=gen, device="cuda").to(dtype)
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slot_mapping = torch.randperm(64 * BLOCK_SIZE, generator=gen, device="cuda")[:300]
    slot_mapping[::7] = -1
    expected = kv_cache.clone()
    write_kv_cache_reference(key, value, expected, slot_mapping)
    write_kv_cache(key, value, kv_cache, slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(kv_cache, expected)
