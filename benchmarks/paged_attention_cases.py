"""Paged-attention test batches and correctness cases, shared by the kernel tests and `gpu_check.py`.

`make_batch` lays random sequences out in a paged KV cache the way the engine does (shuffled blocks, a
ragged block table padded with -1, every slot nobody owns holding NaN so that a read outside a context
poisons the output), on any device; the data is drawn on the CPU from a seeded generator, so a batch is
the same on every device. `reference_float64` recomputes attention from the dense per-sequence K/V in
float64, independently of the paged layout and of `paged_attention_reference` (which works in float32).

`CASES` is the correctness matrix of the GPU check (prefill, decode, mixed, GQA, head sizes 64 and 128,
long contexts on the split-context path, padded decode rows); `run_case` runs one case through the Triton
kernels (`out` poisoned with NaN first) and reports relative errors against the float64 reference.

Imported by tests (`tests/model/test_paged_attention_interpreter.py`, `tests/gpu/`) and by
`benchmarks/gpu_check.py`; never by `izh/`. Importing it does not import triton (izh.kernels imports it on
first use), so a caller may still set TRITON_INTERPRET afterwards.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from izh.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    write_kv_cache,
    write_kv_cache_reference,
)

# (query_len, seq_len): a fresh prefill, a chunk over a cached prefix spanning several blocks, two decodes
# (one ending exactly on a block boundary).
MIXED = [(13, 13), (9, 46), (1, 33), (1, 16)]


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, dense [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    max_query_len: int
    max_seq_len: int
    query_lens: list[int] = field(default_factory=list)


def make_batch(
    lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Random sequences (query_len, seq_len) written to shuffled (non-contiguous) cache blocks; every slot
    nobody owns holds NaN, so a kernel that reads outside a context poisons its output."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    tables, keys, values = [], [], []
    for (_, seq_len), n in zip(lens, blocks_per_seq, strict=True):
        table, order = order[:n], order[n:]
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        kv_cache[0, torch.tensor(table)[pos // block_size], pos % block_size] = k
        kv_cache[1, torch.tensor(table)[pos // block_size], pos % block_size] = v
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(blocks_per_seq) + 1  # a padded column, -1 like a ragged batch's
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens = [q for q, _ in lens]
    num_tokens = sum(query_lens)
    return PagedBatch(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device),
        kv_cache=kv_cache.to(device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32).to(
            device
        ),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        keys=keys,
        values=values,
        max_query_len=max(query_lens),
        max_seq_len=max(s for _, s in lens),
        query_lens=query_lens,
    )


def run_reference(b: PagedBatch, scale: float) -> torch.Tensor:
    """`paged_attention_reference` (float32 math, q's dtype out) on the batch."""
    return paged_attention_reference(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale)


def run_triton(
    b: PagedBatch,
    scale: float,
    q: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    return paged_attention(
        b.q if q is None else q,
        b.kv_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_tables,
        scale,
        b.max_query_len,
        b.max_seq_len,
        out,
        num_segments=num_segments,
    )


def reference_float64(b: PagedBatch, scale: float) -> torch.Tensor:
    """Causal attention in float64 from the dense per-sequence K/V (not through the cache): [num_tokens,
    num_heads, head_dim] float64 on the CPU."""
    q_all = b.q.double().cpu()
    num_heads = q_all.shape[1]
    out = torch.empty_like(q_all)
    start = 0
    for k, v, query_len in zip(b.keys, b.values, b.query_lens, strict=True):
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = num_heads // num_kv_heads
        kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, d]
        vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = q_all[start : start + query_len].transpose(0, 1)  # [heads, query_len, d]
        scores = q @ kk.transpose(1, 2) * scale
        query_pos = seq_len - query_len + torch.arange(query_len)
        visible = torch.arange(seq_len)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + query_len] = (scores.softmax(dim=-1) @ vv).transpose(0, 1)
        start += query_len
    return out


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (Frobenius, float64); inf when got has a non-finite value."""
    g = got.double().cpu()
    if not torch.isfinite(g).all():
        return math.inf
    return float((g - ref).norm() / ref.norm().clamp_min(1e-300))


def max_abs_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    g = got.double().cpu()
    if not torch.isfinite(g).all():
        return math.inf
    return float((g - ref).abs().max())


# --- the correctness matrix of the GPU check --------------------------------------------------------

# Relative error (Frobenius) the Triton output may have against float64. float32: ieee dots, exact-ish;
# bf16: the output's own rounding (~2^-9) plus P rounded to bf16 before the PV product.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    lens: tuple[tuple[int, int], ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    num_segments: int | None = None
    """Forced number of context segments (None: the kernel chooses; on CUDA long decodes split)."""
    padded_rows: int = 0
    """Extra decode rows appended as a CUDA graph pads a batch: slot -1, seq_len 1, block 0."""


def attention_cases(small: bool) -> list[AttentionCase]:
    """The matrix: `small` shrinks lengths for the Triton interpreter (a CPU dry run)."""
    s = 8 if small else 1  # length divisor
    long_ctx = 4096 // s
    return [
        AttentionCase("prefill", ((300 // s, 300 // s), (37, 37), (1, 1)), 9, 3, 64),
        AttentionCase("decode", tuple((1, n) for n in (1, 17, 300 // s, 1000 // s, 16, 64)), 9, 3, 64),
        AttentionCase("mixed", ((13, 13), (9, 46), (1, 33), (1, 16), (200 // s, 700 // s)), 32, 8, 128),
        AttentionCase("mixed-mha", ((13, 13), (9, 46), (1, 33), (64 // s, 200 // s)), 4, 4, 128),
        AttentionCase("gqa-7", ((40, 40), (1, 90), (5, 77)), 14, 2, 64, block_size=32),
        AttentionCase("split-auto", ((1, long_ctx), (1, long_ctx // 2 + 3), (1, 17)), 32, 8, 128),
        AttentionCase("split-8", ((1, long_ctx), (1, 1), (3, long_ctx // 3)), 9, 3, 64, num_segments=8),
        AttentionCase("split-16-d128", ((1, long_ctx), (1, 200)), 32, 8, 128, num_segments=16),
        AttentionCase("decode-padded", ((1, 40), (1, 129), (1, 7)), 9, 3, 64, padded_rows=5),
    ]


@dataclass
class CaseResult:
    name: str
    dtype: str
    passed: bool
    rel_error: float
    max_abs_error: float
    reference_rel_error: float
    """The float32 torch reference's own error against float64 (in the same dtype): the rounding floor."""
    tolerance: float
    seconds: float
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in vars(self).items()
        }


def _pad_decode_rows(b: PagedBatch, num_pad: int) -> PagedBatch:
    """Append `num_pad` padding decode rows as DecodeGraphRunner does: seq_len 1, block table all 0."""
    dev = b.q.device
    q = torch.cat([b.q, torch.randn(num_pad, *b.q.shape[1:], dtype=b.q.dtype).to(dev)])
    qsl = torch.cat([b.query_start_loc, b.query_start_loc[-1] + torch.arange(1, num_pad + 1, device=dev)])
    seq_lens = torch.cat([b.seq_lens, torch.ones(num_pad, dtype=b.seq_lens.dtype, device=dev)])
    tables = torch.cat(
        [b.block_tables, torch.zeros(num_pad, b.block_tables.shape[1], dtype=torch.int32, device=dev)]
    )
    return PagedBatch(
        q=q,
        kv_cache=b.kv_cache,
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        keys=b.keys,
        values=b.values,
        max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len,
        query_lens=b.query_lens + [1] * num_pad,
    )


def run_case(case: AttentionCase, dtype: torch.dtype, device: str, seed: int) -> CaseResult:
    """One attention case: fresh random inputs (seed), NaN-poisoned `out`, Triton vs float64."""
    t0 = time.perf_counter()
    b = make_batch(
        list(case.lens),
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        dtype,
        seed,
        device,
    )
    num_real = b.q.shape[0]
    run = _pad_decode_rows(b, case.padded_rows) if case.padded_rows else b
    scale = case.head_dim**-0.5
    out = torch.full_like(run.q, float("nan"))
    run_triton(run, scale, out=out, num_segments=case.num_segments)
    if device != "cpu":
        torch.cuda.synchronize()
    got = out[:num_real]
    ref64 = reference_float64(b, scale)
    rel = relative_error(got, ref64)
    ref_rel = relative_error(run_reference(b, scale), ref64)
    tol = TOLERANCE[dtype]
    detail = ""
    if not math.isfinite(rel):
        bad = (~torch.isfinite(got.float())).any(dim=(1, 2)).nonzero().flatten().tolist()
        detail = f"non-finite output rows {bad[:10]} (NaN poison left unwritten or read)"
    return CaseResult(
        name=case.name,
        dtype=str(dtype).removeprefix("torch."),
        passed=rel <= tol,
        rel_error=rel,
        max_abs_error=max_abs_error(got, ref64),
        reference_rel_error=ref_rel,
        tolerance=tol,
        seconds=time.perf_counter() - t0,
        detail=detail,
    )


def run_write_case(dtype: torch.dtype, device: str, seed: int, small: bool) -> CaseResult:
    """write_kv_cache from strided K/V views with some slots < 0 (padded rows), against the reference:
    bit-exact, and the skipped rows write nowhere."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim, heads = (8, 16, 3, 64, 9) if small else (64, 16, 8, 128, 32)
    num_tokens = 40 if small else 300
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slot_mapping = slots.to(device)
    expected = kv_cache.clone()
    write_kv_cache_reference(key, value, expected, slot_mapping)
    write_kv_cache(key, value, kv_cache, slot_mapping)
    if device != "cpu":
        torch.cuda.synchronize()
    equal = bool(torch.equal(kv_cache, expected))
    return CaseResult(
        name="write_kv_cache",
        dtype=str(dtype).removeprefix("torch."),
        passed=equal,
        rel_error=0.0 if equal else relative_error(kv_cache.double(), expected.double().cpu()),
        max_abs_error=0.0 if equal else float((kv_cache.double() - expected.double()).abs().max()),
        reference_rel_error=0.0,
        tolerance=0.0,
        seconds=time.perf_counter() - t0,
        detail="" if equal else "cache differs from write_kv_cache_reference (slots < 0 must write nowhere)",
    )
