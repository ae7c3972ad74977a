"""POST /v1/rerank (and /rerank) and POST /score (and /v1/score): relevance from an embedding model.

Every text (the query and the documents; text_1 and text_2) is embedded as /v1/embeddings embeds an
input (a prompt-only request with the model's pooling, batched in the engine), and a pair's score is
the cosine of its two vectors, as sentence-transformers' `util.cos_sim` gives it. A rerank returns the
documents by falling score (`top_n` of them; each with its text unless `return_documents` is false).
A score request pairs one text_1 with every text_2, or text_1 and text_2 item by item (equal lengths).

Only a model that serves embeddings alone (an encoder such as all-MiniLM-L6-v2) scores: a generative
model is a 400 naming `model` (its last-token vectors are no relevance measure). Cross-encoders
(`*ForSequenceClassification` folders) are not loaded by izh yet.
"""

from __future__ import annotations

import asyncio
import math

from starlette.requests import Request
from starlette.responses import Response

from izh.api.common.fanout import abort_all, merge_outputs, until_disconnected
from izh.api.common.state import (
    ApiState,
    api_state,
    check_model,
    check_serving,
    json_response,
    read_json,
    request_id_of,
)
from izh.api.embeddings.routes import admit_pooling, check_token_limit, tokenize_inputs
from izh.api.rerank.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from izh.errors import InvalidRequest
from izh.pooling_params import PoolingParams, embedding_floats


def check_scoring_model(state: ApiState) -> None:
    if state.llm.ready.can_generate:
        raise InvalidRequest(
            f"the model `{state.model_name}` generates text: rerank and score need an embedding model "
            "(an encoder such as all-MiniLM-L6-v2)",
            param="model",
            code="model_cannot_score",
        )


def _refuse_truncation(value: int | None) -> None:
    if value is not None:
        raise InvalidRequest(
            "truncate_prompt_tokens is not supported: a text longer than the model's context is refused",
            param="truncate_prompt_tokens",
            code="unsupported",
        )


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms > 0 else 0.0


async def _embed(
    request: Request,
    state: ApiState,
    texts: list[str],
    fields: list[str],
    base_id: str,
    lora_name: str | None,
) -> tuple[list[list[float]], int] | Response:
    """Each text's vector and the number of tokens embedded (or the 499 of a client gone)."""
    tokenizer = state.llm.tokenizer

    def tokenize() -> list[list[int]]:
        return [tokenize_inputs(tokenizer, [t], True, f)[0] for t, f in zip(texts, fields, strict=True)]

    token_ids = await asyncio.to_thread(tokenize)
    for ids, field in zip(token_ids, fields, strict=True):
        check_token_limit([ids], field)
    ready = state.llm.ready
    pooling = PoolingParams(pooling_type=ready.pooling_type, normalize=ready.normalize_embeddings)
    children = await admit_pooling(state, base_id, token_ids, pooling, lora_name, fields)

    async def collect() -> list[list[float]]:
        vectors: dict[int, list[float]] = {}
        async for child, out in merge_outputs(children):
            if out.finished:
                if out.embedding is None:
                    raise InvalidRequest(
                        f"{fields[child.index]} ended ({out.finish_reason}) before it was embedded",
                        param=fields[child.index],
                    )
                vectors[child.index] = embedding_floats(out.embedding)
        return [vectors[index] for index in range(len(children))]

    try:
        result = await until_disconnected(request, collect())
    finally:
        abort_all(children)
    if isinstance(result, Response):
        return result
    return result, sum(len(ids) for ids in token_ids)


async def rerank(request: Request) -> Response:
    """The documents by relevance to the query (Jina's / Cohere's rerank, as vLLM serves it)."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, RerankRequest)
    lora_name = check_model(state, body.model)
    check_scoring_model(state)
    _refuse_truncation(body.truncate_prompt_tokens)
    if body.top_n is not None and body.top_n < 0:
        raise InvalidRequest(f"top_n must be >= 0, got {body.top_n}", param="top_n")
    request_id = request_id_of(request)
    texts = [body.query, *body.documents]
    fields = ["query", *(f"documents.{i}" for i in range(len(body.documents)))]
    embedded = await _embed(request, state, texts, fields, f"rerank-{request_id}", lora_name)
    if isinstance(embedded, Response):
        return embedded
    vectors, num_tokens = embedded
    state.metrics.count_request("/v1/rerank")
    scores = [cosine(vectors[0], vector) for vector in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
        )
        for i in order
    ]
    response = RerankResponse(
        id=f"rerank-{request_id}",
        model=lora_name or state.model_name,
        usage=RerankUsage(total_tokens=num_tokens),
        results=results,
    )
    return json_response(response)


def _pairs(body: ScoreRequest) -> tuple[list[str], list[str]]:
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first or not second:
        raise InvalidRequest("text_1 and text_2 must not be empty", param="text_1" if not first else "text_2")
    if len(first) == 1:
        return first, second
    if len(first) != len(second):
        raise InvalidRequest(
            f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or as many as text_2",
            param="text_2",
        )
    return first, second


async def score(request: Request) -> Response:
    """vLLM's /score: the relevance of text_1 to each text_2."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, ScoreRequest)
    lora_name = check_model(state, body.model)
    check_scoring_model(state)
    _refuse_truncation(body.truncate_prompt_tokens)
    first, second = _pairs(body)
    request_id = request_id_of(request)
    fields = [_field("text_1", body.text_1, i) for i in range(len(first))]
    fields += [_field("text_2", body.text_2, i) for i in range(len(second))]
    embedded = await _embed(request, state, first + second, fields, f"score-{request_id}", lora_name)
    if isinstance(embedded, Response):
        return embedded
    vectors, num_tokens = embedded
    state.metrics.count_request("/score")
    left, right = vectors[: len(first)], vectors[len(first) :]
    data = [
        ScoreData(index=i, score=cosine(left[0] if len(left) == 1 else left[i], right[i]))
        for i in range(len(right))
    ]
    response = ScoreResponse(
        id=f"score-{request_id}",
        model=lora_name or state.model_name,
        data=data,
        usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return json_response(response)


def _field(name: str, value: str | list[str], index: int) -> str:
    return name if isinstance(value, str) else f"{name}.{index}"
