"""Paged attention over the engine's KV cache, as Triton kernels, with the torch reference that defines them.

Layout (shared with `izh.model.attention`): one cache tensor per layer,
`kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V); slot `s` is block
`s // block_size`, offset `s % block_size`. One call attends a FLAT batch of queries
`q: [num_tokens, num_heads, head_dim]`, the new tokens of `num_seqs` sequences laid end to end, whose K/V
are already in the cache. Sequence i owns tokens `[query_start_loc[i], query_start_loc[i + 1])`; its
context is `seq_lens[i]` tokens long, this step's included, so query j sits at position
`seq_lens[i] - query_len_i + j` and attends causally to keys `0..position`. Query head h reads KV head
`h // (num_heads // num_kv_heads)` (GQA). Prefill chunks over a cached prefix and single-token decodes
mix freely in one call.

The attention kernel is "unified": one program per (block of query tokens of one sequence, KV head),
walking that sequence's context in key tiles through its block table with an online softmax in fp32.
The program-to-sequence map is a binary search over `query_start_loc`, so the launch grid depends only on
`num_tokens` and `num_seqs`, never on tensor values: the call needs no host sync and can be captured in a
CUDA graph. When there are too few programs to fill the GPU (small decode batches over long contexts) the
context is split across several programs ("segments") and a second kernel merges their partial softmaxes.

`write_kv_cache` is the write half of the same layout: one fused launch for K and V that takes strided
inputs (no `.contiguous()` copy of a sliced qkv) and skips slots < 0, which a padded CUDA-graph batch
uses for rows that must write nowhere. `torch.index_copy_` would need two launches plus copies and
cannot skip rows.

Triton is an optional extra and `TRITON_INTERPRET` must be set before it is first imported, so it is
imported only inside `_kernels()`; importing this module (and the references) never needs it.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from izh.kernels.kv_cache_dtype import dequantize_kv, quantize_kv

# Decode blocks: a query row per head of the KV group, so BLOCK_M only needs to cover the group; the tile
# is short because a single query row gets little reuse out of a long one.
_DECODE_BLOCK_M = 16
_DECODE_TILE_N = 32
# Prefill blocks: many query rows share every K/V tile loaded.
_PREFILL_BLOCK_M = 64
_PREFILL_TILE_N = 64
# Split the context only when the unsplit grid leaves SMs idle and each segment still gets several tiles.
_MAX_SEGMENTS = 16
_MIN_TILES_PER_SEGMENT = 4


def is_available() -> bool:
    """True when CUDA is present and triton can be imported (the kernels can run for real)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# --- references -------------------------------------------------------------------------------------


def paged_attention_reference(
    q: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """The semantics of `paged_attention`, in plain fp32 torch, one sequence at a time.

    Returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[i, positions // block_size].long()
        head_dim = q.shape[2]
        k = dequantize_kv(kv_cache[0, blocks, positions % block_size], head_dim)  # [seq_len, kv_heads, d]
        v = dequantize_kv(kv_cache[1, blocks, positions % block_size], head_dim)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[start:end].float().transpose(0, 1)  # [heads, query_len, d]
        scores = query @ k.transpose(1, 2) * scale  # [heads, query_len, seq_len]
        query_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        visible = positions[None, :] <= query_pos[:, None]  # [query_len, seq_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def write_kv_cache_reference(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """The semantics of `write_kv_cache`: token t's K/V go to slot `slot_mapping[t]`; slots < 0 are skipped.
    A cache in another format than key's (izh.kernels.kv_cache_dtype) gets them converted (`quantize_kv`)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_cache[0, slots // block_size, slots % block_size] = quantize_kv(key[keep], kv_cache.dtype)
    kv_cache[1, slots // block_size, slots % block_size] = quantize_kv(value[keep], kv_cache.dtype)


# --- Triton entry points ----------------------------------------------------------------------------


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write this step's key/value [num_tokens, num_kv_heads, head_dim] into their cache slots (Triton).

    Slots < 0 are skipped. key/value may be strided views; only their last dim must be contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} do not describe the same tokens"
        )
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _kernels().write_kv_cache[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P=_next_pow2(num_kv_heads),
        HEAD_DIM_P=_next_pow2(head_dim),
    )


def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: Tensor | None = None,
    *,
    num_segments: int | None = None,
) -> Tensor:
    """Causal attention of a flat batch of queries over their paged contexts (Triton); see the module doc.

    q: [num_tokens, num_heads, head_dim]; query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs];
    block_tables: [num_seqs, max_blocks_per_seq] (int32 or int64). Returns `out` (allocated when None),
    [num_tokens, num_heads, head_dim] in q's dtype. `max_query_len` picks the block shapes and
    `max_seq_len` (an upper bound is fine) whether to split long contexts; neither bounds any loop, so a
    CUDA graph captured with bounds stays correct for any batch within them. `num_segments` forces the
    number of context segments per program (a power of two; 1 = no split); None chooses.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the KV cache is {kv_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc, seq_lens and block_tables disagree on the number of sequences")
    if out is None:
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim")
    if num_tokens == 0:
        return out
    q = _last_dim_contiguous(q)
    group = num_heads // num_kv_heads
    head_dim_p = max(16, _next_pow2(head_dim))  # tl.dot needs every dim >= 16
    block_m, tile_n = _block_shape(max_query_len, group, head_dim_p * q.element_size())
    block_q = block_m // group  # query tokens per program; the rows are (token, head-in-group) pairs
    # Sequence i's query blocks start at program query_start_loc[i] // block_q + i; this bounds them all.
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_segments is None:
        # A decode batch has exactly one live query block per sequence; the grid's bound overcounts it.
        live_q_blocks = num_seqs if max_query_len <= 1 else num_q_blocks
        num_segments = _choose_segments(q.device, live_q_blocks * num_kv_heads, max_seq_len, tile_n)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two >= 1, got {num_segments}")

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if num_segments > 1:
        # Partial (unnormalised) outputs, running maxima (log2 domain) and sums of each segment.
        part_acc = q.new_empty((num_tokens, num_heads, num_segments, head_dim_p), dtype=torch.float32)
        part_max = q.new_empty((num_tokens, num_heads, num_segments), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: NUM_SEGMENTS == 1 writes `out` directly
    kernels = _kernels()
    kernels.paged_attention[(num_q_blocks, num_kv_heads, num_segments)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        part_acc,
        part_max,
        part_sum,
        scale * _LOG2_E,
        num_seqs,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        # fp32 inputs must not be rounded to tf32 inside tl.dot: the reference is exact fp32.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if num_segments > 1:
        kernels.merge_segments[(num_tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SEGMENTS=num_segments,
        )
    return out


_LOG2_E = 1.4426950408889634  # the kernel works in base 2: exp(x) = exp2(x * log2(e))


def _block_shape(max_query_len: int, group: int, row_bytes: int) -> tuple[int, int]:
    """(BLOCK_M query rows, TILE_N keys) per program step. Prefill halves both for wide rows (fp32 or
    head_dim 256) so that the pipelined K/V tiles stay within ~100 KB of shared memory (sm_86/89)."""
    if max_query_len <= 1:
        block_m, tile_n = _DECODE_BLOCK_M, _DECODE_TILE_N
    elif row_bytes > 256:
        block_m, tile_n = _PREFILL_BLOCK_M // 2, _PREFILL_TILE_N // 2
    else:
        block_m, tile_n = _PREFILL_BLOCK_M, _PREFILL_TILE_N
    return max(block_m, _next_pow2(group)), tile_n


def _choose_segments(device: torch.device, num_programs: int, max_seq_len: int, tile_n: int) -> int:
    """How many segments to split each context into: enough programs to cover the SMs twice over, but
    never so many that a segment gets fewer than a few tiles (the merge would cost more than it saves)."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device)
    by_occupancy = math.ceil(2 * num_sms / max(num_programs, 1))
    by_length = math.ceil(max_seq_len / tile_n) // _MIN_TILES_PER_SEGMENT
    wanted = min(by_occupancy, by_length, _MAX_SEGMENTS)
    return 1 << (max(wanted, 1).bit_length() - 1)  # the power of two at or below


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_cache(kv_cache: Tensor, num_kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {kv_cache.shape}"
        )
    if kv_cache.shape[3:] != (num_kv_heads, head_dim) or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not hold {num_kv_heads} KV heads of {head_dim} "
            "contiguous values"
        )


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# --- kernels ----------------------------------------------------------------------------------------

# Bound by `_kernels()` on first use, never at import: triton is an optional extra and TRITON_INTERPRET must
# be set before it is imported. The kernels are module-level functions because both the compiler and the
# interpreter resolve the names a kernel uses (`tl`) in its module's globals.
triton: Any = None
tl: Any = None


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and compile-wrap the kernels, once (the first call fixes the interpreter choice)."""
    global triton, tl
    import triton as triton_module
    import triton.language as triton_language

    triton, tl = triton_module, triton_language
    return SimpleNamespace(
        paged_attention=triton.jit(_paged_attention_kernel),
        merge_segments=triton.jit(_merge_segments_kernel),
        write_kv_cache=triton.jit(_write_kv_cache_kernel),
    )


def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    num_seqs,
    num_heads,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    block_size,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (query block, KV head, segment): online-softmax attention of BLOCK_Q query tokens x GROUP
    heads over one segment of their sequence's context."""
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    # Binary search: the last sequence whose first query block (query_start_loc[i] // BLOCK_Q + i) is at
    # or before this program's.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # a spare program of the grid's upper bound
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step

    # Row m of the block is query token m // GROUP of the block, query head m % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]
    q_pos = context_len + q_idx  # absolute position of each row's query

    # Keys at or before the block's last query; this program's segment takes a share of their tiles.
    key_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(key_end, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + offs_n
        key_ok = key_pos < key_end
        block_id = tl.load(block_table + key_pos // block_size, mask=key_ok, other=0).to(tl.int64)
        kv_offs = block_id * stride_cache_block + (key_pos % block_size) * stride_cache_slot
        kv_offs += kv_head * stride_cache_head  # [TILE_N]
        # Masked loads read zeros, so stale or NaN cache slots never reach the matmul.
        k = tl.load(
            k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=key_ok[None, :] & d_ok[:, None], other=0.0
        )  # [HEAD_DIM_P, TILE_N]
        v = tl.load(
            v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0
        )  # [TILE_N, HEAD_DIM_P]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        s = tl.where((key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; shifting by 0 makes exp2 give 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        # Every real row saw key 0, so l_i > 0 there; padding rows are masked out of the store.
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offs = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Empty segments store (-inf, 0, 0), which the merge weighs to nothing.
        part = (token * num_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])


def _merge_segments_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_heads,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Program (token, head): merge the segments' partial softmaxes into the normalised output row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)  # [NUM_SEGMENTS]
    offs_d = tl.arange(0, HEAD_DIM_P)
    m = tl.load(part_max_ptr + part)
    weight = tl.math.exp2(m - tl.max(m, 0))  # the max is finite: the segment holding key 0 saw it
    total = tl.sum(tl.load(part_sum_ptr + part) * weight, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :])  # [NUM_SEGMENTS, HEAD_DIM_P]
    o = tl.sum(acc * weight[:, None], 0) / total
    out_offs = token * stride_out_token + head * stride_out_head + offs_d
    tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    """Program (token): copy its K and V rows into its cache slot, unless the slot is < 0."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding row: writes nowhere
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    cache_offs = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
    cache_offs = cache_offs + offs_h[:, None] * stride_cache_head + offs_d[None, :]  # [HEADS_P, HEAD_DIM_P]
    k_offs = token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :]
    k = tl.load(key_ptr + k_offs, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_offs = token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :]
    v = tl.load(value_ptr + v_offs, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
