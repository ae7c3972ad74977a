"""The tool-call formats that write JSON calls after a marker: Mistral (`[TOOL_CALLS]`, both its JSON
array and its newer `name[ARGS]{...}` form), Granite (`<|tool_call|>[...]`) and Phi-4-mini
(`functools[...]`). The machine is izh.parsers.sectioned's.

- Mistral v0.3 (Mistral-7B-Instruct-v0.3, Mixtral, Nemo): `[TOOL_CALLS] [{"name": "get_weather",
  "arguments": {"city": "Paris"}}, ...]`;
  Mistral Small 3.2 / Magistral / Devstral (tokenizer v11+): `[TOOL_CALLS]get_weather[ARGS]{"city":
  "Paris"}`, one marker per call (a `[CALL_ID]id` before `[ARGS]` is read too, its id not kept);
- Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}]` (`<tool_call>` too, as vLLM reads it);
- Phi-4-mini: `functools[{"name": ..., "arguments": {...}}]`.
"""

from __future__ import annotations

import re

from izh.parsers.sectioned import JsonArraySection
from izh.parsers.tool_calls import Delta
from izh.parsers.tool_json import ObjectScanner

MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
GRANITE_TOOL_CALL = "<|tool_call|>"
PHI4_FUNCTOOLS = "functools"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_MAX_NAME_CHARS = 256
_SPACE = " \t\r\n"


class GraniteToolParser(JsonArraySection):
    name = "granite"
    START_MARKERS = (GRANITE_TOOL_CALL, "<tool_call>")


class Phi4MiniJsonToolParser(JsonArraySection):
    name = "phi4_mini_json"
    START_MARKERS = (PHI4_FUNCTOOLS + "[", PHI4_FUNCTOOLS + " [")

    def _open_section(self, out: list[Delta]) -> bool:
        opened = super()._open_section(out)
        if opened:
            # The marker ends with the array's bracket: it belongs to the section.
            self._buffer = self._raw = "[" + self._buffer
            self._marker = self._marker[:-1]
        return opened


class MistralToolParser(JsonArraySection):
    """`[TOOL_CALLS]` then a JSON array (v0.3) or `name[ARGS]{...}` calls (v11+)."""

    name = "mistral"
    START_MARKERS = (MISTRAL_TOOL_CALLS,)

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"  # → "array" | "named"
        self._named_open = False  # a named call's arguments are being read
        self._emitted = 0  # how much of the open named call's arguments went out
        self._args_scanner = ObjectScanner()

    def _close_section(self) -> None:
        self._mode, self._named_open = "undecided", False
        super()._close_section()

    def _give_up(self, out: list[Delta]) -> None:
        self._mode, self._named_open = "undecided", False
        super()._give_up(out)

    def _section(self, out: list[Delta], *, final: bool) -> None:
        if self._mode == "undecided":
            head = self._buffer.lstrip(_SPACE)
            if not head:
                if final:
                    self._give_up(out)
                return
            self._mode = "array" if head[0] in "[{" else "named"
        if self._mode == "array":
            super()._section(out, final=final)
        else:
            self._read_named(out, final=final)

    def _read_named(self, out: list[Delta], *, final: bool) -> None:
        if not self._named_open:
            end = self._buffer.find(MISTRAL_ARGS)
            if end < 0:
                if final or len(self._buffer) > _MAX_NAME_CHARS:
                    self._stop_named(out)
                return
            name = self._buffer[:end].split(MISTRAL_CALL_ID)[0].strip(_SPACE)
            if _NAME.fullmatch(name) is None:
                self._stop_named(out)
                return
            self._buffer = self._buffer[end + len(MISTRAL_ARGS) :].lstrip(_SPACE)
            out.extend(self._begin_call(name))
            self._named_open, self._emitted, self._args_scanner = True, 0, ObjectScanner()
            self._count_call()
            if self.done:
                return
        if not self._buffer:
            if final:
                out.extend(self._end_call(complete=False))
                self._close_section()
            return
        if self._buffer[0] != "{":  # no arguments object: a parameterless call
            out.extend(self._call_arguments("{}") + self._end_call())
            self._after_named_call()
            return
        args_end = self._args_scanner.scan(self._buffer)
        stop = len(self._buffer) if args_end is None else args_end
        if stop > self._emitted:
            out.extend(self._call_arguments(self._buffer[self._emitted : stop]))
            self._emitted = stop
        if args_end is None:
            if final:
                out.extend(self._end_call(complete=False))
                self._close_section()
            return
        out.extend(self._end_call())
        self._buffer = self._buffer[args_end:]
        self._after_named_call()

    def _after_named_call(self) -> None:
        self._named_open, self._emitted = False, 0
        head = self._buffer.lstrip(_SPACE)
        if head.startswith(MISTRAL_TOOL_CALLS):
            self._buffer = head[len(MISTRAL_TOOL_CALLS) :]
            return
        self._close_section()

    def _stop_named(self, out: list[Delta]) -> None:
        if self._section_calls:
            self._close_section()
        else:
            self._give_up(out)
