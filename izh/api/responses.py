"""POST /v1/responses (OpenAI's Responses API) on chat's machinery, and the stored responses' routes
(GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items).

A request becomes the chat request it means: `instructions` a system message first, the stored
conversation of `previous_response_id` (its instructions not carried over, as OpenAI does) and the
`input` items as chat messages (izh.api.responses_items), flat function tools as chat's tools,
`text.format` as response_format, `max_output_tokens` as max_completion_tokens. Then chat's
`prepare_chat` renders, constrains and admits it, and izh.api.responses_stream builds the output
items and events with chat's parsers. A refusal from chat's machinery names the Responses field
(`input`, `text.format`, `max_output_tokens`, `tools.0.parameters`).

Fields izh cannot honour (background, conversation, prompt, built-in tools, reasoning effort or
summaries, truncation "auto", include values other than message.output_text.logprobs, ...) are 400s
naming the field. Logprobs come with `include: ["message.output_text.logprobs"]` or a `top_logprobs`
(either asks for them). Stored responses (izh.api.responses_store) belong to the API key that made them.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any, Literal

import pydantic
from starlette.requests import Request
from starlette.responses import Response

from izh.api.chat import prepare_chat
from izh.api.errors import validation_error_to_invalid_request
from izh.api.fanout import respond
from izh.api.protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ResponseFormat,
    ToolParam,
)
from izh.api.ratelimit import ANONYMOUS_KEY_ID
from izh.api.responses_items import items_to_messages, normalize_input
from izh.api.responses_protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
    TextFormat,
)
from izh.api.responses_store import StoredResponse
from izh.api.responses_stream import ResponseContext, collect_response, response_events
from izh.api.state import (
    ApiState,
    api_state,
    check_model,
    check_serving,
    json_response,
    read_json,
    request_id_of,
)
from izh.errors import InvalidRequest, NotFound
from izh.frontend.async_llm import REQUEST_SCOPE

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one `include` value izh produces: the output text's logprobs."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS_PAGE = 100


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code="unsupported")


def check_responses_request(body: ResponsesRequest) -> None:
    """400 naming the first field izh cannot honour (never silently ignored)."""
    refusals: list[tuple[str, bool, str]] = [
        ("background", bool(body.background), "background responses are not supported"),
        (
            "conversation",
            body.conversation is not None,
            "conversations are not supported; use previous_response_id",
        ),
        ("prompt", body.prompt is not None, "reusable prompt templates are not supported"),
        (
            "max_tool_calls",
            body.max_tool_calls is not None,
            "it limits built-in tool calls, which izh does not run",
        ),
        (
            "service_tier",
            body.service_tier not in (None, "auto", "default"),
            f"service tier {body.service_tier!r} is not offered (auto or default only)",
        ),
        (
            "prompt_cache_retention",
            body.prompt_cache_retention not in (None, "in_memory"),
            "only in_memory retention is offered (the prefix cache lives in memory)",
        ),
        (
            "truncation",
            body.truncation not in (None, "disabled"),
            'only "disabled" is supported: an input longer than the context is a 400',
        ),
        (
            "text.verbosity",
            body.text is not None and body.text.verbosity is not None,
            "verbosity cannot be controlled for this model",
        ),
        (
            "stream_options.include_obfuscation",
            bool(body.stream_options and body.stream_options.include_obfuscation),
            "stream obfuscation is not supported",
        ),
    ]
    if body.reasoning is not None:
        refusals += [
            (
                "reasoning.effort",
                body.reasoning.effort is not None,
                "reasoning effort cannot be controlled for this model",
            ),
            (
                "reasoning.summary",
                body.reasoning.summary is not None,
                "reasoning summaries are not generated",
            ),
            (
                "reasoning.generate_summary",
                body.reasoning.generate_summary is not None,
                "reasoning summaries are not generated",
            ),
        ]
    for param, refused, message in refusals:
        if refused:
            raise _unsupported(param, message)
    for index, value in enumerate(body.include or []):
        if value != LOGPROBS_INCLUDE:
            raise _unsupported(f"include.{index}", f"{value!r} is not supported (only {LOGPROBS_INCLUDE!r})")
    _check_metadata(body.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                f"{MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


# --- the request → chat's request -------------------------------------------------------------------


def _chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[ToolParam] | None, list[dict[str, Any]]]:
    """Chat's tools for the flat Responses function tools, and the tools as the Response echoes them."""
    if not tools:
        return None, []
    chat_tools: list[ToolParam] = []
    echoed: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise _unsupported(
                f"tools.{index}.type", f"tools of type {kind!r} are not supported (function tools only)"
            )
        fields = {key: tool.get(key) for key in ("name", "description", "parameters", "strict")}
        try:
            function = FunctionDefinition.model_validate(fields)
        except pydantic.ValidationError as exc:
            error = validation_error_to_invalid_request(exc)
            param = f"tools.{index}.{error.param}" if error.param else f"tools.{index}"
            raise InvalidRequest(f"tools.{index}.{error.message}", param=param) from None
        chat_tools.append(ToolParam(function=function))
        echoed.append({"type": "function", **function.model_dump()})
    return chat_tools, echoed


def _chat_tool_choice(
    choice: str | dict[str, Any] | None,
) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    if choice is None:
        return None
    for option in ("auto", "none", "required"):
        if choice == option:
            return option
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name: expected the function's name", param="tool_choice.name")
        return NamedToolChoice(function=NamedToolChoiceFunction(name=name))
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise _unsupported(
        "tool_choice", f'{kind!r} is not supported; use "auto", "none", "required" or a function'
    )


def _response_format(text_format: TextFormat | None) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """Chat's response_format for `text.format`, and the format as the Response echoes it."""
    if text_format is None or text_format.type == "text":
        return None, {"type": "text"}
    if text_format.type == "json_object":
        return ResponseFormat(type="json_object"), {"type": "json_object"}
    if text_format.type == "json_schema":
        if text_format.name is None:
            raise InvalidRequest(
                "text.format.name: a json_schema format needs a name", param="text.format.name"
            )
        if text_format.schema_ is None:
            raise InvalidRequest(
                "text.format.schema: a json_schema format needs a schema", param="text.format.schema"
            )
        schema = JsonSchemaFormat.model_validate(
            {
                "name": text_format.name,
                "description": text_format.description,
                "schema": text_format.schema_,
                "strict": text_format.strict,
            }
        )
        echoed = {"type": "json_schema", **text_format.model_dump(by_alias=True, exclude_none=True)}
        return ResponseFormat(type="json_schema", json_schema=schema), echoed
    raise _unsupported(
        "text.format.type", f"{text_format.type!r} is not supported; use text, json_object or json_schema"
    )


_MESSAGES = re.compile(r"\bmessages(\[\d+\]|(\.\d+)+)?")
_RENAMES = (
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    (".function.", "."),
)


def _responses_name(text: str) -> str:
    """Chat's field names in `text` as the Responses request spells them."""
    text = _MESSAGES.sub("input", text)
    for old, new in _RENAMES:
        text = text.replace(old, new)
    return text


_IMAGE_PART = re.compile(r"messages\.(\d+)\.content\.(\d+)(\.image_url.*)")


def _image_part_param(
    param: str | None, messages: list[ChatMessageParam], num_stored: int, conversation: list[dict[str, Any]]
) -> str | None:
    """Chat's name of a refused image part (messages.K.content.J.image_url...) as the Responses request
    names it: `input.I.content.J.image_url` for an input_image of this request's input (chat's image parts
    are the conversation's input_image parts, in order), `previous_response_id` for one of a stored
    conversation; None for anything else."""
    match = _IMAGE_PART.fullmatch(param or "")
    if match is None:
        return None
    message, part = int(match[1]), int(match[2])
    # Which image part of the chat request it is, counting in message order.
    k = sum(
        1
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for j, p in enumerate(m.content)
        if p.type == "image_url" and (i, j) < (message, part)
    )
    found = 0
    for index, item in enumerate(conversation):
        if item.get("type") != "message" or not isinstance(item.get("content"), list):
            continue
        for j, content in enumerate(item["content"]):
            if content.get("type") != "input_image":
                continue
            if found == k:
                if index < num_stored:
                    return "previous_response_id"
                # The Responses part holds `image_url` (the URL) and `detail` side by side.
                suffix = ".detail" if match[3] == ".image_url.detail" else ".image_url"
                return f"input.{index - num_stored}.content.{j}{suffix}"
            found += 1
    return None


def _renamed(exc: InvalidRequest) -> InvalidRequest:
    exc.message = _responses_name(exc.message)
    exc.args = (exc.message,)
    if exc.param is not None:
        exc.param = _responses_name(exc.param)
    return exc


def _chat_request(
    body: ResponsesRequest,
    messages: list[ChatMessageParam],
    tools: list[ToolParam] | None,
    fmt: ResponseFormat | None,
) -> ChatCompletionRequest:
    logprobs = LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs is not None
    try:
        return ChatCompletionRequest(
            messages=messages,
            tools=tools,
            tool_choice=_chat_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls,
            max_completion_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            response_format=fmt,
            logprobs=logprobs,
            top_logprobs=(body.top_logprobs or 0) if logprobs else None,
            stream=body.stream,
        )
    except pydantic.ValidationError as exc:
        raise _renamed(validation_error_to_invalid_request(exc)) from None


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
    input_items = normalize_input(body.input)
    conversation += input_items
    messages = items_to_messages(conversation)
    if body.instructions:
        messages.insert(0, ChatMessageParam(role="system", content=body.instructions))
    if not messages:
        raise InvalidRequest("input must not be empty", param="input")
    tools, echoed_tools = _chat_tools(body.tools)
    fmt, echoed_format = _response_format(body.text.format if body.text is not None else None)
    chat_body = _chat_request(body, messages, tools, fmt)
    request_id = request_id_of(request)
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
        tools=echoed_tools,
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
        image_param = _image_part_param(
            exc.param, messages, len(conversation) - len(input_items), conversation
        )
        if image_param is not None:
            exc.message = exc.message.replace(exc.param or "", image_param)
            exc.args = (exc.message,)
            exc.param = image_param
            raise exc from None
        raise _renamed(exc) from None
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
    )
    children = chat.children
    return await respond(
        request,
        children,
        stream=body.stream,
        events=lambda: response_events(ctx, children),
        collect=lambda: collect_response(ctx, children),
        keepalive_s=state.sse_keepalive_s,
        request_id=request_id,
    )


def _refuse_query(request: Request, *names: str) -> None:
    for name in names:
        value = request.query_params.get(name)
        if value is not None and value not in ("", "false"):
            raise _unsupported(name, f"the query parameter {name} is not supported here")


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
