"""Weight-only int4 / int8 formats for small CPU batches, and packing one weight into them.

Decoding a few sequences on a CPU is bound by reading the weights from memory, not by arithmetic: every
step streams all of them once. Packed 4-bit weights are a quarter of bfloat16's bytes, so weight-only
kernels run those steps several times faster. Large batches (prefills) are compute bound and stay on the
dense bfloat16 matmul (oneDNN, AMX where present): each layer keeps both, and a step takes the packed
weight up to its `max_rows` (PyTorch's kernels: 8; izh's: 64 with AMX, 8 with AVX-512 alone).

Two kernel families, chosen at load time:
- izh's own (`izh.kernels.cpu.q4_matmul` / `q8_matmul`, C with AVX512-BF16): records laid out in the order
  the kernel streams them, int4 with a bf16 scale and minimum per 32 inputs (w = q * scale + min, q in
  [0, 15]: GGUF Q4_1's form) and int8 with a bf16 scale per 32 inputs (w = q * scale: GGUF Q8_0's form).
  Used wherever the CPU has AVX512-BF16 and the C library built: AVX-512 for 1-4 rows, AMX (when the CPU
  and the OS allow it) for 5-64. Against PyTorch's kernels on SmolLM2's shapes, called from Python: ~10%
  faster on one row (more inside the fused decode stack, which skips the per-call Python), 1.6x at 8
  rows, and the int8 LM head 1.3-2.5x (bench_results/README.md).
- PyTorch's (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) otherwise: int4 in the same groups
  (w = (q - 8) * scale + zero, scales and zeros [in / group_size, out, 2]) and int8 per output row.

A GGUF file's own blocks (`GGUFBlocks`, izh.kernels.cpu.gguf_blocks) are a third form: the weight stays
in the file's bytes (Q4_K, Q6_K, Q5_0, ...) and float32 activations, int8 per block inside the kernel,
meet it at any row count.

This module knows tensors only; the pass that packs a whole model's linears is `izh.model.packing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from izh.kernels import cpu as cpu_ops
from izh.kernels.cpu.gguf_blocks import gguf_matmul, gguf_rows

RECORDS_ANY_ROWS = 1 << 62
"""`max_rows` of float32 records: they take every step, prefills included (the dense weight is dropped)."""
TORCH_PACKED_MAX_ROWS = 8
"""Rows (tokens) up to which PyTorch's packed kernels beat the dense bfloat16 matmul (measured on AVX-512/AMX,
2 cores: 16 is slower). izh's records go further where AMX runs them (`cpu_ops.qgemm_max_rows()`: 64)."""
INT4_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A [out, in] weight packed for `_weight_int4pack_mm_for_cpu`."""

    packed: Tensor
    scales_zeros: Tensor
    group_size: int

    max_rows: ClassVar[int] = TORCH_PACKED_MAX_ROWS
    """The most rows (tokens) a step sends through this weight instead of the dense one."""

    def matmul(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)
        return y if out is None else out[: y.shape[0]].copy_(y)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A [out, in] weight as int8 rows with one scale per row, for `_weight_int8pack_mm`."""

    weight: Tensor
    scales: Tensor

    max_rows: ClassVar[int] = TORCH_PACKED_MAX_ROWS

    def matmul(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return y if out is None else out[: y.shape[0]].copy_(y)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


@dataclass(frozen=True, slots=True)
class _Records:
    """A [out, in] weight as izh's records (izh.kernels.cpu), for batches of <= max_rows."""

    records: Tensor
    out_features: int
    in_features: int
    max_rows: int
    """bfloat16: `cpu_ops.qgemm_max_rows()` (64 with AMX, else 8); float32: `RECORDS_ANY_ROWS`."""
    kind: ClassVar[int]
    """4 or 8: the record format, as the fused decode stack's table names it."""

    @property
    def nbytes(self) -> int:
        return self.records.nbytes


@dataclass(frozen=True, slots=True)
class Q4Records(_Records):
    """int4 records (`izh.kernels.cpu.pack_q4`)."""

    kind: ClassVar[int] = 4

    def matmul(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [M, in] -> new [M, out] in x's dtype (bfloat16 or float32), or into out[:M] (float32, or
        bfloat16 for bfloat16 x)."""
        return cpu_ops.q4_matmul(x, self.records, self.out_features, self.in_features, out)


@dataclass(frozen=True, slots=True)
class Q8Records(_Records):
    """int8 records (`izh.kernels.cpu.pack_q8`)."""

    kind: ClassVar[int] = 8

    def matmul(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return cpu_ops.q8_matmul(x, self.records, self.out_features, self.in_features, out)


@dataclass(frozen=True, slots=True)
class GGUFPart:
    """Rows of a weight kept in a GGUF file's own blocks: uint8 [rows, row_bytes] of `ggml_type`."""

    ggml_type: str
    raw: Tensor

    @property
    def rows(self) -> int:
        return self.raw.shape[0]


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """A [out, in] weight in the file's own blocks (izh.kernels.cpu.gguf_blocks), stacked by rows from one
    part per checkpoint tensor (a fused qkv_proj may mix Q4_K, Q6_K and Q5_0 rows). float32 activations,
    every step: the kernels quantize each row of x to int8 per block and take any number of rows."""

    parts: tuple[GGUFPart, ...]
    out_features: int
    in_features: int

    max_rows: ClassVar[int] = RECORDS_ANY_ROWS
    kind: ClassVar[int] = 0
    """Not one of izh's record formats (4, 8); the float32 fused decode stack reads the blocks as
    `cpu_ops.STACK_GGUF` linears (izh.model.fused_stack)."""

    def matmul(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [M, in] -> float32 [M, out], new or written into out[:M] and returned."""
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32) if out is None else out[:m]
        start = 0
        for part in self.parts:
            gguf_matmul(
                x, part.ggml_type, part.raw, part.rows, self.in_features, out=y[:, start : start + part.rows]
            )
            start += part.rows
        return y

    def rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the weight dequantized (float32 [*ids.shape, in]): an embedding lookup that
        decodes only the rows it reads. One part only."""
        (part,) = self.parts
        return gguf_rows(part.ggml_type, part.raw, ids, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(part.raw.nbytes for part in self.parts)


PackedWeight = Int4Weight | Int8Weight | Q4Records | Q8Records | GGUFBlocks


def int4_supported(weight: Tensor, group_size: int = INT4_GROUP_SIZE) -> bool:
    """The kernel's shape rules: rows a multiple of 16, columns a multiple of the group."""
    out_features, in_features = weight.shape
    return out_features % 16 == 0 and in_features % group_size == 0


def int4_groups(weight: Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 of a [out, in] weight by groups along the input dim: (codes int32 [out, in] in
    [0, 15], scale and minimum float32 [out, in / group_size]) with w ~ code * scale + minimum."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    scale = (high - low) / 15
    # A constant group has no range: any positive scale codes it exactly (q = 0).
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scale, low


def quantize_int4(weight: Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Pack a [out, in] float weight as asymmetric int4 groups for PyTorch's kernel (scale and zero in the
    weight's dtype)."""
    if not int4_supported(weight, group_size):
        raise ValueError(
            f"int4 packing needs out % 16 == 0 and in % {group_size} == 0, got {tuple(weight.shape)}"
        )
    codes, scale, low = int4_groups(weight, group_size)
    zero = low + 8 * scale  # w = (q - 8) * scale + zero  ==  q * scale + low
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return Int4Weight(packed=packed, scales_zeros=scales_zeros, group_size=group_size)


def quantize_int8(weight: Tensor) -> Int8Weight:
    """Symmetric int8 per output row (scale = max |w| / 127), for PyTorch's kernel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Weight(weight=codes.contiguous(), scales=scale.to(weight.dtype))


def records_supported(weight: Tensor) -> bool:
    """izh's record kernels run here for this weight's dtype and take this shape (out % 16 == 0, in %
    32 == 0): bfloat16 with the AVX512-BF16 kernels (`qgemm_available`), float32 with the int8-activation
    kernels every variant has (`records_f32_available`)."""
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % cpu_ops.QGEMM_GROUP or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return cpu_ops.records_f32_available()
    return weight.dtype == torch.bfloat16 and cpu_ops.qgemm_available()


def _records_max_rows(dtype: torch.dtype) -> int:
    """bfloat16 records serve up to `qgemm_max_rows()` rows (the dense matmul is faster above); float32
    records serve every step (`RECORDS_ANY_ROWS`)."""
    return RECORDS_ANY_ROWS if dtype == torch.float32 else cpu_ops.qgemm_max_rows()


def quantize_q4_records(weight: Tensor) -> Q4Records:
    """izh's int4 records of a [out, in] weight (groups of 32, scale and minimum per group)."""
    codes, scale, low = int4_groups(weight, cpu_ops.QGEMM_GROUP)
    out_features, in_features = weight.shape
    records = cpu_ops.pack_q4(codes, scale, low)
    return Q4Records(records, out_features, in_features, _records_max_rows(weight.dtype))


def quantize_q8_records(weight: Tensor) -> Q8Records:
    """izh's int8 records of a [out, in] weight: symmetric per group of 32 (scale = max |w| / 127)."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, -1, cpu_ops.QGEMM_GROUP)
    scale = groups.abs().amax(dim=-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    records = cpu_ops.pack_q8(codes.reshape(out_features, in_features), scale)
    return Q8Records(records, out_features, in_features, _records_max_rows(weight.dtype))
