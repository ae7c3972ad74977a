"""POST /v1/embeddings: OpenAI's embeddings (the `openai` SDK's `client.embeddings.create`).

Each input (a string, or token ids as given) becomes one prompt-only engine request carrying the
model's PoolingParams (pooling type and normalization from Ready, `dimensions` from the body); the
engine batches them with everything else, pools each one's final hidden states after its prompt is
computed (in one step), and returns the vector as float32 bytes, which go out as JSON floats or, with
`encoding_format: "base64"`, as those bytes in base64 (what the SDK asks for by default).

Refused with a 400 naming the field: an empty input, an input longer than the model's context (it is
not truncated, as OpenAI refuses it too; `truncate_prompt_tokens` is refused), more inputs than
limits.max_embedding_inputs (by the request guard), more tokens in one input than
limits.max_prompt_tokens, and `dimensions` where the model declares no Matryoshka sizes.
"""

from __future__ import annotations

import asyncio
import base64
import logging

from starlette.requests import Request
from starlette.responses import Response

from izh.api.common.completion_prompt import split_prompts
from izh.api.common.fanout import Child, abort_all, merge_outputs, until_disconnected
from izh.api.common.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from izh.api.common.state import (
    ApiState,
    api_state,
    check_model,
    check_serving,
    json_response,
    read_json,
    request_id_of,
)
from izh.errors import InvalidRequest, LimitExceeded
from izh.frontend.async_llm import REQUEST_SCOPE
from izh.pooling_params import PoolingParams, embedding_floats
from izh.sampling_params import SamplingParams
from izh.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _input_param(index: int, count: int, field: str = "input") -> str:
    return field if count == 1 else f"{field}.{index}"


def tokenize_inputs(
    tokenizer: Tokenizer, items: list[str | list[int]], add_special_tokens: bool, field: str = "input"
) -> list[list[int]]:
    """Each input's token ids (strings encoded; a 400 naming `field` for an empty one)."""
    result = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(
                    "an input must not be an empty string", param=_input_param(i, len(items), field)
                )
            result.append(tokenizer.encode(item, add_special_tokens=add_special_tokens))
        else:
            result.append(list(item))
    return result


def _check_body(body: EmbeddingRequest) -> None:
    if body.truncate_prompt_tokens is not None:
        raise InvalidRequest(
            "truncate_prompt_tokens is not supported: an input longer than the model's context is refused",
            param="truncate_prompt_tokens",
            code="unsupported",
        )
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidRequest(f"dimensions must be >= 1, got {body.dimensions}", param="dimensions")


def check_token_limit(token_ids: list[list[int]], field: str = "input") -> None:
    """limits.max_prompt_tokens per input, naming the input (AsyncLLM's own check names `prompt`)."""
    scope = REQUEST_SCOPE.get()
    limit = scope.max_prompt_tokens if scope is not None else None
    if limit is None:
        return
    for i, ids in enumerate(token_ids):
        if len(ids) > limit:
            raise LimitExceeded(
                f"an input has {len(ids)} tokens, over the limit of {limit} (limits.max_prompt_tokens)",
                param=_input_param(i, len(token_ids), field),
            )


def check_can_embed(state: ApiState) -> None:
    """A cross-encoder scores pairs and embeds nothing: /v1/embeddings on one is a 400 naming `model`."""
    if state.llm.ready.pooling_task == "score":
        raise InvalidRequest(
            f"the model `{state.model_name}` is a cross-encoder (a reranker): it scores text pairs "
            "(/v1/rerank, /score) and returns no embeddings",
            param="model",
            code="model_cannot_embed",
        )


async def admit_pooling(
    state: ApiState,
    base_id: str,
    token_ids: list[list[int]],
    poolings: list[PoolingParams],
    lora_name: str | None,
    fields: list[str] | None = None,
) -> list[Child]:
    """One prompt-only request per input (`poolings[i]` its pooling), all or none (the admitted ones
    are aborted on a refusal)."""
    children: list[Child] = []
    params = SamplingParams(max_tokens=0)
    try:
        for i, (ids, pooling) in enumerate(zip(token_ids, poolings, strict=True)):
            stream = await state.llm.add_request(
                f"{base_id}-{i}",
                ids,
                params,
                deadline_s=state.default_request_timeout_s,
                prompt_param=fields[i] if fields is not None else _input_param(i, len(token_ids)),
                pooling_params=pooling,
                lora_name=lora_name,
            )
            children.append(Child(i, i, 0, stream))
    except BaseException:
        for child in children:
            child.stream.abort()
        raise
    return children


async def _collect(
    children: list[Child], token_ids: list[list[int]], encoding_format: str, response_id: str, model: str
) -> EmbeddingResponse:
    vectors: dict[int, bytes] = {}
    async for child, out in merge_outputs(children):
        if out.finished:
            if out.embedding is None:
                raise InvalidRequest(
                    f"input {child.index} ended ({out.finish_reason}) before it was embedded",
                    param=_input_param(child.index, len(children)),
                )
            vectors[child.index] = out.embedding
    data = [
        EmbeddingData.model_construct(
            object="embedding",
            index=index,
            embedding=base64.b64encode(vectors[index]).decode("ascii")
            if encoding_format == "base64"
            else embedding_floats(vectors[index]),
        )
        for index in range(len(children))
    ]
    num_tokens = sum(len(ids) for ids in token_ids)
    return EmbeddingResponse(
        id=response_id,
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


async def create_embedding(request: Request) -> Response:
    """OpenAI's POST /v1/embeddings."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, EmbeddingRequest)
    lora_name = check_model(state, body.model)
    check_can_embed(state)
    _check_body(body)
    llm = state.llm
    ready = llm.ready
    items = split_prompts(body.input, param="input")
    token_ids = await asyncio.to_thread(tokenize_inputs, llm.tokenizer, items, body.add_special_tokens)
    check_token_limit(token_ids)
    pooling = PoolingParams(
        pooling_type=ready.pooling_type, normalize=ready.normalize_embeddings, dimensions=body.dimensions
    )
    request_id = request_id_of(request)
    children = await admit_pooling(
        state, f"embd-{request_id}", token_ids, [pooling] * len(token_ids), lora_name
    )
    state.metrics.count_request("/v1/embeddings")
    logger.debug("[%s] embeddings: %d inputs", request_id, len(children))
    collect = _collect(
        children, token_ids, body.encoding_format, f"embd-{request_id}", lora_name or state.model_name
    )
    try:
        result = await until_disconnected(request, collect)
    finally:
        abort_all(children)
    return result if isinstance(result, Response) else json_response(result)
