"""The machine the marker-opened tool-call formats share (Mistral, Granite, Phi-4-mini, Qwen3-Coder,
DeepSeek V3): content until a start marker, then a calls section that the format reads
(`_section`), then content again where the format says the section ends.

Content keeps what the model wrote, except the whitespace next to a section (dropped before the
marker and after the section), as Hermes' parser does. A start marker cut in two by the deltas is held
back until it is known (izh.parsers.tool_json.partial_suffix_length). A section whose text turns out
to hold no call it can read stays content as written, marker included (`_give_up`); what a call
already streamed stays a call.

`JsonArraySection` reads the sections that are a JSON array of `{"name", "arguments"}` objects (or one
such object): each object streams through izh.parsers.tool_calls.CallBody, arguments as they are
written.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from izh.parsers.tool_calls import CallBody, ContentDelta, Delta, ToolParser
from izh.parsers.tool_json import ObjectScanner, partial_suffix_length

_SPACE = " \t\r\n"


class SectionedToolParser(ToolParser):
    """Content, and calls in sections opened by one of `START_MARKERS` (see the module docstring)."""

    START_MARKERS: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # content: not yet emitted; in a section: the section's unread text
        self._in_section = False
        self._marker = ""  # the marker that opened the section
        self._raw = ""  # the section's whole text so far (for _give_up)
        self._section_calls = 0  # calls begun in the open section
        self._pending_space = ""
        self._after_section = False

    # ---- the machine -----------------------------------------------------------------------------

    def _feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self._in_section:
            self._raw += text
        self._buffer += text
        self._run(out, final=False)
        return out

    def _finish(self) -> list[Delta]:
        out: list[Delta] = []
        self._run(out, final=True)
        if not self.done:
            if self._in_section:
                self._give_up(out)
            self._emit_content(self._buffer, out)
            if self._pending_space and not self._after_section:
                out.append(ContentDelta(self._pending_space))
        self._buffer = self._pending_space = ""
        return out

    def _run(self, out: list[Delta], *, final: bool) -> None:
        while not self.done:
            if not self._in_section and not self._open_section(out):
                return
            before = (len(self._buffer), self._section_calls, self._in_section)
            self._section(out, final=final)
            if self._in_section and (len(self._buffer), self._section_calls, self._in_section) == before:
                return  # waiting for more text

    def _open_section(self, out: list[Delta]) -> bool:
        found = [(self._buffer.find(m), m) for m in self.START_MARKERS if m in self._buffer]
        if not found:
            keep = max(partial_suffix_length(self._buffer, m) for m in self.START_MARKERS)
            self._emit_content(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        start, marker = min(found)
        self._emit_content(self._buffer[:start], out)
        self._buffer = self._buffer[start + len(marker) :]
        self._in_section, self._marker, self._raw, self._section_calls = True, marker, self._buffer, 0
        return True

    def _close_section(self) -> None:
        """The format read its section to the end; what follows in the buffer is content."""
        self._in_section = False
        if self._section_calls:
            self._after_section = True
            if not self._has_content:
                self._pending_space = ""

    def _give_up(self, out: list[Delta]) -> None:
        """The section holds no call (or no more): what no call took is content, as written."""
        self._in_section = False
        text = self._buffer if self._section_calls else self._marker + self._raw
        self._buffer = ""
        self._after_section = self._after_section or self._section_calls > 0
        self._emit_content(text, out)

    # ---- content ---------------------------------------------------------------------------------

    _has_content = False

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        if self._after_section:
            text = text.lstrip(_SPACE)
            if not text:
                return
            self._after_section = False
        text = self._pending_space + text
        stripped = text.rstrip(_SPACE)
        self._pending_space = text[len(stripped) :]
        if stripped:
            out.append(ContentDelta(stripped))
            self._has_content = True

    # ---- the format ------------------------------------------------------------------------------

    @abstractmethod
    def _section(self, out: list[Delta], *, final: bool) -> None:
        """Read the open section's text (`self._buffer`) as far as it goes: emit calls, consume what is
        read; `_close_section` at its end, `_give_up` when it is no call; with `final`, the text is
        all there is."""

    def _count_call(self) -> None:
        self._section_calls += 1


class JsonArraySection(SectionedToolParser):
    """Sections that are a JSON array of call objects, or one call object (see the module docstring)."""

    ARGUMENT_KEYS: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self) -> None:
        super().__init__()
        self._array_state = "start"  # → "items" (inside [...]) | "single" (one object) → "end"
        self._call: CallBody | None = None
        self._scanner = ObjectScanner()

    def _section(self, out: list[Delta], *, final: bool) -> None:
        if self._array_state == "start":
            head = self._buffer.lstrip(_SPACE)
            if not head:
                if final:
                    self._give_up(out)
                return
            if head[0] == "[":
                self._array_state, self._buffer = "items", head[1:]
            elif head[0] == "{":
                self._array_state, self._buffer = "single", head
            else:
                self._give_up(out)
                return
        self._read_objects(out, final=final)

    def _read_objects(self, out: list[Delta], *, final: bool) -> None:
        while not self.done and self._in_section:
            if self._call is None:
                head = self._buffer.lstrip(_SPACE)
                if self._section_calls and self._array_state == "items" and head.startswith(","):
                    head = head[1:].lstrip(_SPACE)
                if not head:
                    self._buffer = ""
                    if final:
                        self._end_array()
                    return
                if self._array_state == "end":
                    self._buffer = head  # after one object: what follows is content
                    self._end_array()
                    return
                if head[0] == "]" and self._array_state == "items":
                    self._buffer = head[1:]
                    self._end_array()
                    return
                if head[0] != "{":
                    self._buffer = head
                    self._stop_reading(out)
                    return
                self._buffer, self._scanner = head, ObjectScanner()
                self._call = CallBody(self, self.ARGUMENT_KEYS)
            end = self._scanner.scan(self._buffer)
            if end is None:
                self._call.update(self._buffer, out)
                if final:
                    self._call.close(self._buffer, out)
                    self._buffer, self._call = "", None
                    self._count_call()
                    self._end_array()
                return
            if not self._call.close(self._buffer[:end], out):
                self._call = None
                self._stop_reading(out)
                return
            self._buffer, self._call = self._buffer[end:], None
            self._count_call()
            if self._array_state == "single":
                self._array_state = "end"

    def _stop_reading(self, out: list[Delta]) -> None:
        """Text that is no call object: after calls it ends the section, else the section is no call."""
        if self._section_calls:
            self._end_array()
        else:
            self._give_up(out)

    def _end_array(self) -> None:
        self._array_state = "start"
        self._close_section()

    def _give_up(self, out: list[Delta]) -> None:
        self._array_state, self._call = "start", None
        super()._give_up(out)
