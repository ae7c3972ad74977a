"""Random GGUF weight blocks of every type izh's block kernels serve, for kernel and parity tests.

Every byte is random except each block's fp16 scales, which are set to finite values of a realistic
size, so a weight decodes to finite floats whatever its codes and sub-block scales."""

from __future__ import annotations

import numpy as np

from izh.kernels.cpu.gguf_blocks import GGUF_BLOCK_TYPES

# Offsets of each block's fp16 scale fields (d, and m / dmin where there is one).
_FP16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_blocks(name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """uint8 [rows, K / block * bytes]: random `name` blocks whose weights are about `scale` in size."""
    _, bs, nb = GGUF_BLOCK_TYPES[name]
    blocks = rng.integers(0, 256, size=(rows, k // bs, nb), dtype=np.uint8)
    # the codes' magnitude (times the sub-block scales for the K-quants) the fp16 scale divides out
    span = {
        "Q4_K": 15 * 63,
        "Q5_K": 31 * 63,
        "Q6_K": 32 * 127,
        "IQ4_XS": 127 * 32,
        "Q8_0": 127,
        "IQ4_NL": 127,
    }.get(name, 16)
    for i, off in enumerate(_FP16_FIELDS[name]):
        magnitude = scale / span if i == 0 else scale / (63 if name in ("Q4_K", "Q5_K") else 1)
        values = (rng.uniform(0.2, 1.0, size=(rows, k // bs)) * magnitude).astype(np.float16)
        if i == 1 and name in ("Q4_1", "Q5_1"):
            values = (-values * 8).astype(np.float16)  # w = d * q + m, q >= 0: centre the weights
        blocks[..., off : off + 2] = values[..., None].view(np.uint8).reshape(rows, k // bs, 2)
    return blocks.reshape(rows, k // bs * nb)
