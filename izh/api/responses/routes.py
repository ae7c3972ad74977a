"""POST /v1/responses (OpenAI's Responses API) on chat's machinery, and the stored responses' routes
(GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items).

A request becomes the chat request it means: `instructions` a system message first, the stored
conversation of `previous_response_id` (its instructions not carried over, as OpenAI does) and the
`input` items as chat messages (izh.api.responses.items), the tools as chat's (izh.api.responses.tools:
namespaces flattened, custom tools as one-string functions, hosted tools skipped and named in the
x-izh-skipped-tools header),
`text.format` as response_format, `max_output_tokens` as max_completion_tokens. Then chat's
`prepare_chat` renders, constrains and admits it, and izh.api.responses.stream builds the output
items and events with chat's parsers. A refusal from chat's machinery names the Responses field
(`input`, `text.format`, `max_output_tokens`, `tools.0.parameters`).

Fields izh cannot honour (background, conversation, prompt, truncation "auto", include values other
than message.output_text.logprobs and reasoning.encrypted_content, ...) are 400s naming the field;
`reasoning` is izh.api.responses.reasoning's. Logprobs come with `include: ["message.output_text.logprobs"]` or a `top_logprobs`
(either asks for them). Stored responses (izh.api.responses.store) belong to the API key that made them.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from izh.api.chat.routes import prepare_chat
from izh.api.common.chat_protocol import (
    ChatMessageParam,
)
from izh.api.common.fanout import respond
from izh.api.common.state import (
    ApiState,
    api_state,
    check_model,
    check_serving,
    json_response,
    read_json,
    request_id_of,
)
from izh.api.guard.ratelimit import ANONYMOUS_KEY_ID
from izh.api.responses.items import items_to_messages, normalize_input
from izh.api.responses.protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from izh.api.responses.reasoning import ENCRYPTED_CONTENT_INCLUDE
from izh.api.responses.store import StoredResponse
from izh.api.responses.stream import ResponseContext, collect_response, response_events
from izh.api.responses.tools import SKIPPED_TOOLS_HEADER, responses_tools
from izh.api.responses.translate import (
    chat_request,
    check_responses_request,
    image_part_param,
    renamed,
    response_format,
    unsupported,
)
from izh.errors import InvalidRequest, NotFound
from izh.frontend.async_llm import REQUEST_SCOPE

MAX_INPUT_ITEMS_PAGE = 100


def _key_id() -> str:
    """The API key id of this request (its stored responses are its own)."""
    scope = REQUEST_SCOPE.get()
    return scope.key_id if scope is not None and scope.key_id else ANONYMOUS_KEY_ID


def _stored(state: ApiState, response_id: str, param: str | None = None) -> StoredResponse:
    entry = state.responses_store.get(_key_id(), response_id)
    if entry is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param=param)
    return entry


# --- the routes ----------------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    """OpenAI's Responses API: a response to `input` (stream or not), stored unless `store` is false."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, ResponsesRequest)
    lora_name = check_model(state, body.model)
    check_responses_request(body)
    conversation: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        conversation = list(_stored(state, body.previous_response_id, "previous_response_id").conversation)
    input_items = normalize_input(body.input, state.reasoning_seal.open)
    conversation += input_items
    messages = items_to_messages(conversation)
    if body.instructions:
        messages.insert(0, ChatMessageParam(role="system", content=body.instructions))
    if not messages:
        raise InvalidRequest("input must not be empty", param="input")
    request_id = request_id_of(request)
    offered = responses_tools(body.tools, strict=state.limits.strict_tools, request_id=request_id)
    tools = offered.chat or None
    fmt, echoed_format = response_format(body.text.format if body.text is not None else None)
    chat_body = chat_request(body, messages, tools, fmt)
    response_id = f"resp_{secrets.token_hex(24)}"
    defaults = state.sampling_defaults
    base = ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=lora_name or state.model_name,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        store=body.store,
        temperature=body.temperature if body.temperature is not None else defaults.get("temperature", 1.0),
        top_p=body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
        top_logprobs=body.top_logprobs,
        text={"format": echoed_format},
        tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none"),
        tools=offered.echoed,
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else None,
        service_tier="default" if body.service_tier is not None else None,
        user=body.user,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        metadata=body.metadata or {},
    )
    # Admitted last: nothing after it can refuse the request and leave its engine request behind.
    try:
        chat = await prepare_chat(
            state, chat_body, request_id, response_id, prompt_param="input", lora_name=lora_name
        )
    except InvalidRequest as exc:
        image_param = image_part_param(
            exc.param, messages, len(conversation) - len(input_items), conversation
        )
        if image_param is not None:
            exc.message = exc.message.replace(exc.param or "", image_param)
            exc.args = (exc.message,)
            exc.param = image_param
            raise exc from None
        raise renamed(exc) from None
    state.metrics.on_api_request(1, "/v1/responses")
    key_id = _key_id()

    def store(response: ResponseObject) -> None:
        output = [item.model_dump() for item in response.output]
        state.responses_store.put(key_id, StoredResponse(response, input_items, conversation + output))

    ctx = ResponseContext(
        base=base,
        chat=chat.ctx,
        top_logprobs=chat_body.top_logprobs,
        request_id=request_id,
        on_final=store if body.store else None,
        summary=body.reasoning is not None
        and (body.reasoning.summary or body.reasoning.generate_summary) is not None,
        seal=state.reasoning_seal.seal if ENCRYPTED_CONTENT_INCLUDE in (body.include or []) else None,
        namespaces=offered.namespaces,
        custom_tools=frozenset(offered.custom),
    )
    children = chat.children
    response = await respond(
        request,
        children,
        stream=body.stream,
        events=lambda: response_events(ctx, children),
        collect=lambda: collect_response(ctx, children),
        keepalive_s=state.sse_keepalive_s,
        request_id=request_id,
    )
    if offered.skipped:
        response.headers[SKIPPED_TOOLS_HEADER] = ", ".join(offered.skipped)
    return response


def _refuse_query(request: Request, *names: str) -> None:
    for name in names:
        value = request.query_params.get(name)
        if value is not None and value not in ("", "false"):
            raise unsupported(name, f"the query parameter {name} is not supported here")


async def retrieve_response(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response (404 unless this key stored it and it is still kept)."""
    _refuse_query(request, "include", "include[]", "stream", "starting_after")
    entry = _stored(api_state(request), request.path_params["response_id"])
    return json_response(entry.response)


async def delete_response(request: Request) -> Response:
    """DELETE /v1/responses/{id}."""
    response_id = request.path_params["response_id"]
    if not api_state(request).responses_store.delete(_key_id(), response_id):
        raise NotFound(f"Response with id '{response_id}' not found.")
    return json_response(DeletedResponse(id=response_id))


async def list_input_items(request: Request) -> Response:
    """GET /v1/responses/{id}/input_items: its input items, newest first unless order=asc, paged by
    `limit` (1 to 100, default 20) and `after` (an item id)."""
    _refuse_query(request, "include", "include[]")
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: expected asc or desc, got {order!r}", param="order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_INPUT_ITEMS_PAGE:
        raise InvalidRequest(f"limit: expected an integer from 1 to {MAX_INPUT_ITEMS_PAGE}", param="limit")
    entry = _stored(api_state(request), request.path_params["response_id"])
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise NotFound(f"Input item with id '{after}' not found.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return json_response(
        InputItemList(
            data=page,
            first_id=page[0]["id"] if page else "",
            last_id=page[-1]["id"] if page else "",
            has_more=len(items) > len(page),
        )
    )
