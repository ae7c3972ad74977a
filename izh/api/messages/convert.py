"""An Anthropic Messages request → the chat request it means (izh.api.protocol.ChatCompletionRequest),
so that chat's `prepare_chat` renders, constrains and admits it and chat's parsers read its output.

- `system` (a string or text blocks) → a system message first; a `system` turn within `messages` → a
  system message where it stands;
- a user message's text and image blocks → a user message of text and image_url parts (base64 sources
  as data URLs, url sources as they are: izh.api.images allows them only with
  `limits.allow_remote_images`); its `tool_result` blocks → tool messages, in order (text content only;
  `is_error` results start with "Error: ");
- an assistant message's text → content, `tool_use` blocks → tool calls (their ids kept), `thinking`
  blocks → reasoning_content (an empty one, as `display: "omitted"` returns them, is read back from
  its sealed `signature`);
- `context_management.edits`: `clear_thinking_20251015` drops the thinking of all but the `keep` most
  recent assistant turns (default 1; "all" keeps every one) before rendering; other edits are a 400;
- `tools` (custom tools: name, description, input_schema) → function tools, except those with
  `defer_loading` (left out of the prompt, as Anthropic leaves them out of the model's context) until a
  `tool_reference` block in a tool result names one (the client's tool search loaded it); `tool_choice` auto → auto,
  any → required, tool → the named function, none → none; `disable_parallel_tool_use` →
  parallel_tool_calls false;
- `stop_sequences` → stop, `max_tokens`, `temperature`, `top_p`, `top_k` as they are;
- `output_config.format` (a JSON schema) → response_format json_schema (grammar-enforced); `effort`
  changes nothing (izh sets no thinking budget: izh.api.messages.protocol.OutputConfig);
- `thinking` disabled → the template's `enable_thinking: false` (Qwen3's switch); adaptive → the
  model's default. Enabled needs a reasoning model (a reasoning parser): else a 400. Its `budget_tokens`
  is checked as Anthropic checks it (at least 1024, below max_tokens); izh bounds thinking and answer
  together by max_tokens only.

`cache_control` on blocks and tools is accepted and needs nothing: the prefix cache serves a repeated
prefix whatever the client marks. Every other block type, tool type or field is a 400 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic

from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    ContentPart,
    FunctionCallParam,
    ToolCallParam,
)
from izh.api.common.errors import validation_error_to_invalid_request
from izh.api.common.protocol import JsonSchemaFormat, ResponseFormat
from izh.api.messages.blocks import as_block, check_keys, text_of, unsupported
from izh.api.messages.protocol import CountTokensRequest, MessageParam, MessagesRequest
from izh.api.messages.tools import chat_tool_choice, chat_tools, referenced_tools, tool_reference
from izh.errors import InvalidRequest

MIN_THINKING_BUDGET_TOKENS = 1024
"""Anthropic's lower bound on thinking.budget_tokens."""
CLEAR_THINKING = "clear_thinking_20251015"
"""The context edit that drops old thinking (Anthropic's name, versioned by date)."""

OpenSignature = Callable[[str, str], str]
"""Opens a thinking block's sealed signature (token, param) into its text; a 400 when it is not izh's."""


@dataclass(slots=True)
class Conversion:
    """What converting a body found beyond the chat request: the thinking a context edit cleared."""

    cleared_thinking: list[str] = field(default_factory=list)
    """The thinking texts `clear_thinking_20251015` dropped, one per cleared assistant turn."""
    context_edits: bool = False
    """The body asked for context edits (its response then reports `context_management`)."""


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    """The system prompt's text (text blocks joined by newlines), or None."""
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for index, value in enumerate(system):
        block = as_block(value, f"system.{index}")
        if block["type"] != "text":
            raise unsupported(f"system.{index}.type", f"system blocks must be text, got {block['type']!r}")
        texts.append(text_of(block, f"system.{index}"))
    return "\n".join(texts) or None


def _image_part(block: dict[str, Any], param: str) -> ContentPart:
    check_keys(block, {"type", "source"}, param)
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest(f"{param}.source: an image block needs a source", param=f"{param}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise InvalidRequest(
                f"{param}.source: a base64 source needs media_type and data", param=f"{param}.source"
            )
        url = f"data:{media_type};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise unsupported(f"{param}.source.type", f"image sources of type {kind!r} are not supported")
    return ContentPart(type="image_url", image_url={"url": url})


def _tool_result(block: dict[str, Any], param: str) -> ChatMessageParam:
    check_keys(block, {"type", "tool_use_id", "content", "is_error"}, param)
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise InvalidRequest(f"{param}.tool_use_id: expected a string", param=f"{param}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for index, value in enumerate(content):
            where = f"{param}.content.{index}"
            part = as_block(value, where)
            if part["type"] == "tool_reference":
                texts.append(f"Tool loaded: {tool_reference(part, where)}")
                continue
            if part["type"] != "text":
                raise unsupported(
                    f"{where}.type",
                    f"tool results may hold text and tool_reference blocks only, got {part['type']!r}",
                )
            texts.append(text_of(part, where))
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise InvalidRequest(f"{param}.content: expected a string or text blocks", param=f"{param}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return ChatMessageParam(role="tool", content=content, tool_call_id=tool_use_id)


def _user_messages(message: MessageParam, param: str) -> list[ChatMessageParam]:
    """A user message as chat messages: tool results as tool messages, the rest as user messages."""
    if isinstance(message.content, str):
        return [ChatMessageParam(role="user", content=message.content)]
    out: list[ChatMessageParam] = []
    parts: list[ContentPart] = []
    for index, value in enumerate(message.content):
        where = f"{param}.content.{index}"
        block = as_block(value, where)
        kind = block["type"]
        if kind == "tool_result":
            if parts:
                out.append(ChatMessageParam(role="user", content=parts))
                parts = []
            out.append(_tool_result(block, where))
        elif kind == "text":
            parts.append(ContentPart(type="text", text=text_of(block, where)))
        elif kind == "image":
            parts.append(_image_part(block, where))
        else:
            raise unsupported(
                f"{where}.type",
                f"user content blocks of type {kind!r} are not supported (text, image, tool_result)",
            )
    if parts:
        out.append(ChatMessageParam(role="user", content=parts))
    return out


def _system_turn_text(message: MessageParam, param: str) -> str:
    """A system turn within the conversation (a string or text blocks) as one text."""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for index, value in enumerate(message.content):
        where = f"{param}.content.{index}"
        block = as_block(value, where)
        if block["type"] != "text":
            raise unsupported(f"{where}.type", f"system turns hold text blocks only, got {block['type']!r}")
        texts.append(text_of(block, where))
    return "\n".join(texts)


def _with_reminders(message: ChatMessageParam, reminders: list[str], *, after: bool) -> ChatMessageParam:
    """A user message with system turns' texts after (or before) its own content, each as a
    <system-reminder>."""
    parts = [
        ContentPart(type="text", text=f"<system-reminder>\n{text}\n</system-reminder>\n")
        for text in reminders
    ]
    content = message.content
    own = [ContentPart(type="text", text=content)] if isinstance(content, str) else list(content or [])
    return message.model_copy(update={"content": own + parts if after else parts + own})


def _fold_system_turns(messages: list[ChatMessageParam | str]) -> list[ChatMessageParam]:
    """Chat messages with the conversation's system turns (the strings) joined to a user turn: the user
    message just before one (after its text, where the turn stood), else the next user message (before
    its text), each as a <system-reminder> (how Claude Code itself sends its reminders); a system turn
    with no user message beside it stays a system message. Chat templates mostly know one system
    message, at the start (Gemma's and Mistral's refuse any other), and a small model reads a system
    message just before its reply as text to continue; a user message keeps the order and the prefix
    cache (earlier turns render the same)."""
    out: list[ChatMessageParam] = []
    pending: list[str] = []
    index = 0
    while index < len(messages):
        item = messages[index]
        if isinstance(item, str):
            turns = []
            while index < len(messages) and isinstance(messages[index], str):
                turns.append(messages[index])
                index += 1
            texts = [text for text in turns if isinstance(text, str)]
            if out and out[-1].role == "user" and not pending:
                out[-1] = _with_reminders(out[-1], texts, after=True)
            else:
                pending += texts
            continue
        if pending and item.role == "user":
            item = _with_reminders(item, pending, after=False)
            pending = []
        elif pending and item.role != "tool":
            out += [ChatMessageParam(role="system", content=text) for text in pending]
            pending = []
        out.append(item)
        index += 1
    out += [ChatMessageParam(role="system", content=text) for text in pending]
    return out


def _thinking_text(block: dict[str, Any], where: str, open_signature: OpenSignature | None) -> str:
    """A thinking block's text; an empty one (display "omitted") is read back from its signature."""
    check_keys(block, {"type", "thinking", "signature"}, where)
    text = block.get("thinking")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.thinking: expected a string", param=f"{where}.thinking")
    signature = block.get("signature")
    if not text and isinstance(signature, str) and signature and open_signature is not None:
        return open_signature(signature, f"{where}.signature")
    return text


def _assistant_message(
    message: MessageParam, param: str, open_signature: OpenSignature | None, keep_thinking: bool
) -> tuple[ChatMessageParam, str | None]:
    """The chat message, and the thinking dropped from it when `keep_thinking` is False (a context
    edit cleared it; None when there was none)."""
    if isinstance(message.content, str):
        return ChatMessageParam(role="assistant", content=message.content), None
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCallParam] = []
    for index, value in enumerate(message.content):
        where = f"{param}.content.{index}"
        block = as_block(value, where)
        kind = block["type"]
        if kind == "text":
            texts.append(text_of(block, where))
        elif kind == "thinking":
            thoughts.append(_thinking_text(block, where, open_signature))
        elif kind == "tool_use":
            check_keys(block, {"type", "id", "name", "input"}, where)
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise InvalidRequest(f"{where}: a tool_use block needs an id and a name", param=where)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise InvalidRequest(f"{where}.input: expected an object", param=f"{where}.input")
            calls.append(
                ToolCallParam(
                    id=block["id"],
                    function=FunctionCallParam(name=block["name"], arguments=json.dumps(arguments)),
                )
            )
        else:
            raise unsupported(
                f"{where}.type",
                f"assistant content blocks of type {kind!r} are not supported (text, thinking, tool_use)",
            )
    thinking = "".join(thoughts) if thoughts else None
    dropped = None if keep_thinking else thinking
    chat = ChatMessageParam(
        role="assistant",
        content="".join(texts),
        tool_calls=calls or None,
        reasoning_content=thinking if keep_thinking else None,
    )
    return chat, dropped


def _thinking_turns_kept(body: CountTokensRequest | MessagesRequest) -> int | None:
    """How many of the latest assistant turns keep their thinking (None: all), by the body's
    `clear_thinking_20251015` edit; any other edit is a 400."""
    config = body.context_management
    kept: int | None = None
    for index, edit in enumerate(config.edits if config is not None else []):
        param = f"context_management.edits.{index}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != CLEAR_THINKING:
            raise unsupported(
                f"{param}.type", f"context edits of type {kind!r} are not supported here ({CLEAR_THINKING})"
            )
        check_keys(edit, {"type", "keep"}, param)
        keep = edit.get("keep")
        if keep is None:
            keep = {"type": "thinking_turns", "value": 1}  # Anthropic's default: the latest turn
        if keep == "all":
            continue
        value = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidRequest(
                f'{param}.keep: expected "all" or {{"type": "thinking_turns", "value": N}} with N >= 1',
                param=f"{param}.keep",
            )
        kept = value if kept is None else min(kept, value)
    return kept


def chat_messages(
    body: CountTokensRequest | MessagesRequest,
    open_signature: OpenSignature | None = None,
    conversion: Conversion | None = None,
) -> list[ChatMessageParam]:
    """The conversation as chat messages; `conversion` collects the thinking a context edit cleared."""
    messages: list[ChatMessageParam | str] = []
    system = system_text(body.system)
    if system is not None:
        messages.append(ChatMessageParam(role="system", content=system))
    kept_turns = _thinking_turns_kept(body)
    assistant_indexes = [i for i, message in enumerate(body.messages) if message.role == "assistant"]
    keep_from = (
        0 if kept_turns is None or kept_turns >= len(assistant_indexes) else assistant_indexes[-kept_turns]
    )
    for index, message in enumerate(body.messages):
        param = f"messages.{index}"
        if message.role == "user":
            messages.extend(_user_messages(message, param))
        elif message.role == "system":
            messages.append(_system_turn_text(message, param))
        else:
            chat, dropped = _assistant_message(message, param, open_signature, index >= keep_from)
            messages.append(chat)
            if dropped is not None and conversion is not None:
                conversion.cleared_thinking.append(dropped)
    return _fold_system_turns(messages)


def check_thinking(body: CountTokensRequest | MessagesRequest, reasoning: bool) -> dict[str, Any] | None:
    """The template kwargs `thinking` asks for (None: the model's default)."""
    thinking = body.thinking
    if thinking is None:
        return None
    if thinking.type == "adaptive":
        return None
    if thinking.type == "disabled":
        if thinking.budget_tokens is not None:
            raise InvalidRequest(
                "thinking.budget_tokens: only with thinking enabled", param="thinking.budget_tokens"
            )
        return {"enable_thinking": False}
    if not reasoning:
        raise unsupported("thinking", "this model does not think (no reasoning parser is configured)")
    budget = thinking.budget_tokens
    if budget is None or budget < MIN_THINKING_BUDGET_TOKENS:
        raise InvalidRequest(
            f"thinking.budget_tokens: must be at least {MIN_THINKING_BUDGET_TOKENS}",
            param="thinking.budget_tokens",
        )
    if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
        raise InvalidRequest(
            "thinking.budget_tokens: must be less than max_tokens", param="thinking.budget_tokens"
        )
    return None


def _response_format(body: CountTokensRequest | MessagesRequest) -> ResponseFormat | None:
    config = body.output_config
    if config is None or config.format is None:
        return None
    schema = JsonSchemaFormat.model_validate({"name": "output", "schema": config.format.schema_})
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(
    body: CountTokensRequest | MessagesRequest,
    reasoning: bool,
    open_signature: OpenSignature | None = None,
    conversion: Conversion | None = None,
) -> ChatCompletionRequest:
    """The chat request `body` means (`reasoning`: the server parses the model's thinking;
    `open_signature` reads back thinking sent with display "omitted"; `conversion` collects what
    the context edits cleared)."""
    tools = chat_tools(body.tools, referenced_tools(body.messages))
    tool_choice, parallel = chat_tool_choice(body.tool_choice, bool(body.tools))
    if tools is None and tool_choice is not None:
        # Every tool is deferred and none loaded yet: nothing to call.
        if tool_choice not in ("auto", "none"):
            raise InvalidRequest(
                "tool_choice: every tool is deferred (defer_loading) and none is loaded yet",
                param="tool_choice",
            )
        tool_choice, parallel = None, None
    if conversion is not None:
        conversion.context_edits = body.context_management is not None
    fields: dict[str, Any] = {
        "messages": chat_messages(body, open_signature, conversion),
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": check_thinking(body, reasoning),
        "response_format": _response_format(body),
    }
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
        }
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as exc:
        raise validation_error_to_invalid_request(exc) from None
