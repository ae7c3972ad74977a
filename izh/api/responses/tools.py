"""A Responses request's `tools` as chat's function tools.

- `function` tools are chat's function tools.
- `namespace` tools (a named group of function tools, as Codex sends its sub-agent tools) are
  flattened into their function tools under their own names; a call to one comes back as a
  `function_call` item with that name and the namespace in its `namespace` field.
- `custom` (freeform) tools without a grammar become a function taking one string, `input`; a call
  comes back as a `custom_tool_call` item whose `input` is that string. A custom tool with a grammar
  (lark or regex) is skipped like a hosted tool: its input would need a grammar inside a JSON
  string, which izh cannot enforce.
- Hosted tools izh cannot run (web_search, file_search, code_interpreter, computer_use,
  image_generation, mcp, local_shell, ...) are skipped, logged, and named in the response's
  `x-izh-skipped-tools` header, unless `limits.strict_tools` asks for a 400 naming the tool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pydantic

from izh.api.common.chat_protocol import FunctionDefinition, ToolParam
from izh.api.common.errors import validation_error_to_invalid_request
from izh.errors import InvalidRequest

logger = logging.getLogger(__name__)

SKIPPED_TOOLS_HEADER = "x-izh-skipped-tools"
_CUSTOM_INPUT = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's input, as free text."}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass(slots=True)
class ResponsesTools:
    """The request's tools for chat, as the Response echoes them, and what maps calls back."""

    chat: list[ToolParam] = field(default_factory=list)
    echoed: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)
    """A flattened function's name → its namespace."""
    custom: set[str] = field(default_factory=set)
    """Names of the custom tools (their calls are custom_tool_call items)."""
    skipped: list[str] = field(default_factory=list)
    """The tools izh cannot run, by type (or name for a custom tool with a grammar)."""


def responses_tools(tools: list[dict[str, Any]] | None, *, strict: bool, request_id: str) -> ResponsesTools:
    """Chat's tools for `tools` (see the module docstring); with `strict`, a tool izh cannot run is a
    400 naming it instead of being skipped."""
    out = ResponsesTools()
    for index, tool in enumerate(tools or []):
        kind = tool.get("type")
        param = f"tools.{index}"
        if kind == "function":
            function = _function(tool, param)
            out.chat.append(function)
            out.echoed.append({"type": "function", **function.function.model_dump()})
        elif kind == "namespace":
            namespace = tool.get("name")
            members = tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(members, list):
                raise InvalidRequest(
                    f"{param}: a namespace tool needs a name and a list of tools", param=param
                )
            for position, member in enumerate(members):
                member_param = f"{param}.tools.{position}"
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise InvalidRequest(
                        f"{member_param}.type: a namespace holds function tools", param=f"{member_param}.type"
                    )
                function = _function(member, member_param)
                out.chat.append(function)
                out.namespaces[function.function.name] = namespace
            out.echoed.append(tool)
        elif kind == "custom" and _freeform(tool):
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(f"{param}.name: a custom tool needs a name", param=f"{param}.name")
            fields = {"name": name, "description": tool.get("description"), "parameters": _CUSTOM_INPUT}
            out.chat.append(_function(fields, param))
            out.custom.add(name)
            out.echoed.append(tool)
        else:
            label = f"custom:{tool.get('name')}" if kind == "custom" else str(kind)
            if strict:
                raise InvalidRequest(
                    f"{param}.type: izh cannot run {label!r} tools (limits.strict_tools is on; off, they "
                    "are skipped)",
                    param=f"{param}.type",
                    code="unsupported",
                )
            out.skipped.append(label)
    if out.skipped:
        logger.warning("[%s] responses: skipped tools izh cannot run: %s", request_id, ", ".join(out.skipped))
    return out


def _freeform(tool: dict[str, Any]) -> bool:
    """A custom tool whose input is free text (no grammar to hold it to)."""
    fmt = tool.get("format")
    return fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")


def _function(tool: dict[str, Any], param: str) -> ToolParam:
    fields = {key: tool.get(key) for key in ("name", "description", "parameters", "strict")}
    try:
        function = FunctionDefinition.model_validate(fields)
    except pydantic.ValidationError as exc:
        error = validation_error_to_invalid_request(exc)
        error_param = f"{param}.{error.param}" if error.param else param
        raise InvalidRequest(f"{param}.{error.message}", param=error_param) from None
    return ToolParam(function=function)
