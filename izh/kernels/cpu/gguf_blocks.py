"""Matmuls and row gathers over GGUF weight blocks as the file stores them (csrc/gguf_blocks.c).

A weight is N rows of one ggml block type (uint8 [N, row_bytes], the file's bytes): Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, IQ4_NL (32 inputs a block) or Q4_K, Q5_K, Q6_K, IQ4_XS (256). `gguf_matmul` multiplies float32
activations by it with integer dot products (activations in int8 per block, as llama.cpp's Q8_0 / Q8_K),
`gguf_matmul_ref` defines the result bit for bit (csrc/gguf_blocks.c's header gives the recipe), and
`gguf_rows` dequantizes only the rows asked for (an embedding lookup), exactly as gguf-py does.

`decode_blocks` is the reference decoder: codes, integer scales and mins per 16 inputs, float scales per
block, the form every kernel computes with.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from izh.kernels.cpu.library import STATE, CpuLibrary, resolve

__all__ = [
    "GGUF_BLOCK_TYPES",
    "DecodedBlocks",
    "block_bytes",
    "block_size",
    "decode_blocks",
    "gguf_matmul",
    "gguf_matmul_ref",
    "gguf_rows",
    "gguf_rows_ref",
    "gguf_uses_amx",
    "quantize_rows_ref",
]

GGUF_BLOCK_TYPES: dict[str, tuple[int, int, int]] = {
    # name: (ggml type id, inputs per block, bytes per block)
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "IQ4_NL": (20, 32, 18),
    "IQ4_XS": (23, 256, 136),
}
"""The ggml types the kernels serve."""
_BY_ID = {type_id: name for name, (type_id, _, _) in GGUF_BLOCK_TYPES.items()}
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_FLOAT_MIN = ("Q4_1", "Q5_1")
_INT_MIN = ("Q4_K", "Q5_K")


def _name(ggml_type: int | str) -> str:
    name = ggml_type if isinstance(ggml_type, str) else _BY_ID.get(int(ggml_type), str(ggml_type))
    if name not in GGUF_BLOCK_TYPES:
        raise ValueError(f"no GGUF block kernel for type {name}; served: {', '.join(GGUF_BLOCK_TYPES)}")
    return name


def block_size(ggml_type: int | str) -> int:
    """Inputs per block of a served type."""
    return GGUF_BLOCK_TYPES[_name(ggml_type)][1]


def block_bytes(ggml_type: int | str) -> int:
    """Bytes per block of a served type."""
    return GGUF_BLOCK_TYPES[_name(ggml_type)][2]


@dataclass(frozen=True, slots=True)
class DecodedBlocks:
    """A weight [N, K] in the kernels' form: w = dw * s * c (+ mw for Q4_1 / Q5_1, - mw * m for Q4_K /
    Q5_K), s and m per 16 inputs, dw and mw per block."""

    codes: np.ndarray  # int8 [N, K]
    scales: np.ndarray  # int32 [N, K / 16]
    mins: np.ndarray | None  # int32 [N, K / 16] (Q4_K, Q5_K)
    dw: np.ndarray  # float32 [N, K / block]
    mw: np.ndarray | None  # float32 [N, K / block] (Q4_1, Q5_1, Q4_K, Q5_K)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.int16)


def decode_blocks(ggml_type: int | str, raw: np.ndarray | Tensor, k: int) -> DecodedBlocks:
    """The reference decoder: raw uint8 [N, >= K / block * bytes] of a served type -> `DecodedBlocks`."""
    name = _name(ggml_type)
    _, bs, nb = GGUF_BLOCK_TYPES[name]
    data = raw.numpy() if isinstance(raw, Tensor) else raw
    n = data.shape[0]
    blocks = np.ascontiguousarray(data[:, : k // bs * nb]).reshape(n, k // bs, nb)
    mins: np.ndarray | None = None
    mw: np.ndarray | None = None
    ones = np.ones((n, k // 16), dtype=np.int32)
    if bs == 32:
        dw = _f16(blocks[..., 0:2])
        if name in ("Q4_0", "Q4_1", "IQ4_NL"):
            start = 4 if name == "Q4_1" else 2
            q = _nibbles32(blocks[..., start : start + 16])
            codes = _IQ4NL[q] if name == "IQ4_NL" else q - (8 if name == "Q4_0" else 0)
        elif name in ("Q5_0", "Q5_1"):
            start = 4 if name == "Q5_1" else 2
            qh = np.ascontiguousarray(blocks[..., start : start + 4]).view("<u4")[..., 0].astype(np.uint32)
            bits = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
            q = _nibbles32(blocks[..., start + 4 : start + 20]) | (bits << 4)
            codes = q - (16 if name == "Q5_0" else 0)
        else:  # Q8_0
            codes = blocks[..., 2:34].view(np.int8).astype(np.int16)
        if name in _FLOAT_MIN:
            mw = _f16(blocks[..., 2:4])
        return DecodedBlocks(codes.reshape(n, k).astype(np.int8), ones, None, dw, mw)
    if name in ("Q4_K", "Q5_K"):
        dw, mw = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc = blocks[..., 4:16].astype(np.int32)
        low = np.concatenate((sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)), axis=-1)
        mn = np.concatenate((sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)), axis=-1)
        ql = blocks[..., 48:176] if name == "Q5_K" else blocks[..., 16:144]
        ql = ql.reshape(n, k // 256, 4, 32)
        q = np.stack((ql & 15, ql >> 4), axis=3).astype(np.int16)  # [n, b, 4 groups, 2 halves, 32]
        if name == "Q5_K":
            qh = blocks[..., 16:48][:, :, None, None, :]  # bit 2 g + h of byte l
            shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[None, None, :, :, None]
            q = q | (((qh >> shift) & 1).astype(np.int16) << 4)
        codes = q.reshape(n, k)
        scales = np.repeat(low, 2, axis=-1).reshape(n, k // 16)
        mins = np.repeat(mn, 2, axis=-1).reshape(n, k // 16)
        return DecodedBlocks(codes.astype(np.int8), scales, mins, dw, mw)
    if name == "Q6_K":
        ql = blocks[..., 0:128].reshape(n, k // 256, 2, 64).astype(np.int16)
        qh = blocks[..., 128:192].reshape(n, k // 256, 2, 1, 32).astype(np.int16)
        hi = (qh >> (2 * np.arange(4)[:, None])) & 3  # [n, b, half, 4, 32]
        lo = np.stack((ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4), axis=3)
        codes = (lo | (hi << 4)) - 32
        scales = blocks[..., 192:208].view(np.int8).astype(np.int32).reshape(n, k // 16)
        return DecodedBlocks(
            codes.reshape(n, k).astype(np.int8), scales, None, _f16(blocks[..., 208:210]), None
        )
    # IQ4_XS
    dw = _f16(blocks[..., 0:2])
    sh = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")[..., 0].astype(np.int32)
    sl = blocks[..., 4:8].astype(np.int32)
    ib = np.arange(8)
    ls = ((sl[..., ib // 2] >> (4 * (ib % 2))) & 15) | (((sh[..., None] >> (2 * ib)) & 3) << 4)
    q = _nibbles32(blocks[..., 8:136].reshape(n, k // 256, 8, 16))
    codes = _IQ4NL[q].reshape(n, k)
    scales = np.repeat(ls - 32, 2, axis=-1).reshape(n, k // 16).astype(np.int32)
    return DecodedBlocks(codes, scales, None, dw, None)


def quantize_rows_ref(x: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x float32 [M, K] -> (q float64 [M, K] holding int8 values, dx and ex float32 [M, K / group], sums
    of q per 16 inputs float64 [M, K / 16]): dx = max |x| / 127, q = round-half-even(x * (1 / dx))
    clamped to +-127 (0 where dx = 0), ex = dx * sum(q) over the group."""
    m, k = x.shape
    groups = x.float().reshape(m, k // group, group)
    dx = groups.abs().amax(dim=-1) / 127
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(groups * inverse[..., None]).clamp_(-127, 127)
    ex = dx * q.sum(dim=-1)
    q = q.reshape(m, k).double()
    return q, dx, ex, q.reshape(m, k // 16, 16).sum(dim=-1)


def gguf_matmul_ref(x: Tensor, ggml_type: int | str, raw: np.ndarray | Tensor, n: int, k: int) -> Tensor:
    """What `gguf_matmul` computes (float32 [M, N]) for x float32 [M, K]: the recipe of csrc/gguf_blocks.c's
    header, the integer sums exact in float64 (|sum| < 2^53), the float epilogue one rounding per op."""
    name = _name(ggml_type)
    bs = GGUF_BLOCK_TYPES[name][1]
    dec = decode_blocks(name, raw, k)
    q, dx, ex, qs16 = quantize_rows_ref(x, bs)
    m = x.shape[0]
    codes = torch.from_numpy(dec.codes.astype(np.float64)).reshape(n, k // 16, 16)
    scales = torch.from_numpy(dec.scales.astype(np.float64))
    mins = torch.from_numpy(dec.mins.astype(np.float64)) if dec.mins is not None else None
    dw = torch.from_numpy(dec.dw)
    mw = torch.from_numpy(dec.mw) if dec.mw is not None else None
    q16 = q.reshape(m, k // 16, 16)
    per = bs // 16
    acc = torch.zeros(m, n)
    for b in range(k // bs):
        j = slice(b * per, (b + 1) * per)
        dots = torch.einsum("mjk,njk->mnj", q16[:, j], codes[:, j])  # exact
        isum = (dots * scales[None, :, j]).sum(dim=-1).float()
        acc = acc + isum * (dw[None, :, b] * dx[:, b, None])
        if name in _FLOAT_MIN:
            assert mw is not None
            acc = acc + mw[None, :, b] * ex[:, b, None]
        elif name in _INT_MIN:
            assert mins is not None and mw is not None
            msum = (qs16[:, None, j] * mins[None, :, j]).sum(dim=-1).float()
            acc = acc - msum * (mw[None, :, b] * dx[:, b, None])
    return acc


def gguf_rows_ref(ggml_type: int | str, raw: np.ndarray | Tensor, ids: Tensor, k: int) -> Tensor:
    """Rows `ids` of the weight as float32 [len(ids), K], dequantized by gguf-py (what transformers loads)."""
    import gguf

    data = raw.numpy() if isinstance(raw, Tensor) else raw
    rows = np.ascontiguousarray(data[ids.numpy()])
    qtype = gguf.GGMLQuantizationType[_name(ggml_type)]
    values = gguf.quants.dequantize(rows[:, : k // block_size(ggml_type) * block_bytes(ggml_type)], qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(len(rows), k))


# --- the C kernels ----------------------------------------------------------------------------------------

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_BOUND: dict[int, tuple[Any, Any, Any] | None] = {}


def _kernels(lib: CpuLibrary) -> tuple[Any, Any, Any] | None:
    """(matmul, dequant_rows, uses_amx) of a loaded library, bound once; None without a library."""
    if lib.handle is None:
        return None
    key = id(lib.handle)
    if key not in _BOUND:
        matmul = lib.handle.izh_gguf_matmul_f32
        matmul.restype = _INT
        matmul.argtypes = [_INT, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, _INT]
        rows = lib.handle.izh_gguf_dequant_rows
        rows.restype = _INT
        rows.argtypes = [_INT, _P, _I64, _I64, _P, _I64, _I64, _P, _I64]
        uses_amx = lib.handle.izh_gguf_uses_amx
        uses_amx.restype = _INT
        uses_amx.argtypes = [_INT, _I64]
        _BOUND[key] = (matmul, rows, uses_amx)
    return _BOUND[key]


def _check_raw(ggml_type: int | str, raw: Tensor, k: int) -> str:
    name = _name(ggml_type)
    _, bs, nb = GGUF_BLOCK_TYPES[name]
    if (
        k % bs
        or raw.dtype != torch.uint8
        or raw.dim() != 2
        or raw.stride(1) != 1
        or raw.shape[1] < k // bs * nb
    ):
        raise ValueError(
            f"{name} weight needs in % {bs} == 0 and uint8 rows of >= {k // bs * nb} bytes, "
            f"got in={k}, {raw.dtype} {tuple(raw.shape)}"
        )
    return name


def gguf_matmul(
    x: Tensor, ggml_type: int | str, raw: Tensor, n: int, k: int, out: Tensor | None = None
) -> Tensor:
    """x float32 [M, K] @ W^T, W the N rows of `raw` (uint8 [N, row_bytes], the file's blocks): a new
    float32 [M, N], or written into `out` ([M, N] view with unit column stride, e.g. columns of a wider
    buffer) and returned. Bit-identical to `gguf_matmul_ref` in every kernel variant."""
    name = _check_raw(ggml_type, raw, k)
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or raw.shape[0] != n:
        raise ValueError(f"gguf_matmul: x {tuple(x.shape)} against a weight ({n}, {k})")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"gguf_matmul: out must be float32 [{m}, {n}] with unit column stride")
    kernels = _kernels(STATE.active or resolve())
    if kernels is None or m == 0:
        return out.copy_(gguf_matmul_ref(x, name, raw, n, k)) if m else out
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    type_id = GGUF_BLOCK_TYPES[name][0]
    rc = kernels[0](
        type_id, x.data_ptr(), x.stride(0), raw.data_ptr(), raw.stride(0), m, n, k,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gguf_matmul failed (code {rc}) for {name} x {tuple(x.shape)}, weight ({n}, {k})")
    return out


def gguf_uses_amx(ggml_type: int | str, rows: int) -> bool:
    """Whether `gguf_matmul` of `rows` rows runs on the AMX tiles (the amx variant, a CPU with AMX-INT8 that
    Linux lets use them, from 4 rows for Q4_K and Q6_K, 8 for the other formats): the same bits as every other path, faster on those batches."""
    kernels = _kernels(STATE.active or resolve())
    return kernels is not None and bool(kernels[2](GGUF_BLOCK_TYPES[_name(ggml_type)][0], rows))


def gguf_rows(ggml_type: int | str, raw: Tensor, ids: Tensor, k: int) -> Tensor:
    """Rows `ids` (int64, any shape) of the weight dequantized, float32 [*ids.shape, K]: bit-identical to
    gguf-py's dequantization (`gguf_rows_ref`), only those rows decoded."""
    name = _check_raw(ggml_type, raw, k)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    kernels = _kernels(STATE.active or resolve())
    if kernels is None:
        return gguf_rows_ref(name, raw, flat, k).reshape(*ids.shape, k)
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    rc = kernels[1](
        GGUF_BLOCK_TYPES[name][0], raw.data_ptr(), raw.stride(0), raw.shape[0], flat.data_ptr(), flat.numel(),
        k, out.data_ptr(), k,
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"token id out of range [0, {raw.shape[0]}) in an embedding lookup")
    return out.reshape(*ids.shape, k)
