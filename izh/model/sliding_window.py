"""Sliding-window (and soft-capped) attention on top of any attention backend.

A sliding-window layer's query at position p sees the keys at (p - window, p]. While no sequence in a
step is longer than the window every key lies inside it, so the engine's own backend (the paged C
decode kernel included) is exact and runs; past it, or with Gemma 2's score soft-capping,
`windowed_attention` runs the step in torch, reading only the slots inside each sequence's window from
the paged cache (so blocks before the window are never read). Used by Gemma 2/3 and Mistral.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from izh.model.attention import AttentionBackend, AttentionMetadata


class WindowedBackend(AttentionBackend):
    """The engine's backend when it computes exactly this layer's attention, else windowed_attention."""

    name = "gemma_windowed"

    def __init__(self, window: int | None, softcap: float = 0.0) -> None:
        self.window = window
        self.softcap = softcap
        self.inner: AttentionBackend | None = None
        """The engine's backend, set before each forward (it changes when KV caches are bound)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        inner = self.inner
        assert inner is not None
        if not self.softcap and (self.window is None or attn_metadata.max_seq_len <= self.window):
            return inner.forward(query, key, value, kv_cache, attn_metadata, scale)
        return windowed_attention(
            query, key, value, kv_cache, attn_metadata, scale, self.window, self.softcap
        )


def windowed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float,
) -> Tensor:
    """Causal attention where a query at position p sees keys in (p - window, p] (all up to p when
    window is None), scores soft-capped to softcap * tanh(s / softcap) when softcap > 0.

    With a KV cache this step's K/V are written to their slots first and each sequence reads only the
    slots of its window (blocks before it may be freed); without one, sequences must be fresh.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    if kv_cache is not None:
        rows = kv_cache.shape[1] * kv_cache.shape[2]
        key_slots = kv_cache[0].view(rows, num_kv_heads, head_dim)
        value_slots = kv_cache[1].view(rows, num_kv_heads, head_dim)
        key_slots.index_copy_(0, meta.slot_mapping, key)
        value_slots.index_copy_(0, meta.slot_mapping, value)
        block_size = kv_cache.shape[2]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.host_query_lens(), meta.host_seq_lens(), strict=True)):
        first = seq_len - query_len  # position of this step's first query
        lo = 0 if window is None else max(0, first - window + 1)
        if kv_cache is None:
            if first != 0:
                raise ValueError("attention without a KV cache needs fresh sequences (seq_len == query_len)")
            k, v = key[start : start + query_len], value[start : start + query_len]
        else:
            positions = torch.arange(lo, seq_len, device=query.device)
            blocks = meta.block_tables[i].to(torch.int64).index_select(0, positions // block_size)
            slots = blocks * block_size + positions % block_size
            k, v = key_slots.index_select(0, slots), value_slots.index_select(0, slots)
        q = query[start : start + query_len].transpose(0, 1)  # [heads, q, d]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)).mul_(scale)  # [heads, q, ctx]
        if softcap:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        query_pos = torch.arange(first, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(lo, seq_len, device=query.device)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= query_pos - key_pos < window
        scores.masked_fill_(~visible, -math.inf)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start : start + query_len] = torch.matmul(probs, v).transpose(0, 1)
        start += query_len
    return out
