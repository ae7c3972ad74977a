"""The DeepSeek V3 tool-call format (its chat template's special tokens), V3 and V3.1 spellings:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                                   (V3, R1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
                                                                                  (V3.1)

Each call is emitted whole once its `<｜tool▁call▁end｜>` has come (its arguments re-serialized), so
streamed and collected calls are the same; the section ends at `<｜tool▁calls▁end｜>`.
"""

from __future__ import annotations

import json
import re

from izh.parsers.sectioned import SectionedToolParser
from izh.parsers.tool_calls import Delta

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
_V3_BODY = re.compile(r"\s*([^\n`]+?)\s*\n```(?:json)?\s*\n?(.*?)\s*```\s*$", re.S)
_SPACE = " \t\r\n"


def _arguments(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def parse_deepseek_call(call: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's text between its begin and end tokens, or None."""
    head, sep, body = call.partition(SEPARATOR)
    if not sep:
        return None
    head = head.strip(_SPACE)
    if head == "function":
        match = _V3_BODY.match(body)
        if match is not None:
            arguments = _arguments(match[2])
            return None if arguments is None else (match[1], arguments)
    arguments = _arguments(body.strip(_SPACE) or "{}")
    if not head or arguments is None:
        return None
    return head, arguments


class DeepSeekV3ToolParser(SectionedToolParser):
    name = "deepseek_v3"
    START_MARKERS = (CALLS_BEGIN,)

    def _section(self, out: list[Delta], *, final: bool) -> None:
        while self._in_section and not self.done:
            head = self._buffer.lstrip(_SPACE)
            if head.startswith(CALLS_END):
                self._buffer = head[len(CALLS_END) :]
                self._close_section()
                return
            if not head.startswith(CALL_BEGIN):
                if not final and (CALL_BEGIN.startswith(head) or CALLS_END.startswith(head)):
                    return
                self._stop(out)
                return
            end = head.find(CALL_END)
            if end < 0:
                if final:
                    self._stop(out)
                return
            call = parse_deepseek_call(head[len(CALL_BEGIN) : end])
            if call is None:
                self._stop(out)
                return
            self._count_call()
            out.extend(self._whole_call(*call))
            self._buffer = head[end + len(CALL_END) :]

    def _stop(self, out: list[Delta]) -> None:
        if self._section_calls:
            self._close_section()
        else:
            self._give_up(out)
