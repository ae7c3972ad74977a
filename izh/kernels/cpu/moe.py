"""Mixture-of-experts routing (`moe_route`): each token's top-k experts and routing weights, in C
(csrc/moe.c) when the library is loaded, else the torch reference `moe_route_ref`.

The C kernel computes each token from its own row only (one thread a row, a fixed summation order), so a
token's experts and weights are bit-identical whatever else is in the batch; the reference matches it up
to float rounding (torch's matmul and softmax sum in their own order), which can pick another expert only
at a near-tie.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from izh.kernels.cpu.library import STATE, CpuLibrary, resolve

MAX_EXPERTS = 1024  # MOE_MAX_EXPERTS in csrc/moe.c

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_BOUND: dict[int, Any] = {}


def _route_fn(lib: CpuLibrary) -> Any | None:
    """The library's `izh_moe_route_f32`, bound once per library (None without a library)."""
    if lib.handle is None:
        return None
    fn = _BOUND.get(id(lib.handle))
    if fn is None:
        fn = lib.handle.izh_moe_route_f32
        fn.restype = _INT
        fn.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _I64, _INT, _P, _P, _INT]
        _BOUND[id(lib.handle)] = fn
    return fn


def moe_route_ref(x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(expert ids int64 [T, k], routing weights float32 [T, k]) for tokens x [T, hidden] and a router
    [E, hidden]: softmax over the float32 logits, the k most probable experts (ties to the lower id),
    divided by their sum when `renormalize`; each token's k experts in ascending id order."""
    logits = torch.nn.functional.linear(x.float(), router_weight.float())  # [T, E]
    probs = torch.softmax(logits, dim=-1)
    # A stable descending sort keeps the lower id first among equal probabilities.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    ids, _ = torch.sort(order, dim=-1)
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def moe_route(x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """`moe_route_ref`'s contract, batch-invariant in C: x float32 or bfloat16 [T, hidden] (converted to
    float32), router_weight float32 [E, hidden] contiguous."""
    fn = _route_fn(STATE.active or resolve())
    num_experts, hidden = router_weight.shape
    if (
        fn is None
        or x.dim() != 2
        or not x.is_cpu
        or x.shape[1] != hidden
        or router_weight.dtype != torch.float32
        or not router_weight.is_contiguous()
        or not router_weight.is_cpu
        or num_experts > MAX_EXPERTS
        or not 1 <= top_k <= num_experts
    ):
        return moe_route_ref(x, router_weight, top_k, renormalize)
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens = x.shape[0]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    rc = fn(
        x.data_ptr(),
        x.stride(0),
        router_weight.data_ptr(),
        num_tokens,
        hidden,
        num_experts,
        top_k,
        int(renormalize),
        ids.data_ptr(),
        weights.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"moe_route failed (code {rc}) for {num_experts} experts, top {top_k}")
    return ids.long(), weights
