"""PoolingParams: what a pooling request asks of the engine (an embedding, or a cross-encoder's score).

A pooling request is a prompt-only request (max_tokens 0) that carries these: after its prompt is
computed (in one step: pooling requests are scheduled whole), the engine core pools the final hidden
states and returns the result as float32 bytes: for the task "embed" the vector, for "score" (a
cross-encoder, `*ForSequenceClassification`) the relevance score of the (query, document) pair the
prompt holds, its classifier head's logit after the model's activation. The API fills every field from
the model's defaults (`Ready.pooling_type`, `Ready.normalize_embeddings`, `Ready.pooling_task`) and
checks them against what the model declares (izh.frontend.input_processor.validate_pooling); the core
only asserts.

No torch here: the API process builds these and sends them to the core as msgpack.
"""

from __future__ import annotations

import array
import math
import sys

import msgspec

POOLING_TYPES = ("mean", "cls", "last")
"""mean: the average of every token's hidden state; cls: the first token's; last: the last token's."""

POOLING_TASKS = ("embed", "score")
"""embed: the pooled vector; score: a cross-encoder's score of a text pair (its first token's hidden
state through the classifier head)."""


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one request's final hidden states become one vector."""

    pooling_type: str
    """One of POOLING_TYPES."""
    normalize: bool
    """L2-normalize the pooled vector (after truncation to `dimensions`)."""
    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka truncation, then renormalized when `normalize`);
    None keeps the model's hidden size."""
    task: str = "embed"
    """One of POOLING_TASKS: what the model's pooling step returns."""
    segment_start: int | None = None
    """A pair's second segment starts at this prompt position (token type 1 from here, as a BERT
    tokenizer's token_type_ids say); None: one segment (token type 0 throughout)."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.task == "score" and (self.dimensions is not None or self.normalize):
            raise ValueError("a score is neither truncated (dimensions) nor normalized")
        if self.segment_start is not None and self.segment_start < 1:
            raise ValueError(f"segment_start must be >= 1, got {self.segment_start}")


def score_params(segment_start: int | None) -> PoolingParams:
    """A cross-encoder's scoring of one (query, document) pair whose document starts at `segment_start`."""
    return PoolingParams(pooling_type="cls", normalize=False, task="score", segment_start=segment_start)


def embedding_floats(vector: bytes) -> list[float]:
    """A vector (or a score) as the core sends it (little-endian float32 bytes) as Python floats."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (sentence-transformers' `util.cos_sim`); 0 for a zero one."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms > 0 else 0.0
