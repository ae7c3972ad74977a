"""Gemma's kernels: GELU(tanh) * up (`gelu_tanh_mul`), RMSNorm of each q/k head in place
(`rms_norm_heads_`), and the float32 fused decode stack of Gemma 2 / 3 (`gemma_decode_stack`, csrc/
gemma_stack.c), each through the active C library when it applies, else its torch reference.

The Gemma modules (izh.model.gemma) call the first two on every step, and the stack calls the same C row
kernels, so a decode step's result is the same bits through the modules or through the stack.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from izh.kernels.cpu.library import STATE, CpuLibrary, resolve
from izh.kernels.cpu.ops import ATTENTION_ERRORS
from izh.kernels.cpu.reference import rms_norm_ref

__all__ = [
    "GEMMA_STACK_FIELDS",
    "gelu_tanh_mul",
    "gelu_tanh_mul_ref",
    "gemma_decode_stack",
    "rms_norm_heads_",
    "rms_norm_heads_ref_",
]

GEMMA_STACK_FIELDS = 22
"""int64 fields per layer in `gemma_decode_stack`'s table (the GEMMA_* enum in csrc/gemma_stack.c): the
input, post-attention, pre- and post-feedforward norm weights, the q and k norm weights (0: none), the KV
cache, the layer's KV cache group, its sliding window (0: global), 1 for the local RoPE, then (weights,
kind, bias) for qkv, o, gate_up and down as in `cpu_ops.decode_stack`'s table."""

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_BOUND: dict[tuple[int, torch.dtype], tuple[Any, Any, Any]] = {}
"""Per (library handle, dtype): gelu_tanh_mul, rms_norm_heads and (float32) the stack, bound once."""


def _kernels(lib: CpuLibrary, dtype: torch.dtype) -> tuple[Any, Any, Any] | None:
    if lib.handle is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    key = (id(lib.handle), dtype)
    bound = _BOUND.get(key)
    if bound is None:
        sfx = "f32" if dtype == torch.float32 else "bf16"
        gelu = getattr(lib.handle, f"izh_gelu_tanh_mul_{sfx}")
        gelu.restype = None
        gelu.argtypes = [_P, _I64, _P, _I64, _I64, _INT]
        heads = getattr(lib.handle, f"izh_rms_norm_heads_{sfx}")
        heads.restype = None
        heads.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _I64, _F32, _INT]
        stack = lib.handle.izh_gemma_stack_f32
        stack.restype = _INT
        stack.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _F32, _P, _P, _P, _P, _P]
        stack.argtypes += [_P, _I64, _P, _I64, _I64, _I64, _INT]
        lib.handle.izh_gemma_stack_fields.restype = _INT
        assert lib.handle.izh_gemma_stack_fields() == GEMMA_STACK_FIELDS
        bound = _BOUND[key] = (gelu, heads, stack)
    return bound


def gelu_tanh_mul_ref(gate_up: Tensor) -> Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up [n, 2 * I] = [gate | up] -> [n, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    """`gelu_tanh_mul_ref(gate_up)`: [n, 2 * I] -> new [n, I]; tanh through the kernels' exp, so an element
    may differ from torch's by an ulp or two."""
    k = _kernels(STATE.active or resolve(), gate_up.dtype)
    if k is not None and gate_up.is_cpu and gate_up.dim() == 2:
        n, width = gate_up.shape
        stride = gate_up.stride()
        if stride[1] == 1 and width % 2 == 0:
            out = gate_up.new_empty(n, width // 2)
            k[0](gate_up.data_ptr(), stride[0], out.data_ptr(), n, width // 2, torch.get_num_threads())
            return out
    return gelu_tanh_mul_ref(gate_up)


def rms_norm_heads_ref_(x: Tensor, weight: Tensor, eps: float) -> None:
    """Each head of x [n, heads, d] replaced by its RMSNorm with weight [d] (in place)."""
    x.copy_(rms_norm_ref(x, weight, eps))


def rms_norm_heads_(x: Tensor, weight: Tensor, eps: float) -> None:
    """`rms_norm_heads_ref_(x, weight, eps)`: x [n, heads, d] any token and head stride (element stride 1),
    e.g. the q or k heads of a packed qkv; each head normalized as `cpu_ops.rms_norm` normalizes a row."""
    k = _kernels(STATE.active or resolve(), x.dtype)
    if (
        k is not None
        and x.is_cpu
        and weight.is_cpu
        and weight.dtype == x.dtype
        and x.dim() == 3
        and weight.is_contiguous()
        and x.stride(2) == 1
        and weight.shape == (x.shape[2],)
    ):
        n, heads, d = x.shape
        k[1](
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            weight.data_ptr(),
            n,
            heads,
            d,
            eps,
            torch.get_num_threads(),
        )
        return
    rms_norm_heads_ref_(x, weight, eps)


def gemma_available() -> bool:
    """Whether `gemma_decode_stack` (and the C row kernels above) run here: the C library is loaded."""
    return _kernels(STATE.active or resolve(), torch.float32) is not None


def gemma_decode_stack(
    table: Tensor,
    dims: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    softcap: float,
    x: Tensor,
    final_norm: Tensor,
    cos_sin: tuple[Tensor, Tensor],
    groups: Tensor,
    seq_lens: Tensor,
    kv_geometry: tuple[int, int, int],
) -> Tensor:
    """Every Gemma decoder layer plus the final norm for M single-token decodes, float32, in one C call
    (`gemma_available()` must hold).

    table: int64 [layers, GEMMA_STACK_FIELDS] (izh.model.gemma_stack builds it); dims: (hidden, heads, kv
    heads, head_dim, intermediate); scale: the query scale; softcap: the attention score soft-cap (0: none);
    x: [M, hidden] scaled embeddings, overwritten (the residual stream); cos_sin: (global, local) [M,
    head_dim]; groups: int64 [G, 3], per KV cache group (slot_mapping int64 [M], block_tables int32 [M,
    max_blocks], max_blocks) pointers; seq_lens int32 [M]; kv_geometry: (num_blocks, block_size, kv_type: ops.KV_TYPES of the caches' dtype). Returns
    the final-normed hidden states [M, hidden]. Raises IndexError for an index outside the cache.
    """
    k = _kernels(STATE.active or resolve(), torch.float32)
    assert k is not None, "gemma_decode_stack needs the C library (gemma_available())"
    hidden, heads, kv_heads, head_dim, inter = dims
    m = x.shape[0]
    out = x.new_empty(m, hidden)
    rc = k[2](
        table.data_ptr(),
        table.shape[0],
        m,
        hidden,
        heads,
        kv_heads,
        head_dim,
        inter,
        eps,
        scale,
        softcap,
        x.data_ptr(),
        final_norm.data_ptr(),
        out.data_ptr(),
        cos_sin[0].data_ptr(),
        cos_sin[1].data_ptr(),
        groups.data_ptr(),
        groups.shape[0],
        seq_lens.data_ptr(),
        kv_geometry[0],
        kv_geometry[1],
        kv_geometry[2],
        torch.get_num_threads(),
    )
    if rc != 0:
        if rc in ATTENTION_ERRORS and rc not in (-4, -5):
            raise IndexError(f"gemma_decode_stack: {ATTENTION_ERRORS[rc]}")
        reasons = {-4: "out of memory", -5: "no rows", -6: "a matmul refused its shape", -7: "a bad KV group"}
        raise RuntimeError(f"gemma_decode_stack failed: {reasons.get(rc, f'code {rc}')}")
    return out
