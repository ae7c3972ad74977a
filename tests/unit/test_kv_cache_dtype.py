"""The KV cache formats (`engine.kv_cache_dtype`, izh.kernels.kv_cache_dtype): their arithmetic, the torch
references that quantize and dequantize, and the C attention kernels of every variant this CPU runs, which
write each format in the bits of the reference, read every code exactly, attend as a float64 reference over
the values the cache holds, and stay batch- and chunking-invariant."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

import izh.kernels.cpu as K
from izh.kernels.kv_cache_dtype import (
    KV_CACHE_DTYPES,
    dequantize_kv,
    format_of_cache,
    kv_cache_format,
    quantize_kv,
)
from izh.model.attention import AttentionMetadata, PagedTorchAttentionBackend

VARIANTS_HERE = K.runnable_variants() if K.available() else []
_NO_VARIANT = pytest.param(None, marks=pytest.mark.skip(reason="C kernels unavailable here"))
FORMATS = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "q8_0"]
ACTIVATIONS = [torch.float32, torch.bfloat16]


@pytest.fixture(params=VARIANTS_HERE or [_NO_VARIANT])
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the OpenMP paths too
    with K.use_variant(request.param):
        yield request.param
    torch.set_num_threads(before)


# --- the formats' arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "row_bytes"),
    [("float32", 256), ("bfloat16", 128), ("float16", 128), ("fp8", 64), ("fp8_e5m2", 64), ("q8_0", 68)],
)
def test_bytes_per_token_is_two_x_layers_x_kv_heads_x_a_row(name: str, row_bytes: int) -> None:
    """Qwen2.5-0.5B's geometry (24 layers, 2 KV heads, head_dim 64): 2 x 24 x 2 x 64 x bytes per element,
    q8_0 34 bytes per 32 values."""
    fmt = kv_cache_format(name, torch.float32)
    assert fmt.row_bytes(64) == row_bytes
    assert fmt.bytes_per_token(24, 2, 64) == 2 * 24 * 2 * row_bytes
    if name == "q8_0":
        assert fmt.bytes_per_token(24, 2, 64) == 2 * 24 * 2 * 64 * 34 // 32 == 6528


def test_auto_is_the_models_dtype_and_unknown_names_list_the_choices() -> None:
    assert kv_cache_format("auto", torch.float32).name == "float32"
    assert kv_cache_format("auto", torch.bfloat16).name == "bfloat16"
    assert kv_cache_format("fp8", torch.float32) == kv_cache_format("fp8_e4m3", torch.float32)
    with pytest.raises(ValueError, match="q8_0") as info:
        kv_cache_format("int4", torch.float32)
    assert all(name in str(info.value) for name in KV_CACHE_DTYPES)
    assert kv_cache_format("q8_0", torch.float32).check_head_dim(80) is not None
    assert kv_cache_format("q8_0", torch.float32).check_head_dim(64) is None


def test_q8_0_rows_are_llama_cpps_blocks() -> None:
    """d = amax / 127 as float16, then 32 int8 codes rounded half away from zero."""
    x = torch.zeros(64)
    x[0], x[1], x[2], x[3] = 127.0, -63.5, 0.5, 2.5  # x / d = 127, -63.5 -> -64, 0.5 -> 1, 2.5 -> 3
    row = quantize_kv(x, torch.uint8)
    assert row.shape == (68,) and row.dtype == torch.uint8
    assert row[:2].view(torch.float16).item() == 1.0
    assert row[2:6].view(torch.int8).tolist() == [127, -64, 1, 3]
    assert row[34:36].view(torch.float16).item() == 0.0  # an all-zero block: d 0, codes 0
    assert torch.equal(dequantize_kv(row, 64)[:4], torch.tensor([127.0, -64.0, 1.0, 3.0]))


@pytest.mark.parametrize(
    ("name", "limit"), [("float16", 65504.0), ("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)]
)
def test_narrow_formats_clamp_instead_of_overflowing(name: str, limit: float) -> None:
    fmt = kv_cache_format(name, torch.float32)
    got = dequantize_kv(quantize_kv(torch.tensor([1e9, -1e9, 1.0]), fmt.storage), 3)
    assert got.tolist() == [limit, -limit, 1.0]


# --- the C kernels -----------------------------------------------------------------------------------------


class _Sequences:
    """Sequences with known K/V at every position, their blocks shuffled over one paged cache of a format."""

    def __init__(
        self,
        dtype: torch.dtype,
        kv: str,
        lengths: list[int],
        heads: int = 8,
        kv_heads: int = 2,
        d: int = 64,
    ) -> None:
        gen = torch.Generator().manual_seed(sum(lengths))
        self.fmt = kv_cache_format(kv, dtype)
        self.dtype, self.heads, self.kv_heads, self.d, self.block_size = dtype, heads, kv_heads, d, 16
        blocks = [math.ceil(n / self.block_size) for n in lengths]
        num_blocks = sum(blocks) + 2
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[order.pop() for _ in range(b)] for b in blocks]
        row = self.fmt.row_size(self.d)
        self.cache = torch.zeros(2, num_blocks, self.block_size, kv_heads, row, dtype=self.fmt.storage)
        self.q = [torch.randn(n, heads, self.d, generator=gen).to(dtype) for n in lengths]
        self.k = [(2 * torch.randn(n, kv_heads, self.d, generator=gen)).to(dtype) for n in lengths]
        self.v = [torch.randn(n, kv_heads, self.d, generator=gen).to(dtype) for n in lengths]
        self.scale = self.d**-0.5

    def run(self, chunks: list[tuple[int, int, int]]) -> list[Tensor]:
        """One call over `chunks` (sequence, first position, end position); each chunk's output rows."""
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
        """Rows [0, end) of sequence `seq`, causal, in float64 over the values the cache holds (K/V through
        the format's reference quantizer), so it measures the kernel's arithmetic, not the format's loss."""
        q = self.q[seq][:end].double().transpose(0, 1)
        group = self.heads // self.kv_heads

        def held(x: Tensor) -> Tensor:
            stored = dequantize_kv(quantize_kv(x[:end], self.fmt.storage), self.d, torch.float64)
            return stored.repeat_interleave(group, 1).transpose(0, 1)

        k, v = held(self.k[seq]), held(self.v[seq])
        scores = (q @ k.transpose(1, 2)) * self.scale
        mask = torch.ones(end, end, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1)


def _tolerance(dtype: torch.dtype, kv: str = "float32", head_dim: int = 64, group: int = 4) -> float:
    """bfloat16 activations, or a bfloat16 cache on the AMX tiles or vdpbf16ps (q and the weights rounded to
    bfloat16, K.bf16_cache_path): 2e-2, a few bfloat16 ulps of outputs of size ~1; else float32's 1e-5."""
    rounded = kv == "bfloat16" and dtype == torch.float32 and K.bf16_cache_path(head_dim, group) != "float32"
    return 2e-2 if dtype == torch.bfloat16 or rounded else 1e-5


# head sizes: 64 and 128 (the kernels' compile-time copies) and 80 (a partial last chunk; q8_0 needs whole
# blocks of 32)
_FORMAT_AND_D = [(kv, 64) for kv in FORMATS] + [
    (kv, d) for kv in FORMATS for d in (80, 128) if not (kv == "q8_0" and d % 32)
]


@pytest.mark.parametrize(("kv", "d"), _FORMAT_AND_D)
@pytest.mark.parametrize("dtype", ACTIVATIONS)
def test_attention_matches_float64_and_writes_the_references_bits(
    variant: str, dtype: torch.dtype, kv: str, d: int
) -> None:
    """A 70-token prompt: the cache holds exactly `quantize_kv`'s bytes, the output is the float64
    reference's over those values, and whole, chunked (33 + 37) and token by token give the same bits
    (a float32 chunk's consecutive tokens share their keys' loads and conversions, 8 at a time: 70 and 37
    end on partial runs)."""
    seqs = _Sequences(dtype, kv, [70], d=d)
    whole = seqs.run([(0, 0, 70)])[0]
    slots = [seqs.tables[0][p // 16] * 16 + p % 16 for p in range(70)]
    want_k = quantize_kv(seqs.k[0], seqs.fmt.storage)
    assert torch.equal(
        seqs.cache[0].reshape(-1, 2, want_k.shape[-1])[slots].view(torch.uint8), want_k.view(torch.uint8)
    )
    tol = _tolerance(dtype, kv, d, seqs.heads // seqs.kv_heads)
    torch.testing.assert_close(whole.double(), seqs.reference(0, 70), rtol=tol, atol=tol)
    chunked = torch.cat([seqs.run([(0, 0, 33)])[0], seqs.run([(0, 33, 70)])[0]])
    decoded = torch.cat([seqs.run([(0, p, p + 1)])[0] for p in range(70)])
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, decoded)


@pytest.mark.parametrize("kv", FORMATS)
def test_rows_do_not_depend_on_their_batch(variant: str, kv: str) -> None:
    """Mixed steps (prefill chunks of several sequences with decodes) give each row the bits it gets alone."""
    lengths = [40, 90, 17, 5]
    seqs = _Sequences(torch.float32, kv, lengths)
    alone = [seqs.run([(s, 0, n)])[0] for s, n in enumerate(lengths)]
    mixed = seqs.run([(1, 0, 50), (0, 0, 39), (2, 0, 17), (3, 0, 5)])
    rest = seqs.run([(0, 39, 40), (1, 50, 90)])
    assert torch.equal(mixed[0], alone[1][:50])
    assert torch.equal(mixed[1], alone[0][:39])
    assert torch.equal(mixed[2], alone[2])
    assert torch.equal(mixed[3], alone[3])
    assert torch.equal(rest[0], alone[0][39:])
    assert torch.equal(rest[1], alone[1][50:])


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "q8_0"])
def test_every_code_reads_as_its_value(variant: str, kv: str) -> None:
    """A one-token context attends with weight 1 to its value row, so the output is the row as the kernel
    read it: every finite code of the format (q8_0: every int8 code under several scales) comes out exactly
    as `dequantize_kv` (torch's own conversion) gives it (bfloat16 on the AMX tiles or vdpbf16ps: its
    subnormals as 0)."""
    fmt = kv_cache_format(kv, torch.float32)
    d = 64
    if fmt.quantized:
        codes = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).view(torch.uint8).reshape(-1, 32)
        scales = torch.tensor([1.0, 0.0078125, 3.5e-5, 1000.0], dtype=torch.float16).view(torch.uint8)
        blocks = torch.cat([torch.cat((scales[2 * i : 2 * i + 2].expand(8, 2), codes), 1) for i in range(4)])
        rows = blocks.reshape(-1, fmt.row_size(d))  # [16, 68]
    else:
        bits = 16 if fmt.storage.itemsize == 2 else 8
        every = torch.arange(1 << bits, dtype=torch.int32)
        raw = every.to(torch.int16 if bits == 16 else torch.uint8)
        values = raw.view(fmt.storage)
        raw = raw[torch.isfinite(values.float())]
        raw = torch.cat([raw, raw[: (-len(raw)) % d]])  # whole rows
        rows = raw.view(fmt.storage).reshape(-1, d)
    n = rows.shape[0]
    cache = torch.zeros(2, n, 16, 1, rows.shape[1], dtype=fmt.storage)
    cache[1, :, 0, 0] = rows
    tables = torch.arange(n, dtype=torch.int32)[:, None]
    zeros = torch.zeros(n, 1, d)
    out = K.paged_decode_attention(
        zeros, zeros, zeros, cache, torch.full((n,), -1), tables, torch.ones(n, dtype=torch.int32), 0.125
    )
    want = dequantize_kv(rows, d)
    # the tiles and vdpbf16ps read bfloat16 subnormals as zero
    if kv == "bfloat16" and K.bf16_cache_path(d, 1) != "float32":
        want = torch.where(want.abs() < torch.finfo(torch.bfloat16).tiny, torch.zeros_like(want), want)
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "q8_0"])
def test_the_torch_path_reads_the_same_cache(kv: str) -> None:
    """Without the C kernels the torch path writes the same bytes and attends close to the C kernels."""
    if not VARIANTS_HERE:
        pytest.skip("C kernels unavailable here")
    c_side, torch_side = _Sequences(torch.float32, kv, [50, 9]), _Sequences(torch.float32, kv, [50, 9])
    got = c_side.run([(0, 0, 50), (1, 0, 9)])
    with K.use_variant("off"):
        want = torch_side.run([(0, 0, 50), (1, 0, 9)])
    assert torch.equal(c_side.cache.view(torch.uint8), torch_side.cache.view(torch.uint8))
    tol = _tolerance(torch.float32, kv, c_side.d, c_side.heads // c_side.kv_heads)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_format_of_a_cache_tensor() -> None:
    assert format_of_cache(torch.uint8).name == "q8_0"
    assert format_of_cache(torch.float8_e5m2).name == "fp8_e5m2"
    with pytest.raises(ValueError):
        format_of_cache(torch.int32)
