"""`paged_attention` (izh.kernels.cpu): attention for any rows over the paged cache, on every kernel variant
this CPU runs. Each row must be bit-identical to the decode kernel's result at the same position, whatever
else is in the call (other sequences, other chunk boundaries), and close to the torch reference."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

import izh.kernels.cpu as K
from izh.model.attention import AttentionMetadata, PagedTorchAttentionBackend

VARIANTS_HERE = K.runnable_variants() if K.available() else []
_NO_VARIANT = pytest.param(None, marks=pytest.mark.skip(reason="C kernels unavailable here"))
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=VARIANTS_HERE or [_NO_VARIANT])
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the OpenMP paths too
    with K.use_variant(request.param):
        yield request.param
    torch.set_num_threads(before)


class _Sequences:
    """Sequences with known K/V at every position, their blocks shuffled over one paged cache."""

    def __init__(
        self, dtype: torch.dtype, lengths: list[int], heads: int = 9, kv_heads: int = 3, d: int = 64
    ) -> None:
        gen = torch.Generator().manual_seed(sum(lengths))
        self.dtype, self.heads, self.kv_heads, self.d, self.block_size = dtype, heads, kv_heads, d, 16
        blocks = [math.ceil(n / self.block_size) for n in lengths]
        num_blocks = sum(blocks) + 2
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[order.pop() for _ in range(b)] for b in blocks]
        self.cache = torch.zeros(2, num_blocks, self.block_size, kv_heads, self.d, dtype=dtype)
        self.q = [torch.randn(n, heads, self.d, generator=gen).to(dtype) for n in lengths]
        self.k = [torch.randn(n, kv_heads, self.d, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, kv_heads, self.d, generator=gen).to(dtype) for n in lengths]
        self.scale = self.d**-0.5

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, chunks: list[tuple[int, int, int]]) -> list[Tensor]:
        """One call over `chunks` (sequence, first position, end position), each writing its K/V and
        attending over positions [0, its position]; returns each chunk's output rows."""
        meta = AttentionMetadata.from_block_tables(
            [b - a for _, a, b in chunks],
            [b for _, _, b in chunks],
            [self.tables[s] for s, _, _ in chunks],
            self.block_size,
        )
        q = torch.cat([self.q[s][a:b] for s, a, b in chunks])
        k = torch.cat([self.k[s][a:b] for s, a, b in chunks])
        v = torch.cat([self.v[s][a:b] for s, a, b in chunks])
        out = PagedTorchAttentionBackend().forward(q, k, v, self.cache, meta, self.scale)
        return list(out.split([b - a for _, a, b in chunks]))

    def reference(self, seq: int, end: int) -> Tensor:
        """Rows [0, end) of sequence `seq`, causal, in float64."""
        q = self.q[seq][:end].double().transpose(0, 1)
        group = self.heads // self.kv_heads
        k = self.k[seq][:end].double().repeat_interleave(group, 1).transpose(0, 1)
        v = self.v[seq][:end].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * self.scale
        mask = torch.ones(end, end, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_rows_equal_the_decode_kernel_at_their_position(
    variant: str, dtype: torch.dtype, d: int
) -> None:
    """A 70-token prompt in one chunk, in chunks of 33 + 37, and token by token as decodes: the same bits,
    and close to the float64 reference. (A float32 chunk's consecutive tokens share their keys' loads, up
    to 8 at a time: 70 and 37 end on partial runs.)"""
    seqs = _Sequences(dtype, [70], d=d)
    whole = seqs.run([(0, 0, 70)])[0]
    chunked = torch.cat([seqs.run([(0, 0, 33)])[0], seqs.run([(0, 33, 70)])[0]])
    decoded = torch.cat([seqs.run([(0, p, p + 1)])[0] for p in range(70)])
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, decoded)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(whole.double(), seqs.reference(0, 70), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_their_batch(variant: str, dtype: torch.dtype) -> None:
    """Mixed steps (prefill chunks of several sequences with decodes) give each row the bits it gets alone."""
    lengths = [40, 90, 17, 5]
    seqs = _Sequences(dtype, lengths)
    alone = [seqs.run([(s, 0, n)])[0] for s, n in enumerate(lengths)]
    # the same K/V are rewritten in place, so the cache holds the same values for every run below
    mixed = seqs.run([(1, 0, 50), (0, 0, 39), (2, 0, 17), (3, 0, 5)])
    rest = seqs.run([(0, 39, 40), (1, 50, 90)])  # a decode and a chunk over cached context
    assert torch.equal(mixed[0], alone[1][:50])
    assert torch.equal(mixed[1], alone[0][:39])
    assert torch.equal(mixed[2], alone[2])
    assert torch.equal(mixed[3], alone[3])
    assert torch.equal(rest[0], alone[0][39:])
    assert torch.equal(rest[1], alone[1][50:])
    decodes = seqs.run([(s, n - 1, n) for s, n in enumerate(lengths)])
    for s, n in enumerate(lengths):
        assert torch.equal(decodes[s], alone[s][n - 1 :])


def test_a_bad_sequence_index_is_refused_before_writing() -> None:
    if not VARIANTS_HERE:
        pytest.skip("C kernels unavailable here")
    seqs = _Sequences(torch.float32, [20])
    q, k, v = seqs.q[0][:4], seqs.k[0][:4], seqs.v[0][:4]
    slots = torch.tensor([seqs.slot(0, p) for p in range(4)])
    tables = torch.tensor([seqs.tables[0]], dtype=torch.int32)
    before = seqs.cache.clone()
    with pytest.raises(IndexError, match="sequence index"):
        K.paged_attention(
            q,
            k,
            v,
            seqs.cache,
            slots,
            tables,
            torch.tensor([0, 0, 1, 0], dtype=torch.int32),
            torch.tensor([1, 2, 3, 4], dtype=torch.int32),
            seqs.scale,
        )
    assert torch.equal(seqs.cache, before)


@pytest.mark.parametrize("window", [20, 50])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize(("dtype", "cache"), [(t, t) for t in DTYPES] + [(torch.float32, torch.bfloat16)])
def test_a_sliding_window_reads_only_its_blocks(
    variant: str, dtype: torch.dtype, cache: torch.dtype, softcap: float, window: int
) -> None:
    """With a window of 20 (or 50) keys, a 70-token prompt gives the same bits whole, in chunks and as
    decodes, with the block-table entries before each call's first window set to -1 (freed blocks are never
    read, nor checked), and matches the windowed float64 reference; also with Gemma 2's score soft-cap (2.0:
    below the scores' spread, so the cap changes them). Also a bfloat16 cache under float32 activations (the
    AMX tiles' path in the amx build, vdpbf16ps's in the avx512 one)."""
    seqs = _Sequences(dtype, [70])
    seqs.cache = seqs.cache.to(cache)
    table = seqs.tables[0]

    def run(start: int, end: int) -> Tensor:
        rows = torch.arange(start + 1, end + 1, dtype=torch.int32)  # each row's length: its position + 1
        # entries wholly before the first row's window are gone, as the KV cache manager drops them
        dropped = max(0, start - window + 1) // seqs.block_size
        tables = torch.tensor([[-1] * dropped + table[dropped:]], dtype=torch.int32)
        slots = torch.tensor([seqs.slot(0, p) for p in range(start, end)])
        args = (seqs.q[0][start:end], seqs.k[0][start:end], seqs.v[0][start:end], seqs.cache, slots, tables)
        if end - start == 1:
            return K.paged_decode_attention(*args, rows, seqs.scale, window, softcap)
        return K.paged_attention(*args, torch.zeros_like(rows), rows, seqs.scale, window, softcap)

    whole = run(0, 70)
    chunked = torch.cat([run(0, 33), run(33, 70)])
    decoded = torch.cat([run(0, 40), *(run(p, p + 1) for p in range(40, 70))])
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, decoded)

    q = seqs.q[0].double().transpose(0, 1)
    group = seqs.heads // seqs.kv_heads
    k = seqs.k[0].to(cache).double().repeat_interleave(group, 1).transpose(0, 1)
    v = seqs.v[0].to(cache).double().repeat_interleave(group, 1).transpose(0, 1)
    pos = torch.arange(70)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    scores = (q @ k.transpose(1, 2)) * seqs.scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(0, 1)
    rounded = cache != dtype and K.bf16_cache_path(seqs.d, group) != "float32"  # q and the weights in bf16
    tol = 2e-2 if dtype == torch.bfloat16 or rounded else 1e-5
    torch.testing.assert_close(whole.double(), expected, rtol=tol, atol=tol)
    # the torch reference (the fallback without the C kernels) reads the same window
    ref = K.paged_decode_attention_ref(
        seqs.q[0][69:70],
        seqs.k[0][69:70],
        seqs.v[0][69:70],
        seqs.cache.clone(),
        torch.tensor([seqs.slot(0, 69)]),
        torch.tensor([[-1] * ((70 - window) // 16) + table[(70 - window) // 16 :]], dtype=torch.int32),
        torch.tensor([70], dtype=torch.int32),
        seqs.scale,
        window,
        softcap,
    )
    torch.testing.assert_close(ref.double(), expected[69:70], rtol=tol, atol=tol)
