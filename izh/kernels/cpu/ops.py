"""The entry points: each runs its C kernel when it applies, else the torch reference.

Each function has a public `*_ref` (izh.kernels.cpu.reference, .records) that defines its semantics; the
C kernel of the active variant (izh.kernels.cpu.library) is used when the library is loaded, the tensors
are on the CPU, the dtype is float32 or bfloat16 and the layout is one the kernel takes; otherwise the
call falls through to the reference, so every function works everywhere.

Each wrapper costs a few microseconds of Python (ctypes ~1 us, allocating the output ~1 us), so the checks
are kept to cheap attribute reads; anything unusual (another device or dtype, mixed dtypes, an inner
stride != 1) takes the reference.

Threads: the kernels take `torch.get_num_threads()` and stay on the calling thread when the work is
small (row kernels under 64k elements, attention under ~100 us of work; a single decode row always is):
waking a second thread costs more than it saves there, and on a busy machine it can stall. Attention runs
one (sequence, KV head) pair per work item, a sequence's KV heads handed out together (its blocks are
read by one thread). ctypes releases the GIL during a call.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from izh.kernels.cpu.library import STATE, resolve
from izh.kernels.cpu.records import q4_matmul_ref, q4_matmul_x8_ref, q8_matmul_ref, q8_matmul_x8_ref
from izh.kernels.cpu.reference import (
    add_rms_norm_ref_,
    argmax_rows_ref,
    paged_decode_attention_ref,
    rms_norm_ref,
    rotary_ref_,
    sample_rows_ref,
    silu_mul_ref,
)
from izh.kernels.kv_cache_dtype import Q8_0_BLOCK, Q8_0_BLOCK_BYTES

__all__ = [
    "KV_TYPES",
    "STACK_FIELDS",
    "STACK_GGUF",
    "STACK_LORA_FIELDS",
    "STACK_LORA_LINEAR",
    "add_rms_norm_",
    "argmax_rows",
    "bf16_cache_path",
    "decode_stack",
    "lora_add_",
    "paged_attention",
    "paged_decode_attention",
    "q4_matmul",
    "q8_matmul",
    "rms_norm",
    "rotary_",
    "sample_rows",
    "silu_mul",
    "top_p_mask_",
]

_MAX_HEAD_DIM = 512  # 32 * MAX_NC in csrc/attention.c


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm_ref(x, weight, eps)` as a new [n, hidden] tensor; x may have a row stride."""
    k = (STATE.active or resolve()).kernels.get(x.dtype)
    if (
        k is not None
        and x.is_cpu
        and weight.is_cpu
        and weight.dtype == x.dtype
        and x.dim() == 2
        and weight.dim() == 1
        and weight.is_contiguous()
    ):
        n, hidden = x.shape
        x_stride = x.stride()
        if x_stride[1] == 1 and weight.shape[0] == hidden:
            out = x.new_empty(n, hidden)  # (int args: ~0.6 us cheaper than torch.empty((n, hidden), ...))
            k.rms_norm(
                x.data_ptr(),
                x_stride[0],
                weight.data_ptr(),
                out.data_ptr(),
                n,
                hidden,
                eps,
                torch.get_num_threads(),
            )
            return out
    return rms_norm_ref(x, weight, eps)


def add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`residual += x` in place, then `rms_norm(residual, weight, eps)` as a new tensor."""
    k = (STATE.active or resolve()).kernels.get(x.dtype)
    if (
        k is not None
        and x.is_cpu
        and residual.is_cpu
        and weight.is_cpu
        and residual.dtype == x.dtype
        and weight.dtype == x.dtype
        and x.dim() == 2
        and weight.dim() == 1
        and x.is_contiguous()
        and residual.is_contiguous()
        and weight.is_contiguous()
    ):
        n, hidden = x.shape
        if residual.shape == x.shape and weight.shape[0] == hidden:
            out = x.new_empty(n, hidden)
            k.add_rms_norm(
                x.data_ptr(),
                residual.data_ptr(),
                weight.data_ptr(),
                out.data_ptr(),
                n,
                hidden,
                eps,
                torch.get_num_threads(),
            )
            return out
    return add_rms_norm_ref_(x, residual, weight, eps)


def rotary_(x: Tensor, cos_sin: Tensor) -> None:
    """`rotary_ref_(x, cos_sin)`: in-place rotate-half RoPE on x [n, heads, head_dim], any token and head
    stride (element stride 1); cos_sin [n, head_dim] = [cos | sin]."""
    k = (STATE.active or resolve()).kernels.get(x.dtype)
    if (
        k is not None
        and x.is_cpu
        and cos_sin.is_cpu
        and cos_sin.dtype == x.dtype
        and x.dim() == 3
        and cos_sin.is_contiguous()
    ):
        n, heads, head_dim = x.shape
        x_stride = x.stride()
        if x_stride[2] == 1 and head_dim % 2 == 0 and cos_sin.shape == (n, head_dim):
            k.rotary(
                x.data_ptr(),
                x_stride[0],
                x_stride[1],
                cos_sin.data_ptr(),
                n,
                heads,
                head_dim,
                torch.get_num_threads(),
            )
            return
    rotary_ref_(x, cos_sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """`silu_mul_ref(gate_up)`: [n, 2 * I] -> new [n, I]."""
    k = (STATE.active or resolve()).kernels.get(gate_up.dtype)
    if k is not None and gate_up.is_cpu and gate_up.dim() == 2:
        n, width = gate_up.shape
        stride = gate_up.stride()
        if stride[1] == 1 and width % 2 == 0:
            out = gate_up.new_empty(n, width // 2)
            k.silu_mul(gate_up.data_ptr(), stride[0], out.data_ptr(), n, width // 2, torch.get_num_threads())
            return out
    return silu_mul_ref(gate_up)


ATTENTION_ERRORS = {
    -1: "slot_mapping points past the end of the cache",
    -2: "a seq_len is negative or longer than its block table covers",
    -3: "a block table entry is outside the cache",
    -4: "out of memory for the attention scratch",
    -5: "a row's sequence index is outside the block table",
    -6: "the KV cache's format cannot hold this head size",
}

KV_TYPES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.uint8: 5,
}
"""The C kernels' kv_type of a KV cache tensor, by its dtype (the KV_* enum in csrc/common.h; uint8:
q8_0 blocks, izh.kernels.kv_cache_dtype)."""


def paged_decode_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """`paged_decode_attention_ref(...)`: write each sequence's new K/V into the cache, then attend (with
    window > 0, to the last `window` positions only: a sliding window; block-table entries before it are
    never read and may be -1; with softcap > 0, each score s becomes softcap * tanh(s / softcap)).

    query [n, H, d], key/value [n, KVH, d] (views with any token and head stride, element stride 1);
    kv_cache contiguous [2, num_blocks, block_size, KVH, d]; slot_mapping int64 [n] (slots < 0 skipped);
    block_tables int32 [n, max_blocks]; seq_lens int32 [n] (other integer dtypes are converted). Returns a
    new contiguous [n, H, d]. Raises IndexError, before writing anything, when an index points outside
    the cache or the block table.

    The cache may hold another format than the activations (`izh.kernels.kv_cache_dtype`: float32,
    bfloat16, float16, float8 e4m3fn / e5m2, or q8_0 blocks as uint8 [..., d / 32 * 34]): the new K/V are
    converted as they are written, and the kernel converts each cached row as it reads it.
    """
    return _paged_attention(
        query, key, value, kv_cache, slot_mapping, block_tables, None, seq_lens, scale, window, softcap
    )


BF16_CACHE_PATHS = ("float32", "dpbf16", "tiles")


def bf16_cache_path(head_dim: int, group: int) -> str:
    """Which kernel attention over a bfloat16 cache under float32 activations takes here: "tiles" (AMX-BF16:
    the amx variant, on a CPU whose tiles Linux lets this process use), "dpbf16" (AVX512-BF16's vdpbf16ps:
    the avx512 variant, or the amx one where Linux grants no tiles) or "float32" (the rows converted to
    float32: AVX2, NEON, the generic C, and head sizes not a multiple of 32 or over 16 query heads per KV
    head). The first two round q and the softmax weights to bfloat16 (as llama.cpp rounds q to its cache's
    type) and read bfloat16 subnormals in the cache as zero; every path gives each token the same result in
    any batch, chunking, or as a decode."""
    lib = STATE.active or resolve()
    if lib.handle is None:
        return "float32"
    fn = lib.handle.izh_attention_bf16_path
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int64, ctypes.c_int64]
    return BF16_CACHE_PATHS[fn(head_dim, group)]


def paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    row_seq: Tensor,
    row_lens: Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Attention for any rows (prefill chunks, decodes, mixed): write every row's K/V into the cache, then
    row i attends to positions 0 .. row_lens[i] - 1 of sequence row_seq[i] (block table
    block_tables[row_seq[i]]; a prefill token's length is its position + 1).

    The C kernel computes each row exactly as `paged_decode_attention` computes a decode at that length,
    so a token's attention is bit-identical whatever the batch, the chunking, or decode against prefill.
    row_seq / row_lens int32 [n]; the rest (window and softcap included) as `paged_decode_attention`. The reference is
    `paged_decode_attention_ref` over block_tables[row_seq]."""
    return _paged_attention(
        query, key, value, kv_cache, slot_mapping, block_tables, row_seq, row_lens, scale, window, softcap
    )


def _paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    row_seq: Tensor | None,
    seq_lens: Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> Tensor:
    dtype = query.dtype
    k = (STATE.active or resolve()).kernels.get(dtype)

    def reference() -> Tensor:
        tables = block_tables if row_seq is None else block_tables.index_select(0, row_seq.long())
        return paged_decode_attention_ref(
            query, key, value, kv_cache, slot_mapping, tables, seq_lens, scale, window, softcap
        )

    kv_type = KV_TYPES.get(kv_cache.dtype)
    if not (
        k is not None
        and key.dtype == dtype
        and value.dtype == dtype
        and kv_type is not None
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and kv_cache.is_cpu
        and slot_mapping.is_cpu
        and block_tables.is_cpu
        and seq_lens.is_cpu
        and (row_seq is None or row_seq.is_cpu)
        and query.dim() == 3
        and key.dim() == 3
        and value.dim() == 3
        and kv_cache.dim() == 5
        and block_tables.dim() == 2
        and kv_cache.is_contiguous()
    ):
        return reference()
    n, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, cache_dim = kv_cache.shape
    q_stride, k_stride, v_stride = query.stride(), key.stride(), value.stride()
    if q_stride[2] != 1 or k_stride[2] != 1 or v_stride[2] != 1 or head_dim > _MAX_HEAD_DIM:
        return reference()
    kv_shape = (n, num_kv_heads, head_dim)
    if kv_type == KV_TYPES[torch.uint8] and head_dim % Q8_0_BLOCK:
        return reference()
    row_size = head_dim // Q8_0_BLOCK * Q8_0_BLOCK_BYTES if kv_type == KV_TYPES[torch.uint8] else head_dim
    if (
        cache_dim != row_size
        or num_heads % num_kv_heads
        or key.shape != kv_shape
        or value.shape != kv_shape
        or slot_mapping.shape != (n,)
        or seq_lens.shape != (n,)
        or (row_seq is None and block_tables.shape[0] != n)
        or (row_seq is not None and row_seq.shape != (n,))
    ):
        shapes = {
            "query": query,
            "key": key,
            "value": value,
            "kv_cache": kv_cache,
            "slot_mapping": slot_mapping,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
        }
        if row_seq is not None:
            shapes["row_seq"] = row_seq
        listed = ", ".join(f"{name} {tuple(t.shape)}" for name, t in shapes.items())
        raise ValueError(f"paged attention: shapes do not match: {listed}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        block_tables = block_tables.to(torch.int32).contiguous()
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    if row_seq is not None and (row_seq.dtype != torch.int32 or not row_seq.is_contiguous()):
        row_seq = row_seq.to(torch.int32).contiguous()
    out = query.new_empty(n, num_heads, head_dim)
    common = (
        query.data_ptr(),
        q_stride[0],
        q_stride[1],
        key.data_ptr(),
        k_stride[0],
        k_stride[1],
        value.data_ptr(),
        v_stride[0],
        v_stride[1],
        kv_cache.data_ptr(),
        kv_type,
        num_blocks,
        block_size,
        num_kv_heads,
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
    )
    tail = (
        seq_lens.data_ptr(),
        window,
        softcap,
        out.data_ptr(),
        n,
        num_heads,
        head_dim,
        scale,
        torch.get_num_threads(),
    )
    if row_seq is None:
        rc = k.paged_decode_attention(*common, *tail)
    else:
        rc = k.paged_attention(*common, row_seq.data_ptr(), block_tables.shape[0], *tail)
    if rc != 0:
        raise IndexError(f"paged attention: {ATTENTION_ERRORS.get(rc, f'error {rc}')}")
    return out


# --- weight-only quantized matmuls (1..qgemm_max_rows() rows; records: izh.kernels.cpu.records) ----


def _record_kernel_call(
    fn: Any, x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None, max_rows: int, bf16: bool
) -> Tensor | None:
    """Run record kernel `fn` when it takes these tensors (None otherwise): x [1..max_rows, K] on the CPU
    with unit inner stride; out None (a new [M, N] in x's dtype) or a [>= M, N] tensor with unit inner
    stride, float32 (or bfloat16 for the bfloat16 kernels, which are told the output dtype: `bf16`).

    Kept lean (~5 us with the ctypes call): it runs once per linear in steps that do not take the fused
    stack."""
    if x.dim() != 2 or not x.is_cpu:
        return None
    m, x_cols = x.shape
    x_strides = x.stride()
    if m < 1 or m > max_rows or x_cols != k or x_strides[1] != 1:
        return None
    result = out
    if out is None:
        out = result = x.new_empty(m, n)
    elif not (
        out.is_cpu
        and (out.dtype == torch.float32 or (bf16 and out.dtype == torch.bfloat16))
        and out.dim() == 2
        and out.shape[0] >= m
        and out.shape[1] == n
        and out.stride(1) == 1
    ):
        return None
    elif out.shape[0] != m:
        result = out[:m]
    args = [x.data_ptr(), x_strides[0], records.data_ptr(), m, n, k, out.data_ptr(), out.stride(0)]
    if bf16:
        args.append(out.dtype == torch.float32)
    rc = fn(*args, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"quantized matmul failed (code {rc}) for x {tuple(x.shape)}, weight ({n}, {k})")
    return result


def _record_matmul(which: int, x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None) -> Tensor:
    """`q4_matmul` (which 0) / `q8_matmul` (1): the active library's kernel for x's dtype when it takes
    the call, else that dtype's reference (written into out[:M] when out is given)."""
    lib = STATE.active or resolve()
    f32 = x.dtype == torch.float32
    if f32:  # any number of rows
        fns, max_rows = lib.records_f32, 1 << 62
    else:
        fns, max_rows = (lib.qgemm if x.dtype == torch.bfloat16 else ()), lib.qgemm_max_rows
    got = _record_kernel_call(fns[which], x, records, n, k, out, max_rows, bf16=not f32) if fns else None
    if got is not None:
        return got
    if f32:
        y = (q4_matmul_x8_ref, q8_matmul_x8_ref)[which](x, records, n, k)
    else:
        y = (q4_matmul_ref, q8_matmul_ref)[which](x, records, n, k, out.dtype if out is not None else None)
    return y if out is None else out[: y.shape[0]].copy_(y)


def q4_matmul(x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ the int4 records' weight^T (records: `pack_q4`'s, contiguous).

    bfloat16 x [M <= qgemm_max_rows(), K]: `q4_matmul_ref(x, ..., bf16_weights=qgemm_uses_amx(4, M))`, a
    new bf16 [M, N] or written into out[:M] (float32 or bfloat16, e.g. a logits buffer) and returned.
    float32 x, any M: `q4_matmul_x8_ref` (activations in int8 per group of 32), a new float32 [M, N] or
    into a float32 out[:M]. Other inputs get the reference of their dtype."""
    return _record_matmul(0, x, records, n, k, out)


def q8_matmul(x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None = None) -> Tensor:
    """As `q4_matmul`, for `pack_q8` records (AMX from `qgemm_uses_amx(8, M)`; `q8_matmul_x8_ref` for
    float32 x)."""
    return _record_matmul(1, x, records, n, k, out)


# --- the fused decode stack -----------------------------------------------------------------------------

STACK_FIELDS = 15
"""int64 fields per layer in `decode_stack`'s table (the STACK_* enum in csrc/common.h)."""

STACK_GGUF = 1
"""A linear's kind in the float32 stack's table when its rows are GGUF blocks: its first field points at
int64 [1 + 4 * parts], the number of parts, then (ggml type, blocks, row bytes, rows) per part."""

STACK_LORA_LINEAR = 7
"""int64 fields per linear in `decode_stack`'s LoRA table: A, Bt, n, the n + 1 shard bounds padded to 4
(the STACK_LORA_* enum in csrc/common.h)."""

STACK_LORA_FIELDS = 4 * STACK_LORA_LINEAR
"""int64 fields per layer in the LoRA table (qkv, o, gate_up, down)."""


def decode_stack(
    table: Tensor,
    dims: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    x: Tensor,
    final_norm: Tensor,
    cos_sin: Tensor,
    kv_geometry: tuple[int, int, int],
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    lora: tuple[Tensor, int, Tensor, Tensor] | None = None,
) -> Tensor:
    """Every decoder layer plus the final norm for M single-token decodes, in one C call: M <=
    qgemm_max_rows() in bfloat16 (callable when `qgemm_available()`), any M in float32 (when
    `records_f32_available()`), x's dtype deciding.

    table: int64 [layers, STACK_FIELDS] (`izh.model.fused_stack` builds it); dims: (hidden, heads, kv heads,
    head_dim, intermediate); x: [M, hidden] embeddings, overwritten (it carries the residual stream);
    cos_sin [M, head_dim]; kv_geometry: (num_blocks, block_size, kv type: `KV_TYPES` of the caches' dtype,
    one for every layer); slot_mapping int64 [M], block_tables
    int32 [M, max_blocks], seq_lens int32 [M]. lora: None, or (table int64 [layers, STACK_LORA_FIELDS],
    the slots' rank R, row_slots int32 [M] (-1: the base model), slot_ranks int32 [slots]): each record
    matmul is followed by the LoRA deltas of its adapter rows (csrc/lora.c; the table's A and Bt are x's
    dtype). Returns the final-normed hidden states [M, hidden]. Raises IndexError for an index outside the
    cache (nothing written).
    """
    hidden, heads, kv_heads, head_dim, inter = dims
    m = x.shape[0]
    out = x.new_empty(m, hidden)
    lib = STATE.active or resolve()
    stack = lib.records_f32[2] if x.dtype == torch.float32 else lib.qgemm[2]
    rc = stack(
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
        x.data_ptr(),
        final_norm.data_ptr(),
        out.data_ptr(),
        cos_sin.data_ptr(),
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        kv_geometry[0],
        kv_geometry[1],
        kv_geometry[2],
        None if lora is None else lora[0].data_ptr(),
        0 if lora is None else lora[1],
        None if lora is None else lora[2].data_ptr(),
        None if lora is None else lora[3].data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        if rc in ATTENTION_ERRORS and rc not in (-4, -5):
            raise IndexError(f"decode_stack: {ATTENTION_ERRORS[rc]}")
        reasons = {-4: "out of memory", -5: "too many rows", -6: "a matmul refused its shape"}
        raise RuntimeError(f"decode_stack failed: {reasons.get(rc, f'code {rc}')}")
    return out


def lora_add_(
    x: Tensor, out: Tensor, linear: Tensor, rank: int, row_slots: Tensor, slot_ranks: Tensor
) -> bool:
    """out [M, N] += each row's LoRA delta through the C kernel the fused decode stack calls after its
    matmuls (csrc/lora.c), so that a prefill or mixed step adds exactly the stack's deltas: x [M, K] and
    out float32, contiguous, on the CPU; linear int64 [STACK_LORA_LINEAR] (A, Bt, n, the n + 1 shard
    bounds padded to 4; A and Bt float32 [slots, n * rank, K | N]); row_slots int32 [M] (-1: the base
    model); slot_ranks int32 [slots]. Returns False, touching nothing, when the kernel does not apply."""
    fn = (STATE.active or resolve()).lora_f32
    if not (
        fn is not None
        and x.dtype == torch.float32
        and out.dtype == torch.float32
        and x.is_cpu
        and out.is_cpu
        and x.dim() == 2
        and out.dim() == 2
        and x.is_contiguous()
        and out.is_contiguous()
        and x.shape[0] == out.shape[0] == row_slots.shape[0]
        and row_slots.dtype == torch.int32
        and slot_ranks.dtype == torch.int32
        and row_slots.is_contiguous()
        and slot_ranks.is_contiguous()
    ):
        return False
    m, k = x.shape
    rc = fn(
        x.data_ptr(),
        m,
        k,
        out.data_ptr(),
        out.shape[1],
        linear.data_ptr(),
        rank,
        row_slots.data_ptr(),
        slot_ranks.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("lora_add_: out of memory")
    return True


# --- greedy and random rows -------------------------------------------------------------------------------


def _sampling_kernels(logits: Tensor, per_row: Tensor | None = None) -> tuple[Any, ...] | None:
    """The C sampling kernels when they take these rows: logits float32 [rows, n > 0] on the CPU with
    unit inner stride, and `per_row` (a uniform or top_p vector, any dtype the caller checked) a
    contiguous CPU [rows]; else None (the caller uses torch)."""
    fns = (STATE.active or resolve()).sampling
    if not (
        fns
        and logits.dtype == torch.float32
        and logits.is_cpu
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.shape[1] > 0
    ):
        return None
    if per_row is not None and not (
        per_row.is_cpu and per_row.is_contiguous() and per_row.shape == (logits.shape[0],)
    ):
        return None
    return fns


def argmax_rows(x: Tensor) -> Tensor:
    """`argmax_rows_ref(x)`: one C pass over float32 CPU rows (rows in parallel), else torch."""
    fns = _sampling_kernels(x)
    if fns is None:
        return argmax_rows_ref(x)
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    fns[0](x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), torch.get_num_threads())
    return out


def sample_rows(logits: Tensor, uniform: Tensor) -> Tensor:
    """`sample_rows_ref(logits, uniform)` in one C pass per row for float32 CPU rows (rows in parallel):
    softmax's exps are summed in float64 by chunks, and no probability tensor is built (at 32 x 49k:
    0.7 ms against 1.9 ms). The same distribution; a draw within rounding of a token boundary may pick
    the neighbouring token."""
    fns = _sampling_kernels(logits, uniform) if uniform.dtype == torch.float64 else None
    if fns is not None:
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        rc = fns[1](
            logits.data_ptr(),
            logits.stride(0),
            rows,
            n,
            uniform.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 0:
            return out
    return sample_rows_ref(logits, uniform)


def top_p_mask_(logits: Tensor, top_p: Tensor) -> Tensor | None:
    """Top-p in place on float32 CPU rows (rows with top_p >= 1 untouched): every token outside the
    nucleus becomes -inf. The nucleus is `izh.engine.sampler._apply_top_p_sorted`'s (descending
    probability, ties by token id, kept while the mass before a token is < top_p), with float64
    probabilities. Returns logits, or None when the C kernel does not apply (the caller uses torch)."""
    fns = _sampling_kernels(logits, top_p) if top_p.dtype == torch.float32 else None
    if fns is None:
        return None
    rows, n = logits.shape
    rc = fns[2](logits.data_ptr(), logits.stride(0), rows, n, top_p.data_ptr(), torch.get_num_threads())
    return logits if rc == 0 else None
