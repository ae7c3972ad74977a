"""The Llama 3 JSON tool-call format: `{"name": ..., "parameters": {...}}` objects, optionally after
`<|python_tag|>`, several separated by `;`, the whole message.
"""

from __future__ import annotations

from izh.parsers.tool_calls import CallBody, ContentDelta, Delta, ToolParser
from izh.parsers.tool_json import ObjectScanner

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the message is `{"name": ..., "parameters": {...}}` objects (optionally
    after `<|python_tag|>`, separated by `;`), or it is plain content.

    The message is calls when it starts (after whitespace) with `{` or the tag. From the first
    object that is not a call, or text that is not a separator, the rest is content.
    """

    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "undecided"  # "undecided" → "calls" | "content"
        self._buffer = ""  # in "calls" mode: from the open object's start
        self._scanner = ObjectScanner()  # the open object's end
        self._call: CallBody | None = None  # the open object

    def _feed(self, text: str) -> list[Delta]:
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

    def _finish(self) -> list[Delta]:
        out: list[Delta] = []
        rest = self._buffer
        if self._mode == "undecided":
            rest = rest.replace(PYTHON_TAG, "", 1) if rest.lstrip().startswith(PYTHON_TAG) else rest
        elif self._mode == "calls":
            if self._call is not None:
                rest = "" if self._call.close(rest, out) else rest  # an object left open
            elif not self._strip_separator(rest):
                rest = ""  # whitespace (and a last separator) after the calls
        if rest and not self.done:
            out.append(ContentDelta(rest))
        self._buffer, self._mode, self._call = "", "content", None
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
        """Stream the objects at the buffer's start; switch to content at anything but a call."""
        while not self.done:
            if self._call is None:
                head = self._strip_separator(self._buffer)
                if not head:
                    return
                if not head.startswith("{"):
                    self._to_content(out)
                    return
                self._buffer, self._scanner = head, ObjectScanner()
                self._call = CallBody(self, ("parameters", "arguments"))
            end = self._scanner.scan(self._buffer)
            if end is None:
                self._call.update(self._buffer, out)
                return
            if not self._call.close(self._buffer[:end], out):
                self._to_content(out)
                return
            self._buffer, self._call = self._buffer[end:], None

    def _strip_separator(self, text: str) -> str:
        """`text` without leading whitespace and, after a call, one `;` separator."""
        head = text.lstrip()
        if self._num_calls and head.startswith(";"):
            head = head[1:].lstrip()
        return head

    def _to_content(self, out: list[Delta]) -> None:
        if self._buffer:
            out.append(ContentDelta(self._buffer))
        self._buffer, self._mode, self._call = "", "content", None
