"""Sliding-window (and soft-capped) attention on top of any attention backend, and the KV cache layout
that lets sliding-window layers free the blocks their window has left.

A sliding-window layer's query at position p sees the keys at (p - window, p]. On a CPU with izh's C
kernels the paged kernel itself takes the window and Gemma 2's score soft-cap (each token computed as a
decode at its position, so batch- and chunking-invariant). Elsewhere, while no sequence in a step is longer than the window every
key lies inside it, so the engine's own backend is exact and runs; past it, or with Gemma 2's score
soft-capping, `windowed_attention` runs the step in torch. Every path reads only the slots inside each
sequence's window, so the blocks before it may be freed. Used by Gemma 2/3 and Mistral (and Phi-3).

`KVCacheLayout` splits the layers into KV cache groups as vLLM's hybrid KV cache manager does: layers of
one kind (full attention, or one window) in groups of equal size, each group with its own block table,
the groups sharing one block pool and the same `num_tensors` cache tensors (layer i of every group uses
tensor i; a block belongs to one group at a time). The engine's KV cache manager (izh.engine.kv_cache)
frees a sliding group's blocks once they are wholly before the window, so a long sequence holds the
global layers' context plus a window's worth of blocks per sliding group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from izh.kernels.kv_cache_dtype import dequantize_kv, quantize_kv, raw_rows
from izh.model.attention import AttentionBackend, AttentionMetadata, PagedTorchAttentionBackend


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Which KV cache group (block table) and which cache tensor each layer uses."""

    windows: tuple[int | None, ...]
    """Per group, its layers' sliding window (None: full attention)."""
    layer_groups: tuple[int, ...]
    """Per layer, its group."""
    layer_tensors: tuple[int, ...]
    """Per layer, its cache tensor: its index within its group."""
    num_tensors: int
    """Cache tensors (layers per group); a block holds this many layers' K/V."""

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVCacheLayout:
        """One group of every layer, one tensor per layer (the layout of a model without mixed kinds)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def for_layers(cls, layer_windows: Sequence[int | None]) -> KVCacheLayout:
        """Groups of equal size (the smallest kind's layer count, as vLLM): full-attention layers first,
        then each window's, in layer order; a kind whose count the size does not divide ends with a
        smaller group (its missing layers' memory simply goes unused)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) <= 1:
            return cls.single(len(layer_windows), next(iter(kinds), None))
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        groups = [0] * len(layer_windows)
        tensors = [0] * len(layer_windows)
        for window in sorted(kinds, key=lambda w: -1 if w is None else w):
            layers = kinds[window]
            for start in range(0, len(layers), size):
                for index, layer in enumerate(layers[start : start + size]):
                    groups[layer], tensors[layer] = len(windows), index
                windows.append(window)
        return cls(tuple(windows), tuple(groups), tuple(tensors), size)


class WindowedBackend(AttentionBackend):
    """This layer's attention (its window, its soft-cap) over the engine's backend, reading its KV cache
    group's metadata."""

    name = "gemma_windowed"

    def __init__(self, window: int | None, softcap: float = 0.0, kv_group: int = 0) -> None:
        self.window = window
        self.softcap = softcap
        self.kv_group = kv_group
        """The layer's KV cache group (KVCacheLayout.layer_groups); used when the metadata has groups."""
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
        meta = attn_metadata.groups[self.kv_group] if attn_metadata.groups else attn_metadata
        if (
            (self.softcap or self.window is not None)
            and kv_cache is not None
            and isinstance(inner, PagedTorchAttentionBackend)
            and inner.runs_c_kernels(kv_cache, query.dtype)
        ):
            return inner.windowed(query, key, value, kv_cache, meta, scale, self.window or 0, self.softcap)
        if not self.softcap and (self.window is None or meta.max_seq_len <= self.window):
            return inner.forward(query, key, value, kv_cache, meta, scale)
        return windowed_attention(query, key, value, kv_cache, meta, scale, self.window, self.softcap)


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
        raw = raw_rows(kv_cache)  # float8 as bytes: torch's index ops take those
        key_slots = raw[0].view(rows, num_kv_heads, kv_cache.shape[4])
        value_slots = raw[1].view(rows, num_kv_heads, kv_cache.shape[4])
        key_slots.index_copy_(0, meta.slot_mapping, raw_rows(quantize_kv(key, kv_cache.dtype)))
        value_slots.index_copy_(0, meta.slot_mapping, raw_rows(quantize_kv(value, kv_cache.dtype)))
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
            k = dequantize_kv(key_slots.index_select(0, slots).view(kv_cache.dtype), head_dim, query.dtype)
            v = dequantize_kv(value_slots.index_select(0, slots).view(kv_cache.dtype), head_dim, query.dtype)
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
