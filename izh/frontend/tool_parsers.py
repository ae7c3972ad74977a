"""Tool-call parsers: generated text → content and tool calls, streaming and not.

Two formats: Hermes/Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
per turn, text around them) and Llama 3 JSON (`{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`, the whole message). Each parser is a streaming state
machine; `extract` is the same machine fed the whole text, so the two can never disagree, wherever
the deltas split.

A call is emitted only once it is complete and valid (its closing tag or object end seen, its JSON
parsed): markup never reaches content, partial JSON never crashes anything, and a malformed call
is returned as the raw text it was (content) rather than dropped. The cost: a call's arguments
arrive in one fragment when the call completes, not token by token. Arguments are always a JSON
object's text ("{}" for a parameterless call).

Also here: the Hermes tools system prompt (for chat templates that know nothing of tools) and the
grammar that forces well-formed calls for tool_choice "required" or a named tool.
"""

from __future__ import annotations

import json
import math
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from izh.errors import InvalidRequest
from izh.guided_spec import JSON_WHITESPACE_PATTERN, lark_literal, validate_spec
from izh.sampling_params import StructuredOutputsParams

__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "Delta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "collect",
    "detect_tool_parser",
    "new_call_id",
    "render_tools_system_prompt",
    "select_tool_parser",
    "tool_call_grammar",
]

_CALL_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete function call; `arguments` is a JSON object's text."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Plain text for the message's content."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call `index`: the first carries id, type and name (arguments ""), the
    following ones argument fragments that concatenate to the call's arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    """A fresh tool call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_CALL_ID_ALPHABET) for _ in range(24))


def collect(deltas: Sequence[Delta]) -> tuple[str | None, list[ToolCall]]:
    """Content (None when empty) and the complete tool calls that `deltas` add up to."""
    content = "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] = delta.name or call["name"]
            call["arguments"] += delta.arguments
    tool_calls = [ToolCall(call["id"], call["name"], call["arguments"]) for _, call in sorted(calls.items())]
    return content or None, tool_calls


class ToolParser(ABC):
    """A streaming tool-call parser for one generated message: `feed` each new piece of text,
    then `finish` once; `extract` parses a whole message."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text`, appended to what came before, makes certain."""

    @abstractmethod
    def finish(self) -> list[Delta]:
        """The deltas held back so far: the message is complete."""

    @classmethod
    def extract(cls, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content (None when empty) and tool calls of a whole message."""
        parser = cls()
        return collect(parser.feed(text) + parser.finish())

    def _call_deltas(self, name: str, arguments: str) -> list[Delta]:
        index = self._num_calls
        self._num_calls += 1
        return [
            ToolCallDelta(index, id=new_call_id(), type="function", name=name),
            ToolCallDelta(index, arguments=arguments),
        ]


# ---- Hermes / Qwen ------------------------------------------------------------------------------

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with text around them.

    Whitespace around calls collapses: dropped at the message's start and end and between calls;
    between two pieces of content the whitespace before the first call is kept. A block that does not
    hold a valid call stays in the content as written, tags included. A block left open at the
    end (max_tokens, a stop string) still counts when its JSON is complete.
    """

    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # text not yet emitted: a possible tag start, or an open call's body
        self._in_call = False
        self._end_search_from = 0  # where in an open call's body to look for the end tag next
        self._pending_space = ""  # whitespace after content, held until we know what follows
        self._after_call = False  # whitespace right after a call is dropped
        self._has_content = False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        progressed = True
        while progressed:
            progressed = self._close_call(out) if self._in_call else self._open_call(out)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_call:
            body = _strip_partial_suffix(self._buffer, HERMES_END)
            self._resolve_call(body, HERMES_START + self._buffer, out)
        else:
            self._emit_content(self._buffer, out)
        self._buffer, self._in_call = "", False
        if self._pending_space and not self._after_call:
            out.append(ContentDelta(self._pending_space))
        self._pending_space = ""
        return out

    def _open_call(self, out: list[Delta]) -> bool:
        """Emit content up to a start tag (or up to a possible partial one); True on a start tag."""
        start = self._buffer.find(HERMES_START)
        if start < 0:
            keep = _partial_suffix_length(self._buffer, HERMES_START)
            self._emit_content(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._emit_content(self._buffer[:start], out)
        self._buffer = self._buffer[start + len(HERMES_START) :]
        self._in_call, self._end_search_from = True, 0
        return True

    def _close_call(self, out: list[Delta]) -> bool:
        """Resolve the open call if its end tag has arrived; True when it had."""
        end = self._buffer.find(HERMES_END, self._end_search_from)
        if end < 0:
            self._end_search_from = max(0, len(self._buffer) - len(HERMES_END) + 1)
            return False
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(HERMES_END) :]
        self._in_call = False
        self._resolve_call(body, HERMES_START + body + HERMES_END, out)
        return True

    def _resolve_call(self, body: str, raw: str, out: list[Delta]) -> None:
        call = _parse_call(body, ("arguments", "parameters"))
        if call is None:
            self._emit_content(raw, out)
            return
        if not self._has_content:
            self._pending_space = ""
        self._after_call = True
        out.extend(self._call_deltas(*call))

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        """Content, minus whitespace next to calls: trailing whitespace waits for what follows."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_space + text
        stripped = text.rstrip()
        self._pending_space = text[len(stripped) :]
        if stripped:
            out.append(ContentDelta(stripped))
            self._has_content = True


# ---- Llama 3 JSON -------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the message is `{"name": ..., "parameters": {...}}` objects (optionally
    after `<|python_tag|>`, separated by `;`), or it is plain content.

    The message is calls when it starts (after whitespace) with `{` or the tag. From the first
    object that is not a valid call, or text that is not a separator, the rest is content.
    """

    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"  # "undecided" → "calls" | "content"
        self._buffer = ""
        self._scanner = _ObjectScanner()

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self._mode == "content":
            if text:
                out.append(ContentDelta(text))
            return out
        self._buffer += text
        if self._mode == "undecided":
            self._decide(out)
        if self._mode == "calls":
            self._scan_calls(out)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        rest = self._buffer
        if self._mode == "undecided":
            rest = rest.replace(PYTHON_TAG, "", 1) if rest.lstrip().startswith(PYTHON_TAG) else rest
        elif self._mode == "calls" and not self._strip_separator(rest):
            rest = ""  # whitespace (and a last separator) after the calls
        if rest:
            out.append(ContentDelta(rest))
        self._buffer, self._mode = "", "content"
        return out

    def _decide(self, out: list[Delta]) -> None:
        head = self._buffer.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return
        if head.startswith(PYTHON_TAG):
            self._mode, self._buffer = "calls", head[len(PYTHON_TAG) :]
        elif head.startswith("{"):
            self._mode = "calls"
        else:
            self._to_content(out)

    def _scan_calls(self, out: list[Delta]) -> None:
        """Emit every complete call at the buffer's start; switch to content at anything else."""
        while True:
            head = self._strip_separator(self._buffer)
            if not head:
                return
            if not head.startswith("{"):
                self._to_content(out)
                return
            if len(head) != len(self._buffer):
                self._buffer, self._scanner = head, _ObjectScanner()
            end = self._scanner.scan(self._buffer)
            if end is None:
                return
            call = _parse_call(self._buffer[:end], ("parameters", "arguments"))
            if call is None:
                self._to_content(out)
                return
            out.extend(self._call_deltas(*call))
            self._buffer, self._scanner = self._buffer[end:], _ObjectScanner()

    def _strip_separator(self, text: str) -> str:
        """`text` without leading whitespace and, after a call, one `;` separator."""
        head = text.lstrip()
        if self._num_calls and head.startswith(";"):
            head = head[1:].lstrip()
        return head

    def _to_content(self, out: list[Delta]) -> None:
        if self._buffer:
            out.append(ContentDelta(self._buffer))
        self._buffer, self._mode = "", "content"


class _ObjectScanner:
    """Finds the end of the JSON object a text starts with, resuming where the last scan stopped."""

    def __init__(self) -> None:
        self._position = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int | None:
        """The index just past the object's closing brace, or None while it is incomplete."""
        for position in range(self._position, len(text)):
            char = text[position]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return position + 1
        self._position = len(text)
        return None


# ---- shared helpers -----------------------------------------------------------------------------


def _parse_call(text: str, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object's text, or None when it is not a valid call.

    The arguments are the first of `argument_keys` present: an object, a string holding one
    (some models double-encode), or absent/null for a parameterless call ("{}").
    """
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = next((value[key] for key in argument_keys if key in value), None)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant, parse_float=_finite_float)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} overflows a float")
    return number


def _partial_suffix_length(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _strip_partial_suffix(text: str, tag: str) -> str:
    return text[: len(text) - _partial_suffix_length(text, tag)]


# ---- registry -----------------------------------------------------------------------------------

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template's tool format calls for: hermes unless it looks like Llama 3's."""
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def select_tool_parser(name: str, chat_template: str | None) -> type[ToolParser] | None:
    """The parser class for a configured name: "none" → None, "auto" → from the template.

    Raises ValueError for an unknown name, listing the supported ones.
    """
    if name == "none":
        return None
    if name == "auto":
        name = detect_tool_parser(chat_template)
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        supported = ", ".join(["auto", "none", *TOOL_PARSERS])
        raise ValueError(f"unknown tool call parser {name!r}; supported: {supported}")
    return parser


# ---- prompting and forcing calls ----------------------------------------------------------------


def render_tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """A system prompt section describing `tools` (OpenAI tool dicts) in the Hermes format, for
    chat templates that have no tools section of their own."""
    lines = "\n".join(json.dumps(dict(tool), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. Their signatures are listed "
        "below, one JSON object per line, between <tools> and </tools>:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and its arguments between "
        "<tool_call> and </tool_call>, one block per call:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>\n'
        "Call a function only when it helps; otherwise answer directly."
    )


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None = True,
) -> StructuredOutputsParams | None:
    """The grammar forcing `<tool_call>\\n{json}\\n</tool_call>` blocks for tool_choice "required"
    (any of `tools`) or a named tool; None for "auto", "none" or no choice (nothing to force).

    Each block's JSON is `{"name": <a tool's name>, "arguments": <valid against its parameters>}`;
    one block when `parallel_tool_calls` is false, else one or more separated by newlines.
    Raises InvalidRequest naming tool_choice or tools for an unknown tool or invalid parameters.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        chosen = list(functions.values())
    else:
        chosen = [functions[_named_choice(tool_choice, functions)]]
    if not chosen:
        raise InvalidRequest('tool_choice "required" needs at least one tool', param="tools")
    schemas = [_call_schema(function) for function in chosen]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE_PATTERN}
    call = f"{lark_literal(HERMES_START + chr(10))} call_json {lark_literal(chr(10) + HERMES_END)}"
    start = "call" if parallel_tool_calls is False else 'call ("\\n" call)*'
    grammar = f"start: {start}\ncall: {call}\ncall_json: %json {json.dumps(schema, ensure_ascii=False)}\n"
    spec = StructuredOutputsParams(grammar=grammar)
    validate_spec(spec, param="tools")
    return spec


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
    # A parameterless tool takes exactly {}: with open properties a model could invent arguments.
    arguments = (
        dict(parameters)
        if parameters
        else {"type": "object", "properties": {}, "additionalProperties": False}
    )
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
