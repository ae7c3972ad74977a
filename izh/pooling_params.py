"""PoolingParams: what an embedding request asks of the engine (pooling, normalization, dimensions).

An embedding request is a prompt-only request (max_tokens 0) that carries these: after its prompt is
computed (in one step: pooling requests are scheduled whole), the engine core pools the final hidden
states and returns the vector as float32 bytes. The API fills every field from the model's defaults
(`Ready.pooling_type`, `Ready.normalize_embeddings`) and checks `dimensions` against what the model
declares (izh.frontend.input_processor.validate_pooling); the core only asserts.

No torch here: the API process builds these and sends them to the core as msgpack.
"""

from __future__ import annotations

import array
import sys

import msgspec

POOLING_TYPES = ("mean", "cls", "last")
"""mean: the average of every token's hidden state; cls: the first token's; last: the last token's."""


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request's final hidden states become one vector."""

    pooling_type: str
    """One of POOLING_TYPES."""
    normalize: bool
    """L2-normalize the pooled vector (after truncation to `dimensions`)."""
    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka truncation, then renormalized when `normalize`);
    None keeps the model's hidden size."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")


def embedding_floats(vector: bytes) -> list[float]:
    """A vector as the core sends it (little-endian float32 bytes) as Python floats."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
