"""Attention metadata (built once per step by the runner) and the attention backends (one plug point).

Shapes: a step runs a FLAT batch of `num_tokens` tokens, the new tokens of `num_seqs` sequences laid end to
end. Queries are [num_tokens, num_heads, head_dim]; keys/values [num_tokens, num_kv_heads, head_dim]. A KV
cache is one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V); slot
`s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.kernels.kv_cache_dtype import dequantize_kv, quantize_kv, raw_rows


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in their sequences and in the paged KV cache.

    Treat as immutable once built: backends cache per-step derived tensors (masks, gather indices) in
    `derived`, so that they are built once per step and not once per layer.
    """

    query_start_loc: Tensor
    """[num_seqs + 1] int32: cumulative query lengths; sequence i owns tokens [qsl[i], qsl[i+1])."""
    seq_lens: Tensor
    """[num_seqs] int32: context length AFTER this step (num_computed_tokens + num_new_tokens)."""
    slot_mapping: Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) where each new token's K/V goes."""
    block_tables: Tensor
    """[num_seqs, max_num_blocks_per_seq] int32: cache block ids of each sequence; padding must be >= 0
    or -1 (treated as block 0; never read unmasked)."""
    max_query_len: int
    max_seq_len: int
    query_lens_list: list[int] | None = None
    """Host copy of the query lengths; None derives it from query_start_loc (one device sync)."""
    seq_lens_list: list[int] | None = None
    """Host copy of seq_lens; None derives it from seq_lens (one device sync)."""
    groups: tuple[AttentionMetadata, ...] = ()
    """With several KV cache groups (a model whose sliding-window and global layers keep their blocks
    apart, izh.model.sliding_window.KVCacheLayout): per group, the metadata of its layers (the same
    queries and lengths, the group's block tables and slots); this object is then group 0's. Empty: one
    group, this one."""
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def host_query_lens(self) -> list[int]:
        if self.query_lens_list is None:
            self.query_lens_list = (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()
        return self.query_lens_list

    def host_seq_lens(self) -> list[int]:
        if self.seq_lens_list is None:
            self.seq_lens_list = self.seq_lens.tolist()
        return self.seq_lens_list

    @classmethod
    def for_prefill(cls, query_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Fresh sequences with no cached context, for the cache-less (reference) path.

        The slot mapping and (empty) block tables it carries are not meant for a bound KV cache.
        """
        if not query_lens or min(query_lens) < 1:
            raise ValueError(f"query_lens must be non-empty positive lengths, got {query_lens}")
        num_tokens = sum(query_lens)
        return cls(
            query_start_loc=_cumsum0(query_lens, device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
            block_tables=torch.zeros((len(query_lens), 0), dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(query_lens),
            query_lens_list=list(query_lens),
            seq_lens_list=list(query_lens),
        )

    @classmethod
    def from_block_tables(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build everything (slot mapping included) from host lists; the new tokens of sequence i are
        its positions [seq_lens[i] - query_lens[i], seq_lens[i])."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 1 <= qlen <= slen or len(table) * block_size < slen:
                raise ValueError(f"inconsistent sequence: query_len={qlen} seq_len={slen} blocks={table}")
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(slen - qlen, slen)
            )
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=_cumsum0(query_lens, device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )


def _cumsum0(lengths: list[int], device: torch.device | str) -> Tensor:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


class AttentionBackend(ABC):
    """The attention plug point: a torch reference, a paged torch backend, later a Triton kernel."""

    name: ClassVar[str]

    @abstractmethod
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """Causal attention of this step's queries [num_tokens, num_heads, head_dim] over each sequence's
        context; key/value are this step's [num_tokens, num_kv_heads, head_dim]. Returns
        [num_tokens, num_heads, head_dim]. Query head h uses KV head h // (num_heads // num_kv_heads)."""


class ReferenceAttentionBackend(AttentionBackend):
    """No KV cache: causal attention within each sequence of the flat batch (no earlier context).

    Deliberately plain (K/V repeated per query head, one padded causal SDPA): it is the yardstick the
    paged backend is tested against.
    """

    name = "reference"

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        _, num_heads, head_dim = query.shape
        group = num_heads // key.shape[1]
        num_seqs = attn_metadata.num_seqs
        max_len = attn_metadata.max_query_len
        pad_index = self._pad_index(attn_metadata, query.device)

        def padded(x: Tensor) -> Tensor:  # [num_tokens, h, d] -> [num_seqs, h, max_len, d]
            if pad_index is not None:
                x = x.new_zeros(num_seqs * max_len, *x.shape[1:]).index_copy_(0, pad_index, x)
            return x.reshape(num_seqs, max_len, *x.shape[1:]).transpose(1, 2)

        q = padded(query)
        k = padded(key).repeat_interleave(group, dim=1)
        v = padded(value).repeat_interleave(group, dim=1)
        # Padded keys sit after every real key of their sequence, so causality alone hides them.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out = out.transpose(1, 2).reshape(num_seqs * max_len, num_heads, head_dim)
        return out if pad_index is None else out.index_select(0, pad_index)

    @staticmethod
    def _pad_index(meta: AttentionMetadata, device: torch.device) -> Tensor | None:
        key = "reference_pad_index"
        if key not in meta.derived:
            query_lens = meta.host_query_lens()
            seq_lens = meta.host_seq_lens()
            if query_lens != seq_lens:
                raise ValueError("the reference backend needs fresh sequences (seq_len == query_len)")
            meta.derived[key] = _pad_index(query_lens, meta.max_query_len, device)
        return meta.derived[key]


def _pad_index(query_lens: list[int], max_query_len: int, device: torch.device) -> Tensor | None:
    """Row of each token in a [num_seqs * max_query_len] padded layout; None if no padding is needed."""
    if all(n == max_query_len for n in query_lens):
        return None
    rows = [i * max_query_len + j for i, n in enumerate(query_lens) for j in range(n)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


_FUSED_CPU_DTYPES = (torch.float32, torch.bfloat16)
"""The activation dtypes izh's C attention kernels take (the cache may hold any KV cache format)."""


@dataclass(slots=True)
class _SeqGroup:
    """Sequences attended in one padded SDPA call (the decodes in one group, each prefill chunk in its
    own, so that a long chunk pads neither the decodes nor another chunk to its length)."""

    tokens: slice | Tensor
    """This group's rows of the flat batch."""
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    pad_index: Tensor | None
    """Token -> row of the [num_seqs * max_query_len] padded queries; None when no padding is needed."""
    block_ids: Tensor
    """[num_seqs * num_blocks] int64: the cache blocks to gather, sequence-major."""
    num_blocks: int
    mask: Tensor | None
    """[num_seqs, 1, group * max_query_len | 1, max_seq_len] bool, True = visible; None = all visible."""
    workspace: Tensor | None = None
    """[2, num_seqs * num_blocks, block row] gathered K/V, allocated by the first layer and reused by the
    others: a fresh multi-MB buffer per layer costs more (page faults) than the gather itself."""


class PagedTorchAttentionBackend(AttentionBackend):
    """Paged KV cache on the CPU: with izh's C kernels (float32 or bfloat16 activations, a cache in any
    KV cache format), one call writes this step's K/V and attends each token from the blocks, a prefill
    token exactly as a decode at its position (`cpu_ops.paged_attention`: batch- and chunking-invariant).
    Otherwise plain torch: gather each sequence's context through its block table into a padded batch
    (dequantized there when the cache holds another format), one masked SDPA per group of sequences.

    Query heads sharing a KV head are folded into the query-length axis ([S, kv_heads, group*Lq, d]), so
    GQA needs no repeated K/V. Mixed batches (prefill chunks over cached context plus decodes) work.
    The KV cache must hold finite values everywhere (allocate it with torch.zeros): padding slots are
    gathered and masked, and 0 * NaN would still poison the result.
    """

    name = "torch_paged"

    @staticmethod
    def runs_c_kernels(kv_cache: Tensor, dtype: torch.dtype | None = None) -> bool:
        """Whether attention of `dtype` activations (None: the cache's dtype) over this cache runs izh's C
        kernels (which also take a sliding window, and every KV cache format)."""
        dtype = kv_cache.dtype if dtype is None else dtype
        return (
            kv_cache.is_cpu
            and cpu_ops.available()
            and dtype in _FUSED_CPU_DTYPES
            and kv_cache.dtype in cpu_ops.KV_TYPES
        )

    def windowed(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float = 0.0,
    ) -> Tensor:
        """As `forward` through the C kernels (`runs_c_kernels` must hold), each token attending to its
        last `window` positions only (all of them with window 0), its scores soft-capped when softcap > 0
        (Gemma 2): batch- and chunking-invariant as without either, and reading no block before the
        window (its block-table entries may be -1, blocks already freed)."""
        if attn_metadata.max_query_len == 1:
            return cpu_ops.paged_decode_attention(
                query,
                key,
                value,
                kv_cache,
                attn_metadata.slot_mapping,
                attn_metadata.block_tables,
                attn_metadata.seq_lens,
                scale,
                window,
                softcap,
            )
        row_seq, row_lens = _token_rows(attn_metadata)
        return cpu_ops.paged_attention(
            query,
            key,
            value,
            kv_cache,
            attn_metadata.slot_mapping,
            attn_metadata.block_tables,
            row_seq,
            row_lens,
            scale,
            window,
            softcap,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        if kv_cache is None:
            raise ValueError("the paged backend needs a bound KV cache")
        if self.runs_c_kernels(kv_cache, query.dtype):
            # Decodes only: one C kernel writes the new K/V and attends straight from the blocks. Prefill
            # chunks (with any decodes): every token attends as a decode at its position would, in one C
            # call, so its result depends on neither the batch nor the chunking.
            return self.windowed(query, key, value, kv_cache, attn_metadata, scale, window=0)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        group = num_heads // num_kv_heads
        block_size = kv_cache.shape[2]
        row = kv_cache.shape[4]  # head_dim, or a q8_0 row's bytes
        raw = raw_rows(kv_cache)  # float8 as bytes: torch's index ops take those
        key_cache = raw[0].view(-1, num_kv_heads * row)  # [num_slots, kv_heads * row]
        value_cache = raw[1].view(-1, num_kv_heads * row)
        # Written in the cache's format (izh.kernels.kv_cache_dtype), read back through dequantize_kv.
        key_rows = raw_rows(quantize_kv(key, kv_cache.dtype)).reshape(num_tokens, -1)
        value_rows = raw_rows(quantize_kv(value, kv_cache.dtype)).reshape(num_tokens, -1)
        key_cache.index_copy_(0, attn_metadata.slot_mapping, key_rows)
        value_cache.index_copy_(0, attn_metadata.slot_mapping, value_rows)
        key_blocks = raw[0].view(kv_cache.shape[1], -1)  # [num_blocks, block_size * kv_heads * row]
        value_blocks = raw[1].view(kv_cache.shape[1], -1)

        groups = self._groups(attn_metadata, block_size, group, query.device)
        storage = kv_cache.dtype
        if len(groups) == 1:
            return self._attend(query, key_blocks, value_blocks, groups[0], block_size, group, scale, storage)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        for g in groups:
            q = query[g.tokens] if isinstance(g.tokens, slice) else query.index_select(0, g.tokens)
            o = self._attend(q, key_blocks, value_blocks, g, block_size, group, scale, storage)
            if isinstance(g.tokens, slice):
                out[g.tokens] = o
            else:
                out.index_copy_(0, g.tokens, o)
        return out

    @staticmethod
    def _attend(
        query: Tensor,
        key_blocks: Tensor,
        value_blocks: Tensor,
        g: _SeqGroup,
        block_size: int,
        group: int,
        scale: float,
        storage: torch.dtype,
    ) -> Tensor:
        """Attention for one group: query [n, heads, d] -> [n, heads, d]; the blocks hold the cache's
        format (`storage`, float8 viewed as bytes)."""
        _, num_heads, head_dim = query.shape
        num_kv_heads = num_heads // group
        num_seqs, max_q = g.num_seqs, g.max_query_len
        if g.pad_index is not None:
            query = query.new_zeros(num_seqs * max_q, num_heads, head_dim).index_copy_(0, g.pad_index, query)
        # [S, max_q, kv_heads, group, d] -> [S, kv_heads, group * max_q, d]
        q = query.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
        ctx = g.num_blocks * block_size
        if g.workspace is None:
            g.workspace = key_blocks.new_empty(2, g.block_ids.shape[0], key_blocks.shape[1])

        def gather(blocks: Tensor, out: Tensor) -> Tensor:  # -> [S, kv_heads, max_seq_len, d]
            x = torch.index_select(blocks, 0, g.block_ids, out=out).view(num_seqs, ctx, num_kv_heads, -1)
            if storage != query.dtype:  # a cache of another format: the gathered rows as query's dtype
                x = dequantize_kv(x[:, : g.max_seq_len].view(storage), head_dim, query.dtype)
            return x[:, : g.max_seq_len].transpose(1, 2)

        key = gather(key_blocks, g.workspace[0])
        value = gather(value_blocks, g.workspace[1])
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=g.mask, scale=scale)
        out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(num_seqs * max_q, num_heads, head_dim)
        return out if g.pad_index is None else out.index_select(0, g.pad_index)

    @staticmethod
    def _groups(
        meta: AttentionMetadata, block_size: int, group: int, device: torch.device
    ) -> list[_SeqGroup]:
        key = ("torch_paged", block_size, group)
        cached = meta.derived.get(key)
        if cached is None:
            cached = _build_groups(meta, block_size, group, device)
            meta.derived[key] = cached
        return cached


def _token_rows(meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """Per token of the step: its sequence's index and the context it sees (its position + 1), int32
    (built once per step)."""
    cached = meta.derived.get("token_rows")
    if cached is None:
        query_lens = meta.host_query_lens()
        seq_lens = meta.host_seq_lens()
        seqs = torch.repeat_interleave(
            torch.arange(len(query_lens), dtype=torch.int32), torch.tensor(query_lens)
        )
        starts = torch.tensor([s - q for q, s in zip(query_lens, seq_lens, strict=True)], dtype=torch.int32)
        firsts = torch.tensor([0, *itertools.accumulate(query_lens)][:-1], dtype=torch.int32)
        lens = torch.arange(1, len(seqs) + 1, dtype=torch.int32) + (starts - firsts)[seqs.long()]
        cached = meta.derived["token_rows"] = (seqs, lens)
    return cached


def _build_groups(
    meta: AttentionMetadata, block_size: int, group: int, device: torch.device
) -> list[_SeqGroup]:
    query_lens = meta.host_query_lens()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    # One group per prefill chunk: padded to a batch-mate's length, a chunk's rows would go through
    # SDPA's kernels with another key count (AVX-512 builds of torch then sum in another order), and
    # a prompt's logprobs would depend on what it was batched with.
    prefills = [[i] for i, n in enumerate(query_lens) if n > 1]
    return [
        _build_group(meta, seqs, starts, block_size, group, device) for seqs in (decodes, *prefills) if seqs
    ]


def _build_group(
    meta: AttentionMetadata,
    seqs: list[int],
    starts: list[int],
    block_size: int,
    group: int,
    device: torch.device,
) -> _SeqGroup:
    query_lens = [meta.host_query_lens()[i] for i in seqs]
    seq_lens = [meta.host_seq_lens()[i] for i in seqs]
    max_q, max_len = max(query_lens), max(seq_lens)
    num_blocks = math.ceil(max_len / block_size)
    if num_blocks > meta.block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[1]} columns, a context of {max_len} needs {num_blocks}"
        )
    contiguous = seqs == list(range(seqs[0], seqs[-1] + 1))
    if contiguous:
        tokens: slice | Tensor = slice(starts[seqs[0]], starts[seqs[-1] + 1])
        tables = meta.block_tables[seqs[0] : seqs[-1] + 1]
    else:
        rows = [t for i in seqs for t in range(starts[i], starts[i + 1])]
        tokens = torch.tensor(rows, dtype=torch.int64, device=device)
        tables = meta.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64, device=device))
    # -1 padding (if any) becomes block 0: real memory, and masked out.
    block_ids = tables[:, :num_blocks].clamp(min=0).to(torch.int64).reshape(-1)
    return _SeqGroup(
        tokens=tokens,
        num_seqs=len(seqs),
        max_query_len=max_q,
        max_seq_len=max_len,
        pad_index=_pad_index(query_lens, max_q, device),
        block_ids=block_ids,
        num_blocks=num_blocks,
        mask=_causal_mask(query_lens, seq_lens, group, device),
    )


def _causal_mask(
    query_lens: list[int], seq_lens: list[int], group: int, device: torch.device
) -> Tensor | None:
    """Query j of sequence i sits at position seq_len - query_len + j and sees keys up to itself."""
    max_q, max_len = max(query_lens), max(seq_lens)
    if max_q == 1 and all(n == max_len for n in seq_lens):
        return None  # decodes of equal length: every gathered key is real and visible
    key_pos = torch.arange(max_len, device=device)
    first_pos = torch.tensor([s - q for q, s in zip(query_lens, seq_lens, strict=True)], device=device)
    query_pos = first_pos[:, None] + torch.arange(max_q, device=device)  # [S, max_q]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, max_q, max_len]
    # Padded query rows (j >= query_len) see real keys too, so no row is fully masked (no NaN).
    # Rows follow the folded query layout: row r = head_in_group * max_q + j.
    return mask.unsqueeze(1).repeat(1, 1, group, 1) if max_q > 1 else mask.unsqueeze(1)


class TritonPagedAttentionBackend(AttentionBackend):
    """Paged KV cache through izh.kernels' Triton kernels (CUDA; or Triton's CPU interpreter in tests).

    Graph-safe: no host syncs and no launch decision read from tensor values, so decode steps can be
    captured in CUDA graphs.
    """

    name = "triton_paged"

    def __init__(self) -> None:
        try:
            from izh.kernels import paged_attention
        except ImportError as exc:  # triton missing: say how to get it
            raise ModelLoadError(
                f"the triton_paged attention backend needs triton ({exc}); pip install 'izh[gpu]'"
            ) from exc
        self._kernels = paged_attention

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor | None,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        if kv_cache is None:
            raise ValueError("the paged backend needs a bound KV cache")
        self._kernels.write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        return self._kernels.paged_attention(
            query,
            kv_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_tables,
            scale,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
        )


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    ReferenceAttentionBackend.name: ReferenceAttentionBackend,
    PagedTorchAttentionBackend.name: PagedTorchAttentionBackend,
    TritonPagedAttentionBackend.name: TritonPagedAttentionBackend,
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend instance by name; an unknown name raises listing the supported ones."""
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ModelLoadError(
            f"unknown attention backend {name!r} (supported: {', '.join(sorted(ATTENTION_BACKENDS))})"
        ) from None
