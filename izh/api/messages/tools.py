"""Anthropic's `tools` and `tool_choice` → chat's function tools and tool_choice. Custom tools only; a
deferred one (`defer_loading`) is left out of the prompt, as Anthropic leaves it out of the model's
context, until a `tool_reference` block in a tool result names it (the client's tool search loaded it).
"""

from __future__ import annotations

from typing import Any

import pydantic

from izh.api.common.chat_protocol import (
    FunctionDefinition,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ToolParam,
)
from izh.api.common.errors import validation_error_to_invalid_request
from izh.api.messages.blocks import check_keys, unsupported
from izh.api.messages.protocol import MessageParam
from izh.errors import InvalidRequest


def tool_reference(block: dict[str, Any], param: str) -> str:
    """The tool a tool_reference block loads (a deferred tool, rendered from then on)."""
    check_keys(block, {"type", "tool_name"}, param)
    name = block.get("tool_name")
    if not isinstance(name, str):
        raise InvalidRequest(f"{param}.tool_name: expected the tool's name", param=f"{param}.tool_name")
    return name


def referenced_tools(messages: list[MessageParam]) -> set[str]:
    """The tools named by tool_reference blocks in the conversation's tool results."""
    names: set[str] = set()
    for message in messages:
        if isinstance(message.content, str):
            continue
        for block in message.content:
            content = block.get("content") if isinstance(block, dict) else None
            if block.get("type") != "tool_result" or not isinstance(content, list):
                continue
            names |= {
                part["tool_name"]
                for part in content
                if isinstance(part, dict)
                and part.get("type") == "tool_reference"
                and isinstance(part.get("tool_name"), str)
            }
    return names


def chat_tools(
    tools: list[dict[str, Any]] | None, loaded: set[str] | frozenset[str] = frozenset()
) -> list[ToolParam] | None:
    """The function tools to render: every custom tool but a deferred one (`defer_loading`) that no
    tool_reference has `loaded`."""
    if not tools:
        return None
    out: list[ToolParam] = []
    for index, tool in enumerate(tools):
        param = f"tools.{index}"
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise unsupported(
                f"{param}.type", f"tools of type {kind!r} are not supported here (custom tools only)"
            )
        # eager_input_streaming: izh always streams a call's input as it is written.
        check_keys(
            tool,
            {
                "type",
                "name",
                "description",
                "input_schema",
                "strict",
                "eager_input_streaming",
                "defer_loading",
            },
            param,
        )
        if tool.get("defer_loading") is True and tool.get("name") not in loaded:
            continue
        try:
            function = FunctionDefinition.model_validate(
                {
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": tool.get("input_schema"),
                    "strict": tool.get("strict"),
                }
            )
        except pydantic.ValidationError as exc:
            error = validation_error_to_invalid_request(exc)
            name = (error.param or "").replace("parameters", "input_schema")
            raise InvalidRequest(
                f"{param}.{name}: {error.message.split(': ', 1)[-1]}", param=f"{param}.{name}"
            ) from None
        if function.parameters is None:
            raise InvalidRequest(
                f"{param}.input_schema: a tool needs an input_schema", param=f"{param}.input_schema"
            )
        out.append(ToolParam(function=function))
    return out or None


def chat_tool_choice(
    choice: dict[str, Any] | None, has_tools: bool
) -> tuple[str | NamedToolChoice | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    check_keys(choice, allowed, "tool_choice")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "any", "tool") and not has_tools:
        raise InvalidRequest(f"tool_choice: {kind!r} needs tools", param="tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name: expected the tool's name", param="tool_choice.name")
        return NamedToolChoice(function=NamedToolChoiceFunction(name=name)), parallel
    raise InvalidRequest(
        f"tool_choice.type: expected auto, any, tool or none, got {kind!r}", param="tool_choice.type"
    )
