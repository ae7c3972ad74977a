"""The pythonic tool-call format (Llama 3.2 / Llama 4 templates, vLLM's `pythonic` parser): the message is
a Python list of calls with keyword arguments of literal values,

    [get_weather(city="Paris", days=3), get_time(tz="Europe/Paris")]

optionally between Llama 4's `<|python_start|>` and `<|python_end|>`. A message that starts with `[`
is held back until its list closes; it is calls when Python reads it as a list of such calls (each
emitted whole, its arguments as a JSON object), else it is content as written. Text after the list is
content.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from izh.parsers.tool_calls import ContentDelta, Delta, ToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_SPACE = " \t\r\n"


def _literal(node: ast.expr) -> Any:
    value = ast.literal_eval(node)
    json.dumps(value, allow_nan=False)  # only JSON values (no sets, bytes, complex, nan)
    return value


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def parse_pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call of a `[f(a=1), ...]` list, or None when it is no such list."""
    try:
        tree = ast.parse(text.strip(_SPACE), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted_name(node.func)  # a dotted name (module.function) is kept as written
        if name is None:
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _list_end(text: str, start: int) -> int | None:
    """The index just past the `]` closing the list that opens at `start`, outside Python strings."""
    depth = 0
    quote = ""
    position = start
    while position < len(text):
        char = text[position]
        if quote:
            if char == "\\":
                position += 1
            elif text.startswith(quote, position):
                position += len(quote) - 1
                quote = ""
        elif char in "\"'":
            quote = char * 3 if text.startswith(char * 3, position) else char
            position += len(quote) - 1
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"  # → "list" → "after" (a python_end tag may follow) | "content"
        self._buffer = ""

    def _feed(self, text: str) -> list[Delta]:
        if self._mode == "content":
            return [ContentDelta(text)] if text else []
        self._buffer += text
        out: list[Delta] = []
        if self._mode == "after":
            return self._after_list(final=False)
        if self._mode == "undecided":
            head = self._buffer.lstrip(_SPACE)
            if not head or PYTHON_START.startswith(head):
                return out
            head = head.removeprefix(PYTHON_START).lstrip(_SPACE)
            if not head:
                return out
            if head[0] != "[":
                return self._to_content()
            self._mode = "list"
        return self._read_list(final=False)

    def _finish(self) -> list[Delta]:
        out = self._read_list(final=True) if self._mode == "list" else []
        if self._mode == "after":
            out += self._after_list(final=True)
        if self._buffer and not self.done:
            out.append(ContentDelta(self._buffer))
        self._buffer, self._mode = "", "content"
        return out

    def _read_list(self, *, final: bool) -> list[Delta]:
        head = self._buffer.lstrip(_SPACE).removeprefix(PYTHON_START).lstrip(_SPACE)
        end = _list_end(head, 0)
        if end is None:
            return self._to_content() if final else []
        calls = parse_pythonic_calls(head[:end])
        if calls is None:
            return self._to_content()
        out: list[Delta] = []
        for name, arguments in calls:
            out.extend(self._whole_call(name, arguments))
            if self.done:
                return out
        self._buffer, self._mode = head[end:], "after"
        return out + self._after_list(final=False)

    def _after_list(self, *, final: bool) -> list[Delta]:
        """Drop the python_end tag (and whitespace) after the list; what follows is content."""
        head = self._buffer.lstrip(_SPACE)
        if not final and PYTHON_END.startswith(head):
            return []
        self._buffer = head.removeprefix(PYTHON_END).lstrip(_SPACE)
        return self._to_content()

    def _to_content(self) -> list[Delta]:
        text, self._buffer, self._mode = self._buffer, "", "content"
        return [ContentDelta(text)] if text else []
