"""The JSON text of tool calls, scanned as it grows: a call object's header and end, a whole call
parsed, JSON without its whitespace, a tag's partial suffix (text held back in case it is one), and
the string escapes JSON does not have, repaired.
"""

from __future__ import annotations

import json
import math
from typing import Any


def without_json_space(text: str) -> str:
    """JSON text (or a prefix of it) without the whitespace outside strings."""
    kept: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in _JSON_SPACE:
            continue
        kept.append(char)
    return "".join(kept)


_JSON_SPACE = " \t\r\n"


NAME_KEYS = ("name",)


def call_header(
    text: str, argument_keys: tuple[str, ...], name_keys: tuple[str, ...] = NAME_KEYS
) -> tuple[str, int] | bool:
    """(name, where the arguments object starts) when `text` starts `{"<name key>": "<name>",
    "<key>": {` with the keys among `name_keys` and `argument_keys`; True while `text` could still
    grow into that, else False."""
    name = ""
    position = 0
    for step in ("{", "name key", ":", "name", ",", "arguments key", ":", "arguments"):
        position = _skip_json_space(text, position)
        if position == len(text):
            return True
        if step == "arguments":
            return (name, position) if text[position] == "{" else False
        if step in ("{", ":", ","):
            if text[position] != step:
                return False
            position += 1
            continue
        string = _json_string(text, position)
        if not isinstance(string, tuple):
            return string
        value, position = string
        if step == "name":
            if not value:
                return False
            name = value
        elif value not in (name_keys if step == "name key" else argument_keys):
            return False
    raise AssertionError("unreachable: the last step returns")


def _skip_json_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in _JSON_SPACE:
        position += 1
    return position


def _json_string(text: str, start: int) -> tuple[str, int] | bool:
    """(value, end) of the JSON string at `start`; True while it is unclosed, False if it is none."""
    if text[start] != '"':
        return False
    position = start + 1
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2
        elif char == '"':
            try:
                return json.loads(text[start : position + 1]), position + 1
            except ValueError:
                return False
        else:
            position += 1
    return True


class ObjectScanner:
    """Finds the end of the JSON object that starts at `start` in a growing text, resuming where the
    last scan stopped."""

    def __init__(self, start: int = 0) -> None:
        self._position = start
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


def parse_call(
    text: str, argument_keys: tuple[str, ...], name_keys: tuple[str, ...] = NAME_KEYS
) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object's text, or None when it is not a valid call.

    The name is the first of `name_keys` present. The arguments are the first of `argument_keys`
    present: an object, a string holding one (some models double-encode), or absent/null for a
    parameterless call ("{}"). Escapes JSON lacks (`\\'`) are repaired first (`EscapeRepair`).
    """
    try:
        value = json.loads(repair_escapes(text), parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name = next((value[key] for key in name_keys if key in value), None)
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


def partial_suffix_length(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def strip_partial_suffix(text: str, tag: str) -> str:
    return text[: len(text) - partial_suffix_length(text, tag)]


_JSON_ESCAPES = frozenset('"\\/bfnrtu')


class EscapeRepair:
    """Rewrites the escapes JSON lacks inside the strings of JSON text fed piece by piece.

    Models trained on Python and shell write `\\'` inside JSON strings (`"print(\\'hi\\')"`), which
    no JSON parser takes, so the client would get arguments it cannot read. `\\'` becomes `'`, what
    the model meant; a backslash before any other character JSON does not escape becomes an escaped
    backslash (`\\d` → `\\\\d`), keeping the character the model wrote. Valid JSON passes unchanged. A
    backslash that ends a piece is held until the next piece shows what it escapes (`finish` gives
    it back as an escaped backslash if no piece follows).
    """

    def __init__(self) -> None:
        self._in_string = False
        self._backslash = False  # a backslash was read, its escaped character not yet

    def feed(self, text: str) -> str:
        out: list[str] = []
        for char in text:
            if self._backslash:
                self._backslash = False
                if char in _JSON_ESCAPES:
                    out.append("\\" + char)
                elif char == "'":
                    out.append(char)
                else:
                    out.append("\\\\" + char)
            elif self._in_string and char == "\\":
                self._backslash = True
            else:
                if char == '"':
                    self._in_string = not self._in_string
                out.append(char)
        return "".join(out)

    def finish(self) -> str:
        held, self._backslash = self._backslash, False
        return "\\\\" if held else ""


def repair_escapes(text: str) -> str:
    """`text` with the escapes JSON lacks repaired (see `EscapeRepair`)."""
    repair = EscapeRepair()
    return repair.feed(text) + repair.finish()
