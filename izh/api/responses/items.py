"""Responses API items → chat messages: `input` (a string or a list of items) checked and normalized
into OpenAI's item shapes (each with an id, as GET /v1/responses/{id}/input_items lists them), and a
list of such items (a stored conversation's, then this request's) turned into the chat messages the
chat template renders.

The mapping: a message item is a chat message of its role (text parts joined with newlines, as
chat's content parts are; a user message's `input_image` parts make it chat's text and image_url
parts); `function_call` items are the assistant's tool calls (consecutive calls,
and an assistant message just before them, make one assistant turn); a `function_call_output` is a
tool message answering its call_id; a `reasoning` item's text is the reasoning_content of the
assistant turn that follows it (an assistant turn of its own when none does). Anything else (files,
item references, built-in tool calls, encrypted reasoning) is a 400 naming the item.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

from izh.api.common.chat_protocol import (
    ChatMessageParam,
    ContentPart,
    FunctionCallParam,
    ToolCallParam,
)
from izh.errors import InvalidRequest

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_INPUT_ROLES = ("user", "system", "developer", "assistant")


def new_item_id(kind: str) -> str:
    """A fresh id for an item of type `kind` (msg_..., fc_..., rs_...)."""
    return f"{_ID_PREFIXES[kind]}_{secrets.token_hex(16)}"


def _refuse(param: str, message: str, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code=code)


def _text(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _refuse(f"{param}.{key}", "expected a string")
    return value


def _item_id(item: dict[str, Any], kind: str) -> str:
    value = item.get("id")
    return value if isinstance(value, str) and value else new_item_id(kind)


def normalize_input(
    value: str | list[dict[str, Any]], open_sealed: Callable[[str, str], str] | None = None
) -> list[dict[str, Any]]:
    """`input` as a list of items in OpenAI's shapes (ids added), or a 400 naming what is refused.

    `open_sealed(token, param)`: a reasoning item's encrypted_content, opened (izh.api.responses.reasoning).
    A custom_tool_call is the function call it ran as (arguments {"input": ...}), its output a
    function_call_output."""
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value}, "input.0")]
    items = []
    for index, item in enumerate(value):
        param = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message_item(item, param))
        elif kind == "function_call":
            items.append(
                {
                    "id": _item_id(item, kind),
                    "type": kind,
                    "call_id": _text(item, "call_id", param),
                    "name": _text(item, "name", param),
                    "arguments": _text(item, "arguments", param),
                    "status": "completed",
                }
            )
        elif kind == "custom_tool_call":
            arguments = json.dumps({"input": _text(item, "input", param)}, ensure_ascii=False)
            call = {"call_id": _text(item, "call_id", param), "name": _text(item, "name", param)}
            items.append(
                {
                    "id": _item_id(item, "function_call"),
                    "type": "function_call",
                    **call,
                    "arguments": arguments,
                    "status": "completed",
                }
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            items.append(
                {
                    "id": _item_id(item, "function_call_output"),
                    "type": "function_call_output",
                    "call_id": _text(item, "call_id", param),
                    "output": _output_text(item.get("output"), f"{param}.output"),
                    "status": "completed",
                }
            )
        elif kind == "reasoning":
            items.append(_reasoning_item(item, param, open_sealed))
        else:
            raise _refuse(
                f"{param}.type",
                f"input items of type {kind!r} are not supported; use message, function_call, "
                "function_call_output or reasoning",
                code="unsupported",
            )
    return items


def _message_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _INPUT_ROLES:
        raise _refuse(f"{param}.role", f"expected one of {', '.join(_INPUT_ROLES)}, got {role!r}")
    assistant = role == "assistant"
    content = item.get("content")
    if isinstance(content, str):
        texts: list[str | dict[str, Any]] = [content]
    elif isinstance(content, list):
        texts = [
            _input_image(part, f"{param}.content.{i}")
            if role == "user" and isinstance(part, dict) and part.get("type") == "input_image"
            else _part_text(part, f"{param}.content.{i}", assistant)
            for i, part in enumerate(content)
        ]
    else:
        raise _refuse(f"{param}.content", "expected a string or a list of content parts")
    part_type = "output_text" if assistant else "input_text"
    parts: list[dict[str, Any]] = [
        text if isinstance(text, dict) else {"type": part_type, "text": text} for text in texts
    ]
    if assistant:
        for part in parts:
            part["annotations"] = []
    return {
        "id": _item_id(item, "message"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": parts,
    }


def _input_image(part: dict[str, Any], param: str) -> dict[str, Any]:
    """A user message's input_image part: an image_url (a data: URL, or http(s) where the server allows
    it; checked with chat's image_url parts, izh.api.common.images); file ids are refused."""
    if part.get("file_id") is not None:
        raise _refuse(
            f"{param}.file_id", "file ids are not supported; send the image as image_url", code="unsupported"
        )
    url = part.get("image_url")
    if not isinstance(url, str):
        raise _refuse(f"{param}.image_url", "expected the image's URL (a data: URL)")
    detail = part.get("detail") or "auto"
    return {"type": "input_image", "image_url": url, "detail": detail}


def _part_text(part: Any, param: str, assistant: bool) -> str:
    if not isinstance(part, dict):
        raise _refuse(param, "expected a content part object")
    kind = part.get("type")
    allowed = ("output_text", "input_text", "refusal") if assistant else ("input_text",)
    if kind not in allowed:
        raise _refuse(
            f"{param}.type",
            f"content parts of type {kind!r} are not supported here (text only: {', '.join(allowed)})",
            code="unsupported",
        )
    return _text(part, "refusal" if kind == "refusal" else "text", param)


def _output_text(output: Any, param: str) -> str:
    """A function_call_output's output: a string, or input_text parts joined with newlines."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(_part_text(part, f"{param}.{i}", False) for i, part in enumerate(output))
    raise _refuse(param, "expected a string or a list of input_text parts")


def _reasoning_item(
    item: dict[str, Any], param: str, open_sealed: Callable[[str, str], str] | None
) -> dict[str, Any]:
    sealed = item.get("encrypted_content")
    texts: list[str] = []
    if sealed is not None:
        if not isinstance(sealed, str) or open_sealed is None:
            raise _refuse(f"{param}.encrypted_content", "expected the encrypted_content izh sent")
        texts.append(open_sealed(sealed, f"{param}.encrypted_content"))
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        if texts:
            break  # the sealed text is the reasoning itself
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _refuse(f"{param}.{key}", "expected a list of text parts")
        for i, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type:
                raise _refuse(f"{param}.{key}.{i}", f"expected a part of type {part_type!r}")
            if key == "content" or not texts:  # the summary stands in only for missing content
                texts.append(_text(part, "text", f"{param}.{key}.{i}"))
        if texts:
            break
    return {
        "id": _item_id(item, "reasoning"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "\n".join(texts)}],
        "status": "completed",
    }


def _joined(parts: list[dict[str, Any]], key: str = "text") -> str:
    return "\n".join(part[key] for part in parts)


def _message_content(parts: list[dict[str, Any]]) -> str | list[ContentPart]:
    """A message item's content for chat: its text parts joined, or, with images, chat's typed parts."""
    if all(part["type"] != "input_image" for part in parts):
        return _joined(parts)
    return [
        ContentPart(type="image_url", image_url={"url": part["image_url"], "detail": part["detail"]})
        if part["type"] == "input_image"
        else ContentPart(type="text", text=part["text"])
        for part in parts
    ]


def items_to_messages(items: list[dict[str, Any]]) -> list[ChatMessageParam]:
    """The chat messages of normalized items (see the module docstring for the mapping)."""
    messages: list[ChatMessageParam] = []
    reasoning: str | None = None
    # The assistant turn that function calls join (None once anything else came after it).
    turn: ChatMessageParam | None = None
    for item in items:
        if item["type"] == "custom_tool_call":  # a stored output item: the function call it ran as
            arguments = json.dumps({"input": item["input"]}, ensure_ascii=False)
            item = {**item, "type": "function_call", "arguments": arguments}
        kind = item["type"]
        if kind == "reasoning":
            text = _joined(item["content"])
            reasoning = text if reasoning is None else f"{reasoning}\n{text}"
            continue
        if kind == "function_call":
            call = ToolCallParam(
                id=item["call_id"], function=FunctionCallParam(name=item["name"], arguments=item["arguments"])
            )
            if turn is None or reasoning is not None:
                turn = ChatMessageParam(
                    role="assistant", content=None, tool_calls=[], reasoning_content=reasoning
                )
                reasoning = None
                messages.append(turn)
            assert turn.tool_calls is not None
            turn.tool_calls.append(call)
            continue
        if reasoning is not None and not (kind == "message" and item["role"] == "assistant"):
            messages.append(ChatMessageParam(role="assistant", content="", reasoning_content=reasoning))
            reasoning = None
        turn = None
        if kind == "function_call_output":
            messages.append(
                ChatMessageParam(role="tool", tool_call_id=item["call_id"], content=item["output"])
            )
            continue
        message = ChatMessageParam(
            role=item["role"], content=_message_content(item["content"]), reasoning_content=reasoning
        )
        reasoning = None
        if message.role == "assistant":
            message.tool_calls = []
            turn = message
        messages.append(message)
    if reasoning is not None:
        messages.append(ChatMessageParam(role="assistant", content="", reasoning_content=reasoning))
    for message in messages:
        if message.role == "assistant" and not message.tool_calls:
            message.tool_calls = None
    return messages
