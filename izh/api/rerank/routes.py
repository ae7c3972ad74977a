"""POST /v1/rerank (and /rerank) and POST /score (and /v1/score): relevance from a cross-encoder or
an embedding model.

A cross-encoder (a `BertForSequenceClassification` / `XLMRobertaForSequenceClassification` folder,
Ready.pooling_task "score") reads each (query, document) pair as one sequence: the pair is tokenized
as transformers' tokenizer(query, document) does (`Tokenizer.encode_pair`, token type 1 from the
document on), sent as a prompt-only request with `score_params`, and the engine runs the classifier
head over its first token and applies the model's activation; the score is what sentence-transformers'
`CrossEncoder.predict` gives. An embedding model (an encoder such as all-MiniLM-L6-v2) instead embeds
every text as /v1/embeddings embeds an input, and a pair's score is the cosine of its two vectors, as
sentence-transformers' `util.cos_sim` gives it. Either way, requests are batched in the engine.

A rerank returns the documents by falling score (`top_n` of them; each with its text unless
`return_documents` is false). A score request pairs one text_1 with every text_2, or text_1 and
text_2 item by item (equal lengths). A text or pair longer than the model's context is refused (400
naming it), not truncated as sentence-transformers truncates it; `truncate_prompt_tokens` is refused.
A generative model is a 400 naming `model` (its last-token vectors are no relevance measure).
"""

from __future__ import annotations

import asyncio

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
from izh.pooling_params import PoolingParams, cosine, embedding_floats, score_params


def check_scoring_model(state: ApiState) -> None:
    if state.llm.ready.can_generate:
        raise InvalidRequest(
            f"the model `{state.model_name}` generates text: rerank and score need a cross-encoder or an "
            "embedding model (an encoder such as all-MiniLM-L6-v2)",
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


async def _pool(
    request: Request,
    state: ApiState,
    token_ids: list[list[int]],
    poolings: list[PoolingParams],
    fields: list[str],
    base_id: str,
    lora_name: str | None,
) -> list[list[float]] | Response:
    """Each prompt's pooled floats (a vector, or a score), or the 499 of a client gone."""
    for ids, field in zip(token_ids, fields, strict=True):
        check_token_limit([ids], field)
    children = await admit_pooling(state, base_id, token_ids, poolings, lora_name, fields)

    async def collect() -> list[list[float]]:
        results: dict[int, list[float]] = {}
        async for child, out in merge_outputs(children):
            if out.finished:
                if out.embedding is None:
                    raise InvalidRequest(
                        f"{fields[child.index]} ended ({out.finish_reason}) before it was pooled",
                        param=fields[child.index],
                    )
                results[child.index] = embedding_floats(out.embedding)
        return [results[index] for index in range(len(children))]

    try:
        return await until_disconnected(request, collect())
    finally:
        abort_all(children)


async def _scores(
    request: Request,
    state: ApiState,
    firsts: tuple[list[str], list[str]],
    seconds: tuple[list[str], list[str]],
    base_id: str,
    lora_name: str | None,
) -> tuple[list[float], int] | Response:
    """The relevance of each pair (first i, or the one first, with second i) and the number of tokens
    read (or the 499 of a client gone). `firsts` and `seconds` are (texts, their fields in errors)."""
    first, first_fields = firsts
    second, second_fields = seconds

    def left(i: int) -> int:
        return 0 if len(first) == 1 else i

    if state.llm.ready.pooling_task == "score":
        pairs = [(first[left(i)], text) for i, text in enumerate(second)]
        fields = [(first_fields[left(i)], field) for i, field in enumerate(second_fields)]
        return await _cross_encoder_scores(request, state, pairs, fields, base_id, lora_name)
    texts, fields_ = first + second, first_fields + second_fields
    tokenizer = state.llm.tokenizer
    token_ids = await asyncio.to_thread(
        lambda: [tokenize_inputs(tokenizer, [t], True, f)[0] for t, f in zip(texts, fields_, strict=True)]
    )
    ready = state.llm.ready
    pooling = PoolingParams(pooling_type=ready.pooling_type, normalize=ready.normalize_embeddings)
    vectors = await _pool(request, state, token_ids, [pooling] * len(texts), fields_, base_id, lora_name)
    if isinstance(vectors, Response):
        return vectors
    lefts, rights = vectors[: len(first)], vectors[len(first) :]
    scores = [cosine(lefts[left(i)], right) for i, right in enumerate(rights)]
    return scores, sum(len(ids) for ids in token_ids)


async def _cross_encoder_scores(
    request: Request,
    state: ApiState,
    pairs: list[tuple[str, str]],
    fields: list[tuple[str, str]],
    base_id: str,
    lora_name: str | None,
) -> tuple[list[float], int] | Response:
    """Each pair through the cross-encoder: one sequence, scored by the engine (module docstring)."""
    for pair, names in zip(pairs, fields, strict=True):
        for text, field in zip(pair, names, strict=True):
            if not text:
                raise InvalidRequest("a text must not be an empty string", param=field)
    tokenizer = state.llm.tokenizer
    encoded = await asyncio.to_thread(lambda: [tokenizer.encode_pair(a, b) for a, b in pairs])
    token_ids = [ids for ids, _ in encoded]
    poolings = [score_params(start) for _, start in encoded]
    results = await _pool(
        request, state, token_ids, poolings, [second for _, second in fields], base_id, lora_name
    )
    if isinstance(results, Response):
        return results
    return [values[0] for values in results], sum(len(ids) for ids in token_ids)


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
    documents = (body.documents, [f"documents.{i}" for i in range(len(body.documents))])
    scored = await _scores(
        request, state, ([body.query], ["query"]), documents, f"rerank-{request_id}", lora_name
    )
    if isinstance(scored, Response):
        return scored
    scores, num_tokens = scored
    state.metrics.count_request("/v1/rerank")
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
    firsts = (first, [_field("text_1", body.text_1, i) for i in range(len(first))])
    seconds = (second, [_field("text_2", body.text_2, i) for i in range(len(second))])
    scored = await _scores(request, state, firsts, seconds, f"score-{request_id}", lora_name)
    if isinstance(scored, Response):
        return scored
    scores, num_tokens = scored
    state.metrics.count_request("/score")
    data = [ScoreData(index=i, score=value) for i, value in enumerate(scores)]
    response = ScoreResponse(
        id=f"score-{request_id}",
        model=lora_name or state.model_name,
        data=data,
        usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return json_response(response)


def _field(name: str, value: str | list[str], index: int) -> str:
    return name if isinstance(value, str) else f"{name}.{index}"
