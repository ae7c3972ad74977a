"""The rerank (Jina / Cohere shape, as vLLM serves it) and score (vLLM's) bodies as pydantic models."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from izh.api.common.protocol import Int64, RequestBase


class RerankRequest(RequestBase):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: Int64 | None = None
    """How many of the best documents to return; None or 0: all of them."""
    return_documents: bool = True
    """Jina's: each result carries its document's text (default true)."""
    truncate_prompt_tokens: Int64 | None = None
    """vLLM's; refused with a 400 when set: a text longer than the context is refused, not truncated."""


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(RequestBase):
    """vLLM's: `text_1` against `text_2` (one against one, one against many, or pairwise)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int64 | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
