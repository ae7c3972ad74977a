"""The weight records of the quantized matmuls: packing, unpacking, and the matmul references.

Records as csrc/qgemm_avx512.c lays them out (see the comment there): weights in the order the kernel
streams them, 16 output rows at a time, one fixed-size record per group of 32 inputs. `pack_*` builds
them from codes and scales, `unpack_*` turns them back into a float weight (the reference), and
`q*_matmul_ref` defines what the kernels (`q4_matmul` / `q8_matmul` in izh.kernels.cpu.ops) compute.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "Q4_RECORD_BYTES",
    "Q8_RECORD_BYTES",
    "QGEMM_GROUP",
    "pack_q4",
    "pack_q8",
    "q4_matmul_ref",
    "q8_matmul_ref",
    "unpack_q4",
    "unpack_q8",
]

Q4_RECORD_BYTES = 320
Q8_RECORD_BYTES = 544
QGEMM_GROUP = 32


def _check_qshape(n: int, k: int) -> None:
    if n <= 0 or k <= 0 or n % 16 or k % QGEMM_GROUP:
        raise ValueError(f"quantized records need out % 16 == 0 and in % {QGEMM_GROUP} == 0, got ({n}, {k})")


def _rows_bf16(v: Tensor, tiles: int, groups: int) -> Tensor:
    """[N, groups] values -> [tiles, groups, 16 rows] bf16, as bytes [tiles, groups, 32]."""
    return v.to(torch.bfloat16).reshape(tiles, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _rows_from_bf16(b: Tensor, n: int, groups: int) -> Tensor:
    """Inverse of `_rows_bf16`: bytes [tiles, groups, 32] -> float32 [N, groups]."""
    return b.contiguous().view(torch.bfloat16).float().transpose(1, 2).reshape(n, groups)


def pack_q4(codes: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """int4 records (uint8 [N / 16, K / 32, 320]) for w = code * scale + min: codes [N, K] in 0..15,
    scales and mins [N, K / 32] (stored as bfloat16)."""
    n, k = codes.shape
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    # Input 32 g + 4 b + 2 h + e of row i goes to byte 2 i + e of block b, low nibble for h = 0.
    c = codes.to(torch.uint8).reshape(tiles, 16, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 256)
    return torch.cat(
        (nibbles, _rows_bf16(scales, tiles, groups), _rows_bf16(mins, tiles, groups)), dim=2
    ).contiguous()


def _q4_parts(records: Tensor, n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """int4 records -> (codes float32 [N, K] in 0..15, scales and mins float32 [N, K / 32])."""
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    r = records.reshape(tiles, groups, Q4_RECORD_BYTES)
    nibbles = r[..., :256].reshape(tiles, groups, 8, 16, 2)  # [t, g, b, i, e]
    codes = torch.stack((nibbles & 15, nibbles >> 4), dim=-1)  # [t, g, b, i, e, h]
    codes = codes.permute(0, 3, 1, 2, 5, 4).reshape(n, k).float()  # [t, i, g, b, h, e]
    return codes, _rows_from_bf16(r[..., 256:288], n, groups), _rows_from_bf16(r[..., 288:320], n, groups)


def unpack_q4(records: Tensor, n: int, k: int) -> Tensor:
    """The float32 weight [N, K] that int4 records hold."""
    codes, scales, mins = _q4_parts(records, n, k)
    return codes * scales.repeat_interleave(QGEMM_GROUP, 1) + mins.repeat_interleave(QGEMM_GROUP, 1)


def pack_q8(codes: Tensor, scales: Tensor) -> Tensor:
    """int8 records (uint8 [N / 16, K / 32, 544]) for w = code * scale: codes [N, K] in -128..127, scales
    [N, K / 32] (stored as bfloat16)."""
    n, k = codes.shape
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    c = codes.to(torch.int8).reshape(tiles, 16, groups, QGEMM_GROUP).permute(0, 2, 3, 1)  # [t, g, k, i]
    c = c.contiguous().view(torch.uint8).reshape(tiles, groups, 512)
    return torch.cat((c, _rows_bf16(scales, tiles, groups)), dim=2).contiguous()


def _q8_parts(records: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """int8 records -> (codes float32 [N, K] in -128..127, scales float32 [N, K / 32])."""
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    r = records.reshape(tiles, groups, Q8_RECORD_BYTES)
    codes = r[..., :512].contiguous().view(torch.int8).reshape(tiles, groups, QGEMM_GROUP, 16)
    codes = codes.permute(0, 3, 1, 2).reshape(n, k).float()
    return codes, _rows_from_bf16(r[..., 512:], n, groups)


def unpack_q8(records: Tensor, n: int, k: int) -> Tensor:
    """The float32 weight [N, K] that int8 records hold."""
    codes, scales = _q8_parts(records, n, k)
    return codes * scales.repeat_interleave(QGEMM_GROUP, 1)


def q4_matmul_ref(
    x: Tensor,
    records: Tensor,
    n: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    *,
    bf16_weights: bool = False,
) -> Tensor:
    """x [M, K] @ W^T in float32, rounded once to `out_dtype` (default x's dtype). `bf16_weights` rounds W
    to bfloat16 first, as the AMX kernel does (`qgemm_uses_amx`)."""
    return _matmul_ref(x, unpack_q4(records, n, k), out_dtype, bf16_weights)


def q8_matmul_ref(
    x: Tensor,
    records: Tensor,
    n: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    *,
    bf16_weights: bool = False,
) -> Tensor:
    """As `q4_matmul_ref`, for int8 records."""
    return _matmul_ref(x, unpack_q8(records, n, k), out_dtype, bf16_weights)


def _matmul_ref(x: Tensor, w: Tensor, out_dtype: torch.dtype | None, bf16_weights: bool) -> Tensor:
    if bf16_weights:
        w = w.bfloat16().float()
    return (x.float() @ w.T).to(out_dtype or x.dtype)


# --- float32 activations: int8 per group of 32 (csrc/records_f32.c) -----------------------------------


def quantize_rows_x8_ref(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x float32 [M, K] -> (q [M, K / 32, 32] float32 holding int8 values, d and e [M, K / 32]): per group
    of 32, d = max |x| / 127, q = round-half-even(x * (1 / d)) clamped to +-127 (0 where d = 0), e = d *
    sum(q)."""
    m, k = x.shape
    groups = x.float().reshape(m, k // QGEMM_GROUP, QGEMM_GROUP)
    d = groups.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse[..., None]).clamp_(-127, 127)
    return q, d, d * q.sum(dim=-1)


def _x8_ref(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor | None) -> Tensor:
    q, d, e = quantize_rows_x8_ref(x)
    m, n = x.shape[0], codes.shape[0]
    acc = torch.zeros(m, n)
    for g in range(q.shape[1]):
        # The exact integer dot products (|sum| < 2^17: float64 holds them exactly), then the kernel's
        # float32 epilogue, one rounding per operation.
        isum = (q[:, g].double() @ codes[:, QGEMM_GROUP * g : QGEMM_GROUP * (g + 1)].double().T).float()
        acc = acc + isum * (scales[:, g][None, :] * d[:, g][:, None])
        if mins is not None:
            acc = acc + mins[:, g][None, :] * e[:, g][:, None]
    return acc


def q4_matmul_x8_ref(x: Tensor, records: Tensor, n: int, k: int) -> Tensor:
    """What izh's float32 int4 record matmul computes for x float32 [M, K] (float32 [M, N]): x quantized
    by `quantize_rows_x8_ref`, then per group g in order: acc += isum * (scale * d) and acc += min * e,
    isum the exact dot product of the group's codes (w = code * scale + min)."""
    codes, scales, mins = _q4_parts(records, n, k)
    return _x8_ref(x, codes, scales, mins)


def q8_matmul_x8_ref(x: Tensor, records: Tensor, n: int, k: int) -> Tensor:
    """As `q4_matmul_x8_ref`, for int8 records (w = code * scale: no min term)."""
    codes, scales = _q8_parts(records, n, k)
    return _x8_ref(x, codes, scales, None)
