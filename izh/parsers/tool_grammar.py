"""Forcing tool calls (tool_choice "required" or a named tool): a grammar of Hermes blocks whose JSON
matches a tool's parameters, and nothing else. With tool_choice "auto" (`auto_tool_call_grammar`):
either text without a `<tool_call>` tag, or text then such blocks, so a call the model starts is
always well-formed and never left as text.

A named tool gets exactly one call (OpenAI's behaviour), after which the grammar ends, and so does
the message. "required" gets one call, or with parallel calls allowed one or more separated by
newlines. The grammar cannot forbid a repeated call (it is fixed before the first token): the
parser ends the message at one instead (izh.parsers.tool_calls, `limit_calls`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from izh.errors import InvalidRequest
from izh.guided_spec import JSON_WHITESPACE_PATTERN, close_objects, lark_literal, validate_spec
from izh.parsers.hermes import HERMES_END, HERMES_START
from izh.sampling_params import StructuredOutputsParams


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None = True,
) -> StructuredOutputsParams | None:
    """The grammar forcing `<tool_call>\\n{json}\\n</tool_call>` blocks for tool_choice "required"
    (any of `tools`) or a named tool; None for "auto", "none" or no choice (nothing to force).

    Each block's JSON is `{"name": <a tool's name>, "arguments": <valid against its parameters>}`.
    A named tool gets exactly one block; "required" one when `parallel_tool_calls` is false, else
    one or more separated by newlines. Raises InvalidRequest naming tool_choice or tools for an
    unknown tool or invalid parameters.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = _functions(tools)
    named = tool_choice != "required"
    chosen = [functions[_named_choice(tool_choice, functions)]] if named else list(functions.values())
    if not chosen:
        raise InvalidRequest('tool_choice "required" needs at least one tool', param="tools")
    schemas = [_call_schema(function) for function in chosen]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE_PATTERN}
    call = f"{lark_literal(HERMES_START + chr(10))} call_json {lark_literal(chr(10) + HERMES_END)}"
    start = "call" if named or parallel_tool_calls is False else 'call ("\\n" call)*'
    grammar = f"start: {start}\ncall: {call}\ncall_json: %json {json.dumps(schema, ensure_ascii=False)}\n"
    spec = StructuredOutputsParams(grammar=grammar)
    validate_spec(spec, param="tools")
    return spec


def auto_tool_call_grammar(
    tools: Sequence[Mapping[str, Any]] | None, parallel_tool_calls: bool | None = True
) -> StructuredOutputsParams | None:
    """tool_choice "auto" in Hermes' format: a plain answer (any text without the start tag), or
    any text, then the start tag opening calls as `tool_call_grammar` forces them for "required"
    (one, or with parallel calls one or more separated by newlines), and nothing after them.
    None without tools. Raises InvalidRequest naming tools for invalid parameters.
    """
    functions = _functions(tools)
    if not functions:
        return None
    schemas = [_call_schema(function) for function in functions.values()]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE_PATTERN}
    tag = _lark_regex_text(HERMES_START)
    close = lark_literal("\n" + HERMES_END)
    more = "" if parallel_tool_calls is False else f'("\\n" {lark_literal(HERMES_START)} call)*'
    grammar = "\n".join(
        [
            f"start: IZH_PLAIN | izh_text_then_tag call {more}",
            f'call: "\\n" call_json {close}',
            # The plain answer has no start tag anywhere; the lazy lexeme ends at the first one.
            rf"IZH_PLAIN: /(.|\n)*/ & ~/(.|\n)*{tag}(.|\n)*/",
            rf"izh_text_then_tag[lazy]: /(.|\n)*{tag}/",
            f"call_json: %json {json.dumps(schema, ensure_ascii=False)}",
        ]
    )
    spec = StructuredOutputsParams(grammar=grammar + "\n")
    validate_spec(spec, param="tools")
    return spec


def _lark_regex_text(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join(f"\\{char}" if char in _REGEX_SPECIAL else char for char in text)


_REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|/-")


def _functions(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Tool name → its "function" object, checking the shape the grammar relies on."""
    functions: dict[str, Mapping[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequest("each tool needs a function with a name", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequest(
                f"tool {function['name']!r}: parameters must be a JSON schema object", param="tools"
            )
        functions[function["name"]] = function
    return functions


def _named_choice(tool_choice: str | Mapping[str, Any], functions: Mapping[str, Any]) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in functions:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return name


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    # A parameterless tool takes exactly {}, and listed properties are all an object takes (unless
    # the schema opens it): with open objects a model invents arguments until max_tokens.
    arguments = (
        close_objects(dict(parameters))
        if parameters
        else {"type": "object", "properties": {}, "additionalProperties": False}
    )
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
