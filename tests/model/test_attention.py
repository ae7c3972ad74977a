"""Attention backends against a naive per-sequence softmax, and the paged model against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.model import AttentionMetadata, PagedTorchAttentionBackend, ReferenceAttentionBackend, load_model
from izh.model.attention import get_attention_backend

HEAD_DIM = 8


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """One sequence, float64: q [n, h, d] at positions first_pos.., k/v [ctx, kv_h, d] (whole context)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(q.shape[0])[:, None] + first_pos
    visible = torch.arange(k.shape[0])[None, :] <= q_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def run_paged_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    pad_with: int = 0,
    seed: int = 0,
) -> None:
    """seqs: (num_computed_tokens, num_new_tokens) per sequence. Cached tokens are written into the cache
    beforehand; the backend must write the new ones and attend over everything."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    num_blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    total_blocks = sum(num_blocks_needed) + 3
    # Scattered, non-monotonic block ids, so gathers through the block table really matter.
    order = torch.randperm(total_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in num_blocks_needed:
        tables.append(order[at : at + n])
        at += n
    cache = torch.zeros(2, total_blocks, block_size, num_kv_heads, HEAD_DIM)
    ks = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=g) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=g) for s in seq_lens]
    for (computed, _), table, k, v in zip(seqs, tables, ks, vs, strict=True):
        for p in range(computed):
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
    qs = [torch.randn(n, num_heads, HEAD_DIM, generator=g) for _, n in seqs]
    meta = AttentionMetadata.from_block_tables([n for _, n in seqs], seq_lens, tables, block_size)
    if pad_with != 0:
        meta.block_tables[meta.block_tables == 0] = pad_with  # mark padding (and block 0 uses) as -1
        for i, table in enumerate(tables):
            meta.block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

    query = torch.cat(qs)
    key = torch.cat([k[c:] for (c, _), k in zip(seqs, ks, strict=True)])
    value = torch.cat([v[c:] for (c, _), v in zip(seqs, vs, strict=True)])
    out = PagedTorchAttentionBackend().forward(query, key, value, cache, meta, HEAD_DIM**-0.5)

    assert out.shape == query.shape
    start = 0
    for (computed, n), q, k, v in zip(seqs, qs, ks, vs, strict=True):
        expected = naive_attention(q, k, v, computed)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        start += n
    # The new K/V landed in the cache at the slots the metadata names.
    slots = meta.slot_mapping
    torch.testing.assert_close(cache[0].reshape(-1, num_kv_heads, HEAD_DIM)[slots], key)
    torch.testing.assert_close(cache[1].reshape(-1, num_kv_heads, HEAD_DIM)[slots], value)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_mixed_batch_matches_naive(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    # A fresh prefill, a decode, a chunk over cached context, decodes: interleaved, so neither the
    # decode group nor the prefill group is a contiguous run of the flat batch.
    seqs = [(0, 7), (12, 1), (5, 9), (30, 1), (3, 1), (17, 2)]
    run_paged_case(seqs, num_heads, num_kv_heads, block_size)


@pytest.mark.parametrize(
    "seqs",
    [
        [(10, 1), (10, 1), (10, 1)],  # decodes of equal length: no mask needed
        [(3, 1), (40, 1), (16, 1), (15, 1)],  # decodes of different lengths
        [(20, 1)],  # single-stream decode
        [(0, 17)],  # one fresh prefill
        [(0, 5), (0, 11)],  # fresh prefills of different lengths
        [(4, 1), (9, 1), (0, 6), (8, 8)],  # decodes first, then prefills: contiguous groups
        [(8, 8), (0, 6), (4, 1), (9, 1)],  # prefills first
        [(15, 1), (16, 1)],  # block boundary exactly
    ],
)
def test_paged_shapes_of_batches(seqs: list[tuple[int, int]]) -> None:
    run_paged_case(seqs, num_heads=4, num_kv_heads=2, block_size=4)


def test_paged_accepts_minus_one_block_table_padding() -> None:
    run_paged_case([(0, 3), (30, 1), (9, 4)], num_heads=4, num_kv_heads=2, block_size=4, pad_with=-1)


def test_reference_matches_naive_on_fresh_sequences() -> None:
    g = torch.Generator().manual_seed(1)
    lens = [5, 1, 12, 7]
    q = torch.randn(sum(lens), 6, HEAD_DIM, generator=g)
    k = torch.randn(sum(lens), 2, HEAD_DIM, generator=g)
    v = torch.randn(sum(lens), 2, HEAD_DIM, generator=g)
    out = ReferenceAttentionBackend().forward(
        q, k, v, None, AttentionMetadata.for_prefill(lens), HEAD_DIM**-0.5
    )
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        torch.testing.assert_close(out[sl], naive_attention(q[sl], k[sl], v[sl], 0), rtol=1e-5, atol=1e-5)
        start += n


def test_reference_rejects_cached_context() -> None:
    meta = AttentionMetadata.from_block_tables([2], [5], [[0]], block_size=8)
    q, kv = torch.zeros(2, 2, HEAD_DIM), torch.zeros(2, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="fresh sequences"):
        ReferenceAttentionBackend().forward(q, kv, kv, None, meta, 1.0)


def test_paged_rejects_too_narrow_block_tables() -> None:
    meta = AttentionMetadata.for_prefill([5])  # no block table columns at all
    cache = torch.zeros(2, 4, 4, 1, HEAD_DIM)
    q, kv = torch.zeros(5, 2, HEAD_DIM), torch.zeros(5, 1, HEAD_DIM)
    # torch's path: a ValueError naming block_tables; the C kernels': an IndexError, nothing written
    with pytest.raises((ValueError, IndexError), match=r"block.table"):
        PagedTorchAttentionBackend().forward(q, kv, kv, cache, meta, 1.0)


def test_metadata_builders() -> None:
    meta = AttentionMetadata.from_block_tables([3, 1], [3, 6], [[7], [2, 5]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [3, 6]
    # seq 0: positions 0..2 in block 7; seq 1: position 5 = block 5, offset 1
    assert meta.slot_mapping.tolist() == [28, 29, 30, 21]
    assert meta.block_tables.tolist() == [[7, 0], [2, 5]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)
    assert meta.query_start_loc.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64

    fresh = AttentionMetadata.for_prefill([4, 2])
    assert fresh.query_start_loc.tolist() == [0, 4, 6]
    assert fresh.seq_lens.tolist() == [4, 2]
    assert (fresh.max_query_len, fresh.max_seq_len) == (4, 4)

    derived = AttentionMetadata(
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([9, 4], dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2]),
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        max_query_len=2,
        max_seq_len=9,
    )
    assert derived.host_query_lens() == [2, 1]
    assert derived.host_seq_lens() == [9, 4]


def test_backend_registry() -> None:
    assert isinstance(get_attention_backend("torch_paged"), PagedTorchAttentionBackend)
    assert isinstance(get_attention_backend("reference"), ReferenceAttentionBackend)
    with pytest.raises(ModelLoadError, match="reference, torch_paged"):
        get_attention_backend("flash")


# --- whole models: paged in chunks + decodes == reference in one go --------------------------------


def _reference_hidden(model: torch.nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    flat = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    hidden = model(flat, positions, AttentionMetadata.for_prefill([len(s) for s in sequences]))
    return list(hidden.split([len(s) for s in sequences]))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_paged_model_in_chunks_matches_reference(kind: str, tiny_checkpoint_factory) -> None:
    model, config = load_model(tiny_checkpoint_factory(kind), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    seq_a = torch.randint(3, config.vocab_size, (40,), generator=g).tolist()
    seq_b = torch.randint(3, config.vocab_size, (26,), generator=g).tolist()
    block_size = 8
    # Sequence A: chunks of 9, 20 and 8 tokens, then 3 decodes; B: chunks 5 and 18, then 3 decodes.
    # Steps mix a chunk of one with decodes of the other.
    steps = [
        [("a", 0, 9), ("b", 0, 5)],
        [("b", 5, 23), ("a", 9, 29)],
        [("a", 29, 37), ("b", 23, 24)],
        [("b", 24, 25), ("a", 37, 38)],
        [("a", 38, 39), ("b", 25, 26)],
        [("a", 39, 40)],
    ]
    seqs = {"a": seq_a, "b": seq_b}
    tables = {"a": [5, 0, 9, 2, 11], "b": [3, 7, 1, 10]}
    caches = [
        torch.zeros(2, 12, block_size, config.num_key_value_heads, config.head_dim)
        for _ in range(config.num_hidden_layers)
    ]
    with torch.inference_mode():
        ref = dict(zip("ab", _reference_hidden(model, [seq_a, seq_b]), strict=True))
        model.bind_kv_caches(caches)
        for step in steps:
            ids = [t for name, lo, hi in step for t in seqs[name][lo:hi]]
            positions = torch.cat([torch.arange(lo, hi) for _, lo, hi in step])
            meta = AttentionMetadata.from_block_tables(
                [hi - lo for _, lo, hi in step],
                [hi for _, _, hi in step],
                [tables[n] for n, _, _ in step],
                block_size,
            )
            hidden = model(torch.tensor(ids), positions, meta)
            # The masks/gather indices were built once for the step, not once per layer (none at all for
            # a decode-only step on the fused CPU kernel, which reads the block tables directly).
            assert len(meta.derived) == (0 if meta.max_query_len == 1 and cpu_ops.available() else 1)
            start = 0
            for name, lo, hi in step:
                got = hidden[start : start + hi - lo]
                torch.testing.assert_close(got, ref[name][lo:hi], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(
                    model.compute_logits(got), model.compute_logits(ref[name][lo:hi]), rtol=1e-4, atol=1e-4
                )
                start += hi - lo
        model.bind_kv_caches(None)
        # Unbound again: the reference path runs.
        again = _reference_hidden(model, [seq_b])[0]
        torch.testing.assert_close(again, ref["b"], rtol=1e-5, atol=1e-4)


def test_bind_kv_caches_validates(tiny_llama_dir: str) -> None:
    model, config = load_model(tiny_llama_dir, dtype=torch.float32)
    good = [torch.zeros(2, 4, 16, config.num_key_value_heads, config.head_dim) for _ in range(2)]
    model.bind_kv_caches(good)
    with pytest.raises(ValueError, match="one per layer"):
        model.bind_kv_caches(good[:1])
    with pytest.raises(ValueError, match="shape"):
        model.bind_kv_caches([torch.zeros(2, 4, 16, config.num_key_value_heads + 1, config.head_dim)] * 2)
    with pytest.raises(ValueError, match="float32"):  # one KV cache format for every layer
        model.bind_kv_caches([good[0], good[1].to(torch.bfloat16)])
    with pytest.raises(ValueError, match="no KV cache format"):
        model.bind_kv_caches([g.to(torch.int32) for g in good])
    model.bind_kv_caches([g.to(torch.bfloat16) for g in good])  # engine.kv_cache_dtype = bfloat16
