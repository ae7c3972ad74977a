"""A Responses request read as the chat request it means (POST /v1/responses, izh.api.responses.routes).

`check_responses_request` refuses, naming the field, what izh cannot honour; `chat_tools`,
`response_format` and `chat_request` map the Responses fields onto chat's (`max_output_tokens` is
max_completion_tokens, `text.format` response_format, flat function tools chat's tools); `renamed` and
`image_part_param` turn a refusal from chat's machinery back into the Responses field it names.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic

from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ToolParam,
)
from izh.api.common.errors import validation_error_to_invalid_request
from izh.api.common.protocol import (
    JsonSchemaFormat,
    ResponseFormat,
)
from izh.api.responses.protocol import (
    ResponsesRequest,
    TextFormat,
)
from izh.api.responses.reasoning import ENCRYPTED_CONTENT_INCLUDE, check_reasoning
from izh.errors import InvalidRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one `include` value izh produces: the output text's logprobs."""
SERVICE_TIERS = ("auto", "default", "flex", "priority", "scale")
"""Accepted: izh has one tier, and the Response says "default"."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def unsupported(param: str, message: str) -> InvalidRequest:
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
            body.service_tier not in (None, *SERVICE_TIERS),
            f"expected one of {', '.join(SERVICE_TIERS)}, got {body.service_tier!r}",
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
    for param, refused, message in refusals:
        if refused:
            raise unsupported(param, message)
    if body.reasoning is not None:
        check_reasoning(body.reasoning.effort, body.reasoning.summary, body.reasoning.generate_summary)
    for index, value in enumerate(body.include or []):
        if value not in (LOGPROBS_INCLUDE, ENCRYPTED_CONTENT_INCLUDE):
            raise unsupported(
                f"include.{index}",
                f"{value!r} is not supported (only {LOGPROBS_INCLUDE!r} and {ENCRYPTED_CONTENT_INCLUDE!r})",
            )
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


def _chat_tool_choice(
    choice: str | dict[str, Any] | None,
) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    if choice is None:
        return None
    for option in ("auto", "none", "required"):
        if choice == option:
            return option
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name: expected the function's name", param="tool_choice.name")
        return NamedToolChoice(function=NamedToolChoiceFunction(name=name))
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise unsupported(
        "tool_choice", f'{kind!r} is not supported; use "auto", "none", "required" or a function'
    )


def response_format(text_format: TextFormat | None) -> tuple[ResponseFormat | None, dict[str, Any]]:
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
    raise unsupported(
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


def image_part_param(
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


def renamed(exc: InvalidRequest) -> InvalidRequest:
    exc.message = _responses_name(exc.message)
    exc.args = (exc.message,)
    if exc.param is not None:
        exc.param = _responses_name(exc.param)
    return exc


def chat_request(
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
            # effort "none": no thinking, for templates that know the switch (izh.api.responses.reasoning).
            chat_template_kwargs={"enable_thinking": False}
            if body.reasoning is not None and body.reasoning.effort == "none"
            else None,
        )
    except pydantic.ValidationError as exc:
        raise renamed(validation_error_to_invalid_request(exc)) from None
