"""izh's matmuls over GGUF blocks in the file's own bits (csrc/gguf_blocks.c), every format and every kernel
variant this CPU runs, against the reference of the same integer recipe, and the decoder against gguf-py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from izh.kernels import cpu as cpu_ops
from izh.kernels.cpu import gguf_blocks as G
from tests.gguf_blocks_helpers import random_blocks

VARIANTS = cpu_ops.runnable_variants()
FORMATS = sorted(G.GGUF_BLOCK_TYPES)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 31, 64, 65, 70)  # 3|4, 6|7: the AVX2 build's direct thresholds


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 3
    x[0, : G.block_size("Q4_K")] = 0  # an all-zero group: dx = 0
    return x


def _raw(name: str, n: int, k: int, seed: int) -> np.ndarray:
    return random_blocks(name, n, k, np.random.default_rng(seed))


@pytest.mark.parametrize("name", FORMATS)
def test_the_decoder_gives_gguf_pys_weights_exactly(name: str) -> None:
    k = 2 * G.block_size(name)
    raw = _raw(name, 5, k, 1)
    dec = G.decode_blocks(name, raw, k)
    bs = G.block_size(name)
    w = (np.repeat(dec.dw, bs, 1) * np.repeat(dec.scales, 16, 1)).astype(np.float32) * dec.codes
    if dec.mins is not None:
        assert dec.mw is not None
        w = w - np.repeat(dec.mw, bs, 1) * np.repeat(dec.mins, 16, 1)
    elif dec.mw is not None:
        w = w + np.repeat(dec.mw, bs, 1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(5, k)
    assert np.array_equal(w, want)


def test_the_activations_are_int8_per_block() -> None:
    x = _x(3, 512, 0)
    for group in (32, 256):
        q, dx, ex, qs16 = G.quantize_rows_ref(x, group)
        assert q.abs().max() <= 127 and dx.shape == (3, 512 // group)
        assert torch.equal(q[0, :256], torch.zeros(256)) and dx[0, 0] == 0
        grouped = q.reshape(3, -1, group).float()
        assert torch.allclose(
            grouped * dx[..., None], x.reshape(3, -1, group), atol=float(dx.max()) / 2 + 1e-6
        )
        assert torch.equal(ex, dx * grouped.sum(-1))
        assert torch.equal(qs16, q.reshape(3, -1, 16).sum(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", FORMATS)
def test_block_matmul_is_its_reference_bit_for_bit_at_every_row_count(variant: str, name: str) -> None:
    bs = G.block_size(name)
    shapes = [(48, bs), (17, 3 * bs), (5, 7 * bs if bs == 32 else 2 * bs)]  # odd N, tails of blocks
    with cpu_ops.use_variant(variant):
        for n, k in shapes:
            raw = torch.from_numpy(_raw(name, n, k, n + k))
            x = _x(max(ROWS), k, k)
            want = G.gguf_matmul_ref(x, name, raw, n, k)
            for m in ROWS:
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    try:
                        got = G.gguf_matmul(x[:m], name, raw, n, k)
                    finally:
                        torch.set_num_threads(2)
                    # the reference of all 70 rows: each row's result is the same in any batch
                    assert torch.equal(got, want[:m]), (variant, name, n, k, m, threads)


def _amx_skip_reason() -> str | None:
    """Why the AMX tiles cannot be tested here, or None."""
    if "amx" not in VARIANTS:
        return "this CPU has no AMX (amx_tile, amx_bf16): the amx variant does not run here"
    with cpu_ops.use_variant("amx"):
        if not G.gguf_uses_amx("Q4_K", 64):
            return "the CPU lacks AMX-INT8, or Linux refused this process the AMX tile data"
    return None


@pytest.mark.parametrize("name", FORMATS)
def test_amx_tiles_are_the_reference_bit_for_bit_at_large_row_counts(name: str) -> None:
    """The amx variant's tiles (from 4 or 8 rows, by type) at 1-70 rows (the test above) and at 128 and 300 rows, odd
    weight-row counts (tails of the 16-row tile groups), 1 and 2 threads."""
    reason = _amx_skip_reason()
    if reason:
        pytest.skip(reason)
    bs = G.block_size(name)
    with cpu_ops.use_variant("amx"):
        first = {"Q4_K": 4, "Q6_K": 4}.get(name, 8)  # csrc's gq_amx_min_rows
        assert not G.gguf_uses_amx(name, first - 1) and G.gguf_uses_amx(name, first)
        assert G.gguf_uses_amx(name, 300)
        for n, k in [(37, 2 * bs), (16, 5 * bs if bs == 32 else bs)]:
            raw = torch.from_numpy(_raw(name, n, k, n * k))
            x = _x(300, k, n)
            want = G.gguf_matmul_ref(x, name, raw, n, k)
            for m in (first - 1, first, 17, 48, 128, 300):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    try:
                        got = G.gguf_matmul(x[:m], name, raw, n, k)
                    finally:
                        torch.set_num_threads(2)
                    assert torch.equal(got, want[:m]), (name, n, k, m, threads)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_block_matmul_writes_into_columns_of_a_wider_buffer_from_strided_rows(
    variant: str, name: str
) -> None:
    bs = G.block_size(name)
    n, k = 32, 2 * bs
    raw = torch.from_numpy(_raw(name, n, k, 3))
    padded = torch.zeros(n, raw.shape[1] + 40, dtype=torch.uint8)
    padded[:, : raw.shape[1]] = raw  # a row stride wider than the row
    for m in (9, 40):  # 40: the amx variant's tiles
        x = torch.zeros(m, k + 8)
        x[:, :k] = _x(m, k, 4)
        out = torch.full((m, n + 24), 7.0)
        with cpu_ops.use_variant(variant):
            G.gguf_matmul(x[:, :k], name, padded, n, k, out=out[:, 8 : 8 + n])
        assert torch.equal(out[:, 8 : 8 + n], G.gguf_matmul_ref(x[:, :k].contiguous(), name, raw, n, k))
        assert torch.equal(out[:, :8], torch.full((m, 8), 7.0)) and torch.equal(
            out[:, 8 + n :], torch.full((m, 16), 7.0)
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", FORMATS)
def test_row_gather_is_gguf_pys_dequantization_bit_for_bit(variant: str, name: str) -> None:
    k = 2 * G.block_size(name)
    raw = torch.from_numpy(_raw(name, 40, k, 5))
    ids = torch.tensor([[3, 0, 39], [3, 17, 1]])
    with cpu_ops.use_variant(variant):
        got = G.gguf_rows(name, raw, ids, k)
        with pytest.raises(IndexError, match="out of range"):
            G.gguf_rows(name, raw, torch.tensor([40]), k)
    assert got.shape == (2, 3, k)
    assert torch.equal(got.reshape(6, k), G.gguf_rows_ref(name, raw, ids.reshape(-1), k))


def test_the_int8_activations_cost_about_one_percent_against_the_float_product() -> None:
    for name in FORMATS:
        k = 4 * G.block_size(name)
        raw = _raw(name, 64, k, 6)
        x = _x(4, k, 7)
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(64, k))
        dense = x @ w.T
        got = G.gguf_matmul_ref(x, name, raw, 64, k)
        assert (got - dense).abs().max() <= 0.02 * dense.abs().max(), name


def test_a_type_without_a_kernel_or_a_bad_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="no GGUF block kernel for type Q2_K"):
        G.block_size("Q2_K")
    raw = torch.from_numpy(_raw("Q4_K", 16, 256, 0))
    with pytest.raises(ValueError, match="in % 256"):
        G.gguf_matmul(torch.zeros(1, 128), "Q4_K", raw, 16, 128)
