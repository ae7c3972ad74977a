"""izh's float32 record matmuls (int8 activations, every kernel variant) against their torch reference."""

from __future__ import annotations

import pytest
import torch

from izh.kernels import cpu as cpu_ops

VARIANTS = cpu_ops.runnable_variants()

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="C kernels unavailable here (no gcc?)")


def _q4(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // 32, generator=g) * 0.1 + 0.01
    mins = -torch.rand(n, k // 32, generator=g) * 0.5
    return cpu_ops.pack_q4(codes, scales, mins)


def _q8(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return cpu_ops.pack_q8(torch.randint(-128, 128, (n, k), generator=g), torch.rand(n, k // 32, generator=g))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0  # a group with no range quantizes to zeros
    if k >= 64:  # d = 1 exactly: halves round to even (2.5 -> 2, -3.5 -> -4), in the vector code too
        x[0, 32:64] = torch.tensor([127.0, -126.5, 2.5, -3.5, 0.5, -0.5, 1.5, 125.5] * 4)
    return x


KINDS = {
    "q4": (_q4, cpu_ops.q4_matmul, cpu_ops.q4_matmul_x8_ref, cpu_ops.unpack_q4),
    "q8": (_q8, cpu_ops.q8_matmul, cpu_ops.q8_matmul_x8_ref, cpu_ops.unpack_q8),
}


def test_the_reference_quantizes_each_group_of_32_to_int8() -> None:
    x = _x(3, 64, 0)
    q, d, e = cpu_ops.quantize_rows_x8_ref(x)
    assert q.shape == (3, 2, 32) and d.shape == e.shape == (3, 2)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    assert torch.equal(q[0, 0], torch.zeros(32)) and d[0, 0] == 0  # the all-zero group
    assert torch.allclose(q * d[..., None], x.reshape(3, 2, 32), atol=float(d.max()) / 2 + 1e-6)
    assert torch.equal(e, d * q.sum(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    ("m", "n", "k"),
    # the VNNI kernels take 4 rows at a time: 13, 33 and 70 end on a remainder
    [
        (1, 16, 32),
        (1, 64, 64),
        (3, 96, 320),
        (7, 32, 64),
        (13, 48, 288),
        (16, 32, 64),
        (33, 48, 96),
        (70, 64, 1536),
    ],
)
def test_float32_record_matmul_is_its_reference_bit_for_bit(
    variant: str, kind: str, m: int, n: int, k: int
) -> None:
    make, matmul, reference, unpack = KINDS[kind]
    records, x = make(n, k, m), _x(m, k, n)
    want = reference(x, records, n, k)
    with cpu_ops.use_variant(variant):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                got = matmul(x, records, n, k)
            finally:
                torch.set_num_threads(2)
            assert got.dtype == torch.float32 and torch.equal(got, want), (variant, threads)
    # The int8 activations cost about 1% against the float32 product of the same weights.
    dense = x @ unpack(records, n, k).T
    assert (want - dense).abs().max() <= 0.02 * dense.abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_gets_the_same_result_alone_and_in_any_batch(variant: str) -> None:
    records, x = _q4(960, 576, 1), _x(9, 576, 2)
    with cpu_ops.use_variant(variant):
        full = cpu_ops.q4_matmul(x, records, 960, 576)
        for i in range(9):
            assert torch.equal(cpu_ops.q4_matmul(x[i : i + 1], records, 960, 576), full[i : i + 1])
        assert torch.equal(cpu_ops.q4_matmul(x[2:7], records, 960, 576), full[2:7])


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rows_and_an_output_buffer(variant: str) -> None:
    records = _q8(48, 128, 3)
    wide = _x(5, 200, 4)
    x = wide[:, :128]  # row stride 200
    want = cpu_ops.q8_matmul_x8_ref(x, records, 48, 128)
    buffer = torch.full((8, 48), float("nan"))
    with cpu_ops.use_variant(variant):
        got = cpu_ops.q8_matmul(x, records, 48, 128, out=buffer)
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, want)
    assert torch.isnan(buffer[5:]).all()  # rows past M untouched


def test_without_the_library_float32_records_take_the_reference() -> None:
    records, x = _q4(32, 64, 5), _x(2, 64, 6)
    with cpu_ops.use_variant("off"):
        assert not cpu_ops.records_f32_available()
        got = cpu_ops.q4_matmul(x, records, 32, 64)
    assert torch.equal(got, cpu_ops.q4_matmul_x8_ref(x, records, 32, 64))


def test_every_variant_has_the_float32_records() -> None:
    for variant in VARIANTS:
        with cpu_ops.use_variant(variant):
            assert cpu_ops.records_f32_available(), variant
