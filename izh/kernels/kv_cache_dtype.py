"""The KV cache's element formats (`engine.kv_cache_dtype`): what one cache row holds, and the torch
references for writing (quantizing) and reading (dequantizing) it.

A cache tensor is [2, num_blocks, block_size, num_kv_heads, row] (0 = K, 1 = V); `row` is head_dim
elements of the format's storage dtype, except for q8_0, whose row is head_dim / 32 blocks of 34 bytes
(llama.cpp's block_q8_0: a float16 scale d, then 32 int8 codes q; the value is d * q), stored as uint8.

| name | storage | bytes per element | write (from float32) |
|---|---|---|---|
| float32 | float32 | 4 | as is |
| bfloat16 | bfloat16 | 2 | round to nearest even |
| float16 | float16 | 2 | clamped to +-65504, round to nearest even |
| fp8_e4m3 (fp8) | float8_e4m3fn | 1 | clamped to +-448, round to nearest even |
| fp8_e5m2 | float8_e5m2 | 1 | clamped to +-57344, round to nearest even |
| q8_0 | uint8 | 34 / 32 | per 32: d = amax / 127, q = round(x / d) half away from zero (llama.cpp) |

The fp8 formats have no scale (vLLM's default k_scale = v_scale = 1.0): values are clamped, never
infinite or NaN. `auto` is the model's dtype (today's behaviour). The C kernels (csrc/attention.c)
write and read exactly these bits; the references here define them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "KV_CACHE_DTYPES",
    "Q8_0_BLOCK",
    "Q8_0_BLOCK_BYTES",
    "KVCacheFormat",
    "dequantize_kv",
    "format_of_cache",
    "kv_cache_format",
    "quantize_kv",
    "raw_rows",
]

Q8_0_BLOCK = 32
"""Elements per q8_0 block (along head_dim)."""
Q8_0_BLOCK_BYTES = 34
"""Bytes per q8_0 block: a float16 scale and 32 int8 codes."""


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """One element format of the KV cache."""

    name: str
    """float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2 | q8_0 (auto resolved to the model's dtype)."""
    storage: torch.dtype
    """The cache tensor's dtype (uint8 for q8_0)."""
    clamp: float | None = None
    """The largest finite magnitude, for the formats a float32 can overflow (values are clamped to it)."""

    @property
    def quantized(self) -> bool:
        """Whether the cache holds blocks (q8_0) rather than one element per value."""
        return self.name == "q8_0"

    def row_size(self, head_dim: int) -> int:
        """The cache's last dimension for `head_dim` values (q8_0: bytes; else elements)."""
        if self.quantized:
            return head_dim // Q8_0_BLOCK * Q8_0_BLOCK_BYTES
        return head_dim

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, KV head) row."""
        return self.row_size(head_dim) * torch.empty((), dtype=self.storage).element_size()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token takes in the cache: 2 (K, V) x layers x KV heads x a row's bytes."""
        return 2 * num_layers * num_kv_heads * self.row_bytes(head_dim)

    def check_head_dim(self, head_dim: int) -> str | None:
        """Why this format cannot hold rows of `head_dim` (None: it can)."""
        if self.quantized and head_dim % Q8_0_BLOCK:
            return f"q8_0 needs a head_dim that is a multiple of {Q8_0_BLOCK} (this model's is {head_dim})"
        return None


_FORMATS: dict[str, KVCacheFormat] = {
    "float32": KVCacheFormat("float32", torch.float32),
    "bfloat16": KVCacheFormat("bfloat16", torch.bfloat16),
    "float16": KVCacheFormat("float16", torch.float16, 65504.0),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
    "q8_0": KVCacheFormat("q8_0", torch.uint8),
}
_ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "q8_0",
)
"""Every name `engine.kv_cache_dtype` takes (vLLM's for the fp8 ones; fp8 is fp8_e4m3)."""
_BY_STORAGE = {fmt.storage: fmt for fmt in _FORMATS.values()}


def kv_cache_format(name: str, model_dtype: torch.dtype) -> KVCacheFormat:
    """The format `name` names; auto is the model's dtype. Raises ValueError naming the choices."""
    key = _ALIASES.get(name, name)
    if key == "auto":
        return format_of_cache(model_dtype)
    try:
        return _FORMATS[key]
    except KeyError:
        raise ValueError(
            f"unknown KV cache dtype {name!r}; choose one of: {', '.join(KV_CACHE_DTYPES)}"
        ) from None


def format_of_cache(storage: torch.dtype) -> KVCacheFormat:
    """The format of a cache tensor of dtype `storage` (uint8: q8_0)."""
    try:
        return _BY_STORAGE[storage]
    except KeyError:
        raise ValueError(f"no KV cache format is stored as {storage}") from None


def quantize_kv(x: Tensor, storage: torch.dtype) -> Tensor:
    """x [..., head_dim] (any float dtype) as the cache rows of the format stored as `storage`
    ([..., row_size]): through float32, clamped, rounded to nearest even (q8_0: llama.cpp's rounding)."""
    fmt = format_of_cache(storage)
    if x.dtype == storage:
        return x
    x = x.float()
    if not fmt.quantized:
        if fmt.clamp is not None:
            x = x.clamp(-fmt.clamp, fmt.clamp)
        return x.to(storage)
    blocks = x.reshape(*x.shape[:-1], -1, Q8_0_BLOCK)  # [..., head_dim / 32, 32]
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    y = blocks * inverse
    codes = y.trunc()
    codes = codes + torch.where((y - codes).abs() >= 0.5, y.sign(), torch.zeros_like(y))  # roundf
    d = scale.clamp(max=65504.0).to(torch.float16).view(torch.uint8)  # [..., blocks, 2]
    q = codes.to(torch.int8).view(torch.uint8)  # [..., blocks, 32]
    return torch.cat((d, q), dim=-1).reshape(*x.shape[:-1], -1)


def dequantize_kv(rows: Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Cache rows [..., row_size] (any format) as values [..., head_dim] in `dtype` (q8_0: d * q in
    float32, then `dtype`)."""
    if rows.dtype != torch.uint8:
        return rows.to(dtype)
    blocks = rows.reshape(*rows.shape[:-1], head_dim // Q8_0_BLOCK, Q8_0_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., blocks, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*rows.shape[:-1], head_dim).to(dtype)


def raw_rows(t: Tensor) -> Tensor:
    """`t` viewed so that torch's index ops take it: float8 as uint8 (CPU torch has no index_copy_ or
    index_select for them; bytes move unchanged), other dtypes as they are. `dequantize_kv` reads either
    once viewed back (`.view(storage)`)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t
