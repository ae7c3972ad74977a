"""Mixture-of-experts routing (`moe_route`): each token's top-k experts and routing weights, in C
(csrc/moe.c) when the library is loaded, else the torch reference `moe_route_ref`.

The C kernel computes each token from its own row only (one thread a row, a fixed summation order), so a
token's experts and weights are bit-identical whatever else is in the batch; the reference matches it up
to float rounding (torch's matmul and softmax sum in their own order), which can pick another expert only
at a near-tie.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import torch
from torch import Tensor

from izh.kernels.cpu.library import STATE, CpuLibrary, resolve

MAX_EXPERTS = 1024  # MOE_MAX_EXPERTS in csrc/moe.c

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_BOUND: dict[tuple[int, str], Any] = {}
EXPERT_FIELDS = 6  # MOE_EXPERT_FIELDS in csrc/moe.c: gate_up's (records or parts, kind, bias), then down's
_SIGNATURES = {
    "izh_moe_route_f32": [_P, _I64, _P, _I64, _I64, _I64, _I64, _INT, _P, _P, _P, _P, _P, _INT],
    "izh_moe_experts_f32": [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _P, _INT],
}


def _bound(lib: CpuLibrary, name: str) -> Any | None:
    """The library's function `name` (an int-returning one of _SIGNATURES), bound once per library (None
    without a library)."""
    if lib.handle is None:
        return None
    key = (id(lib.handle), name)
    fn = _BOUND.get(key)
    if fn is None:
        fn = getattr(lib.handle, name)
        fn.restype = _INT
        fn.argtypes = _SIGNATURES[name]
        _BOUND[key] = fn
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


class Routing(NamedTuple):
    """One step's routing: per token its experts and weights, and the (token, slot) pairs by expert."""

    expert_ids: Tensor
    """int64 [T, k]: each token's experts, ascending."""
    weights: Tensor
    """float32 [T, k]: their routing weights."""
    order: Tensor
    """int64 [T * k]: the pairs (p = token * k + slot) grouped by expert, tokens ascending within one."""
    tokens: Tensor
    """int64 [T * k]: the token of each pair in `order` (order // k)."""
    counts: list[int]
    """Pairs per expert, in expert order (`order`'s groups)."""
    count_tensor: Tensor
    """int64 [E]: `counts` as a tensor."""


def moe_route(x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool) -> Routing:
    """`moe_route_ref`'s experts and weights, batch-invariant in C, with the pairs grouped by expert:
    x float32 or bfloat16 [T, hidden] (routed in float32), router_weight float32 [E, hidden]."""
    fn = _bound(STATE.active or resolve(), "izh_moe_route_f32")
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
        return _grouped(*moe_route_ref(x, router_weight, top_k, renormalize), num_experts)
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens = x.shape[0]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    grouped = torch.empty(3, num_tokens * top_k, dtype=torch.int64)  # order, tokens, counts (room)
    counts = torch.empty(num_experts, dtype=torch.int64)
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
        grouped[0].data_ptr(),
        grouped[1].data_ptr(),
        counts.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"moe_route failed (code {rc}) for {num_experts} experts, top {top_k}")
    return Routing(ids, weights, grouped[0], grouped[1], counts.tolist(), counts)


def _grouped(ids: Tensor, weights: Tensor, num_experts: int) -> Routing:
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return Routing(ids, weights, order, order // ids.shape[1], counts.tolist(), counts)


def moe_experts(table: Tensor, routing: Routing, x: Tensor, intermediate: int) -> Tensor | None:
    """Every expert's gate_up -> silu_mul -> down over its routed rows of x in one C call
    (`izh_moe_experts_f32`): float32 [T * k, hidden], row p the output of pair p (token p // k, slot
    p % k). `table` int64 [E, EXPERT_FIELDS] holds each expert's linears as the fused decode stack reads
    them. The same kernel calls as the experts' modules, so the same bits; None when the library is not
    loaded or x is not a float32 CPU matrix with unit inner stride (the caller runs the modules)."""
    fn = _bound(STATE.active or resolve(), "izh_moe_experts_f32")
    if fn is None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1:
        return None
    num_tokens, hidden = x.shape
    out = x.new_empty(num_tokens * routing.expert_ids.shape[1], hidden)
    rc = fn(
        table.data_ptr(),
        table.shape[0],
        routing.count_tensor.data_ptr(),
        routing.order.data_ptr(),
        routing.tokens.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        hidden,
        intermediate,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"moe experts failed (code {rc}) for hidden {hidden}, intermediate {intermediate}")
    return out
