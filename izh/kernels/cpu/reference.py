"""The torch references that define the CPU kernels' semantics (each `*_ref` is plain torch).

Rounding follows the references op for op: every elementwise op of a reference rounds its fp32 result to
bf16 (round to nearest even, as `c10::BFloat16`), and the C code rounds at the same points. `rotary_`,
`rms_norm` and `add_rms_norm_` are bit-identical to their references in both dtypes: RMSNorm's row sum
adds in the order of torch's CPU sum kernel (the `SumKernel.cpp` cascade: 8-lane vectors, 4 accumulators,
4 levels; stable across torch releases, checked by the tests; torch may split a single row longer than
32k elements across threads, which this does not copy). `silu_mul` uses a polynomial `exp` (torch uses
Sleef's), so an element may rarely differ by one ulp; `paged_decode_attention` works in fp32 with its own
summation order and rounds once at the end (bf16 scores come from vdpbf16ps where the variant has it:
exact products, fp32 sums).

The record matmuls' references (`q4_matmul_ref`, `q8_matmul_ref`) live with the record format in
izh.kernels.cpu.records.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from izh.kernels.kv_cache_dtype import dequantize_kv

__all__ = [
    "add_rms_norm_ref_",
    "argmax_rows_ref",
    "inverse_cdf_ref",
    "paged_decode_attention_ref",
    "rms_norm_ref",
    "rotary_ref_",
    "sample_rows_ref",
    "silu_mul_ref",
]


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim. float32: `F.rms_norm` with the weight. Other dtypes: normalise in fp32,
    round to the dtype, then multiply by the weight in the dtype (one more rounding)."""
    hidden = x.shape[-1]
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (hidden,), weight, eps)
    return F.rms_norm(x.float(), (hidden,), None, eps).to(x.dtype) * weight


def add_rms_norm_ref_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`residual += x` in place (rounded to the dtype), then `rms_norm_ref(residual)` as a new tensor."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


def rotary_ref_(x: Tensor, cos_sin: Tensor) -> None:
    """Rotate-half RoPE in place. x: [n, heads, head_dim] (any strides); cos_sin: [n, head_dim], cos in the
    first half, sin in the second."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x1 = x[..., :half]
    x2 = x[..., half:]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """`silu(gate) * up` for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def paged_decode_attention_ref(
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
    """Single-token decode attention over a paged KV cache, one sequence at a time in fp32.

    query [n, H, d], key/value [n, KVH, d]: sequence i's new token. kv_cache [2, blocks, block_size, KVH, d].
    Writes key[i]/value[i] to slot `slot_mapping[i]` (slots < 0 are skipped), then sequence i attends to
    positions 0..seq_lens[i]-1 (the new one included), position p at block `block_tables[i, p //
    block_size]`, offset `p % block_size`; query head h reads KV head `h // (H // KVH)`. Returns a new
    contiguous [n, H, d] in query's dtype. A cache in another format (izh.kernels.kv_cache_dtype) is
    written through `quantize_kv` and read through `dequantize_kv`. With window > 0 sequence i attends to its last `window`
    positions only (a sliding window: the block-table entries before them are never read); with softcap
    > 0 each score s becomes softcap * tanh(s / softcap).
    """
    # The general paged-attention semantics (izh.kernels.paged_attention), with one query per sequence.
    from izh.kernels.paged_attention import paged_attention_reference, write_kv_cache_reference

    write_kv_cache_reference(key, value, kv_cache, slot_mapping)
    if window > 0 or softcap > 0:
        return _windowed_decode_ref(query, kv_cache, block_tables, seq_lens, scale, window, softcap)
    query_start_loc = torch.arange(query.shape[0] + 1, device=query.device)
    return paged_attention_reference(
        query.contiguous(), kv_cache, query_start_loc, seq_lens, block_tables, scale
    )


def _windowed_decode_ref(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> Tensor:
    """Row i attends to positions max(0, L - window) .. L - 1 of its table (L = seq_lens[i]; all of them
    with window 0), its scores soft-capped when softcap > 0, in fp32."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        first = max(0, seq_len - window) if window > 0 else 0
        positions = torch.arange(first, seq_len, device=query.device)
        blocks = block_tables[i, positions // block_size].long()
        head_dim = query.shape[2]
        k = dequantize_kv(kv_cache[0, blocks, positions % block_size], head_dim).repeat_interleave(
            group, dim=1
        )
        v = dequantize_kv(kv_cache[1, blocks, positions % block_size], head_dim).repeat_interleave(
            group, dim=1
        )
        scores = torch.einsum("hd,phd->hp", query[i].float(), k) * scale  # [heads, positions]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        out[i] = torch.einsum("hp,phd->hd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


def argmax_rows_ref(x: Tensor) -> Tensor:
    """Per row of x [rows, n], the index of the first maximum (a NaN counts as the maximum), int64 [rows]."""
    return x.max(dim=-1).indices


def inverse_cdf_ref(probs: Tensor, uniform: Tensor) -> Tensor:
    """Per row of probs [rows, n] (need not sum to 1) and uniform [rows] float64 in [0, 1): the first
    token whose cumulative probability (float64) exceeds u times the row's total (int64 [rows])."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    targets = (uniform * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return sampled.clamp_(max=probs.shape[1] - 1)


def sample_rows_ref(logits: Tensor, uniform: Tensor) -> Tensor:
    """A token per row of logits [rows, n] drawn from softmax(logits) by inverse CDF with `uniform`."""
    return inverse_cdf_ref(logits.softmax(dim=-1), uniform)
