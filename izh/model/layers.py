"""Building blocks shared by the decoder models: norms, (packed) linears, embeddings, RoPE, gated MLP.

Parameters are created uninitialized (`torch.empty`): every one is overwritten by the loader, and random
init of a large matrix costs more than loading it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from izh.kernels import cpu as cpu_ops
from izh.model.packed import GGUFBlocks, PackedWeight


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, over the last dim."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.normalized_shape = (size,)

    def forward(self, x: Tensor) -> Tensor:
        # transformers normalizes in float32 and rounds before the weight; cpu_ops matches it (one fused
        # C kernel for 2-D input on CPU, torch ops otherwise).
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """residual += x in place, then the norm of the new residual (one kernel instead of two)."""
        return cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T (+ b), with W possibly packed from several checkpoint projections stacked by rows.

    `shard_names`/`shard_sizes` tell the loader which checkpoint tensor fills which rows: for the fused
    qkv_proj the shards are ("q_proj", "k_proj", "v_proj"). One matmul instead of three matters on CPU,
    where per-op overhead dominates single-stream decode.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        shard_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if shard_names is not None and len(shard_names) != len(shard_sizes):
            raise ValueError("shard_names and shard_sizes differ in length")
        out_features = sum(shard_sizes)
        self.in_features = in_features
        self.shard_sizes = tuple(shard_sizes)
        self.shard_names = tuple(shard_names) if shard_names is not None else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: PackedWeight | None = None
        """Weight-only int4/int8 copy for batches of <= packed.max_rows rows (izh.model.packed)."""

    def shard_rows(self) -> list[tuple[str | None, int, int]]:
        """(checkpoint shard name or None if unpacked, first row, end row) for each shard."""
        names: Sequence[str | None] = self.shard_names if self.shard_names is not None else [None]
        rows = []
        start = 0
        for name, size in zip(names, self.shard_sizes, strict=True):
            rows.append((name, start, start + size))
            start += size
        return rows

    def forward(self, x: Tensor) -> Tensor:
        packed = self.packed
        if packed is not None and x.shape[0] <= packed.max_rows:
            y = packed.matmul(x)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.packed: GGUFBlocks | None = None
        """The table in a GGUF file's own blocks (the dense weight then dropped): a lookup dequantizes only
        the rows it reads (izh.model.packing)."""

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.packed is not None:
            return self.packed.rows(input_ids)
        return F.embedding(input_ids, self.weight)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up packed in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size,
            (intermediate_size, intermediate_size),
            bias=False,
            dtype=dtype,
            shard_names=("gate_proj", "up_proj"),
        )
        self.down_proj = Linear(intermediate_size, (hidden_size,), bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        return self.down_proj(cpu_ops.silu_mul(gate_up))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32), bit-for-bit as transformers computes them."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} values, expected {inv_freq.numel()}")
        return inv_freq / factors
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    return inv_freq


def _longrope_long_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**exponent)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other RoPE type), as transformers does:
    `attention_factor` when given, else 0.1 * ln(factor) + 1 (with DeepSeek's mscale ratio if set)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling["rope_type"] == "longrope":
        # LongRoPE (Phi-3): sqrt(1 + ln(factor) / ln(original context)).
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = float(scaling["factor"])
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> Tensor:
    # YaRN (arXiv 2309.00071): dimensions rotating more than beta_fast times over the original context
    # keep their frequency, those rotating fewer than beta_slow times are interpolated by `factor`, a
    # linear ramp in between.
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band between the
    # two thresholds interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE in the "rotate half" layout, with cos/sin precomputed once for every position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.cos_sin_cache: Tensor
        self.register_buffer("cos_sin_cache", self._compute_cache(dtype), persistent=False)

    def _compute_cache(self, dtype: torch.dtype) -> Tensor:
        # Computed on CPU in float32 like transformers (positions * inv_freq, then cos/sin), then cast and
        # moved to the default device (the loader builds models under `with torch.device(...)`).
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
            positions = torch.arange(self.max_position, dtype=torch.int64).to(torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
            if self.scaling is not None and self.scaling["rope_type"] == "longrope":
                # Positions past the original context rotate with the long factors: what transformers
                # computes for tokens generated past it (their keys cached earlier keep the short ones).
                original = int(self.scaling["original_max_position_embeddings"])
                long_inv_freq = _longrope_long_inv_freq(self.head_dim, self.theta, self.scaling)
                freqs[original:] = positions[original:, None] * long_inv_freq[None, :]
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]
            factor = rope_attention_factor(self.scaling)
            if factor != 1.0:
                cache = cache * factor
        return cache.to(device=torch.get_default_device(), dtype=dtype)

    def forward(self, positions: Tensor) -> Tensor:
        """cos|sin rows [num_tokens, head_dim] for absolute positions; pass them to `apply_rotary_`."""
        return self.cos_sin_cache.index_select(0, positions)


def apply_rotary_(x: Tensor, cos_sin: Tensor) -> None:
    """Rotate x [num_tokens, num_heads, head_dim] in place by the per-token cos|sin rows [num_tokens,
    head_dim], rotate-half layout (x may be a strided view, e.g. the q and k heads of a packed qkv)."""
    cpu_ops.rotary_(x, cos_sin)


def limit_rope_positions(model: nn.Module, max_model_len: int) -> None:
    """Keep only the first `max_model_len` rows of every RotaryEmbedding's cos|sin cache: no position
    past the served context is ever looked up, and a 32k-position cache of a 128-wide head is 16 MB of
    float32 that a 4k-context server would carry for nothing."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and module.max_position > max_model_len:
            module.max_position = max_model_len
            module.cos_sin_cache = module.cos_sin_cache[:max_model_len].clone()
