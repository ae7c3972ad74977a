"""The Qwen3-Coder tool-call format (its chat template's XML):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A call begins at `<function=NAME>` (inside `<tool_call>`, or bare, as vLLM also reads it); its
arguments stream as a JSON object, one `"key": value` member per complete parameter, closed at
`</function>`. A parameter's value is the text between its tags without the one newline on each side;
it is read as JSON when it is a JSON number, boolean, null, object or array (the template writes
non-string values with `tojson`), else it is a string. (vLLM types values by the tool's schema; a
string parameter whose value reads as a number comes out as a number here.)
"""

from __future__ import annotations

import json
import re
from typing import Any

from izh.parsers.sectioned import SectionedToolParser
from izh.parsers.tool_calls import Delta

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
_HEAD = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_SPACE = " \t\r\n"
_MAX_HEAD_CHARS = 512


def parameter_value(text: str) -> Any:
    """A parameter's text as the call's argument value (see the module docstring)."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


class Qwen3CoderToolParser(SectionedToolParser):
    name = "qwen3_coder"
    START_MARKERS = (TOOL_CALL_START, FUNCTION_START)

    def __init__(self) -> None:
        super().__init__()
        self._call_open = False
        self._num_members = 0

    def _open_section(self, out: list[Delta]) -> bool:
        opened = super()._open_section(out)
        if opened and self._marker == FUNCTION_START:
            self._buffer = self._raw = FUNCTION_START + self._buffer  # a bare call: the marker is its head
            self._marker = ""
        return opened

    def _section(self, out: list[Delta], *, final: bool) -> None:
        while self._in_section and not self.done:
            head = self._buffer.lstrip(_SPACE)
            if not self._call_open:
                if head.startswith(TOOL_CALL_END):
                    self._buffer = head[len(TOOL_CALL_END) :]
                    self._close_section()
                    return
                match = _HEAD.match(head)
                if match is None:
                    could_grow = (
                        FUNCTION_START.startswith(head)
                        or (
                            head.startswith(FUNCTION_START)
                            and ">" not in head
                            and len(head) < _MAX_HEAD_CHARS
                        )
                        or TOOL_CALL_END.startswith(head)
                    )
                    if not (could_grow and not final):
                        self._stop(out)
                    return
                out.extend(self._begin_call(match[1].strip()))
                self._count_call()
                self._buffer, self._call_open, self._num_members = head[match.end() :], True, 0
                if self.done:
                    return
                out.extend(self._call_arguments("{"))
                continue
            if head.startswith(FUNCTION_END):
                out.extend(self._call_arguments("}") + self._end_call())
                self._buffer, self._call_open = head[len(FUNCTION_END) :], False
                continue
            match = _PARAMETER.match(head)
            if match is None:
                could_grow = (
                    PARAMETER_START.startswith(head)
                    or (head.startswith(PARAMETER_START) and PARAMETER_END not in head)
                    or FUNCTION_END.startswith(head)
                )
                if could_grow and not final:
                    return
                # Cut off (final) or no parameter: the call ends with the members it has.
                out.extend(self._call_arguments("}") + self._end_call(complete=not final))
                self._call_open = False
                if final:
                    self._buffer = ""  # a tag cut off with the call
                self._close_section()
                return
            member = (
                json.dumps(match[1].strip())
                + ": "
                + json.dumps(parameter_value(match[2]), ensure_ascii=False)
            )
            out.extend(self._call_arguments((", " if self._num_members else "") + member))
            self._num_members += 1
            self._buffer = head[match.end() :]

    def _stop(self, out: list[Delta]) -> None:
        if self._section_calls:
            self._close_section()
        else:
            self._give_up(out)
