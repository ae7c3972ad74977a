"""The Hermes/Qwen tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, any number per turn, text around them; and the Hermes tools system prompt (for chat
templates that know nothing of tools).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from izh.parsers.tool_calls import CallBody, ContentDelta, Delta, ToolParser
from izh.parsers.tool_json import partial_suffix_length, strip_partial_suffix

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with text around them.

    A block ends at the first end tag. Whitespace around calls collapses: dropped at the message's
    start and end and between calls; between two pieces of content the whitespace before the first
    call is kept. A block that does not hold a call stays in the content as written, tags included.
    A block left open at the end (max_tokens, a stop string) still counts when it streamed or its
    JSON is complete.
    """

    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # text not yet emitted: a possible tag start, or an open block's body
        self._call: CallBody | None = None  # the open block
        self._end_search_from = 0  # where in an open block's body to look for the end tag next
        self._pending_space = ""  # whitespace after content, held until we know what follows
        self._after_call = False  # whitespace right after a call is dropped
        self._has_content = False

    def _feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        progressed = True
        while progressed and not self.done:
            progressed = self._close_call(out) if self._call is not None else self._open_call(out)
        return out

    def _finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._call is not None:
            body = strip_partial_suffix(self._buffer, HERMES_END)
            self._resolve_call(body, HERMES_START + self._buffer, out)
        else:
            self._emit_content(self._buffer, out)
        self._buffer = ""
        if self._pending_space and not self._after_call and not self.done:
            out.append(ContentDelta(self._pending_space))
        self._pending_space = ""
        return out

    def _open_call(self, out: list[Delta]) -> bool:
        """Emit content up to a start tag (or up to a possible partial one); True on a start tag."""
        start = self._buffer.find(HERMES_START)
        if start < 0:
            keep = partial_suffix_length(self._buffer, HERMES_START)
            self._emit_content(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._emit_content(self._buffer[:start], out)
        self._buffer = self._buffer[start + len(HERMES_START) :]
        self._call, self._end_search_from = CallBody(self, ("arguments", "parameters")), 0
        return True

    def _close_call(self, out: list[Delta]) -> bool:
        """Stream the open block's body so far; resolve it if its end tag has arrived (then True)."""
        assert self._call is not None
        end = self._buffer.find(HERMES_END, self._end_search_from)
        if end < 0:
            self._end_search_from = max(0, len(self._buffer) - len(HERMES_END) + 1)
            self._call.update(strip_partial_suffix(self._buffer, HERMES_END), out)
            return False
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(HERMES_END) :]
        self._resolve_call(body, HERMES_START + body + HERMES_END, out)
        return True

    def _resolve_call(self, body: str, raw: str, out: list[Delta]) -> None:
        call, self._call = self._call, None
        assert call is not None
        if not call.close(body, out):
            self._emit_content(raw, out)
            return
        if not self._has_content:
            self._pending_space = ""
        self._after_call = True

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
