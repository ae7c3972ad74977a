"""Tool calls written in the wrong wrapper, found in what a format's parser leaves as content.

Small models asked for tools often write the call right but wrap it wrong: a fenced ```json block
(Qwen2.5-Coder-1.5B driving Codex), a bare JSON object on a line of its own (Qwen2.5 models dropping
their `<tool_call>` tags), `<tools>` instead of `<tool_call>`, or several calls in one JSON array.
`LooseToolParser` wraps the request's format parser (Hermes, Llama 3 JSON, ...) and reads that
parser's content for such calls, so every route that parses tool calls (chat, Responses, Messages)
gets them as calls instead of text. It is used only with tool_choice "auto" (forced calls are
Hermes blocks by grammar), and it only takes a call to a tool the request offered, whose JSON starts
`{"name": "<tool>", "arguments": {` ("function" counts for "name", as Qwen2.5-Coder-1.5B writes it
for Codex; "parameters" for "arguments"): anything else, a JSON example in an answer included, stays
content as written.

The wrappers (openers, then one or more call objects, separated by whitespace or commas, optionally
inside `[...]`, then the closer):

- ```` ```json ````, ```` ``` ````, ```` ```tool_call ```` fences, closed by ```` ``` ````;
- `<tool_call>`, `<tools>`, `<tool_calls>` tags, closed by their end tags (`<tool_call>` reaches
  here only when the format's parser is not Hermes, or left a block as content);
- none: a `{` or `[` that starts a line (after spaces) opens a bare call.

A call streams from its header on, as the format parsers' do (izh.parsers.tool_calls). Whitespace
around calls collapses as Hermes' does. A wrapper whose first object is no call stays content,
opener included; text after a wrapper's calls that is not its closer is content again.
"""

from __future__ import annotations

from collections.abc import Collection

from izh.parsers.tool_calls import CallBody, ContentDelta, Delta, ToolParser
from izh.parsers.tool_json import ObjectScanner, partial_suffix_length

_ARGUMENT_KEYS = ("arguments", "parameters")
_NAME_KEYS = ("name", "function")
_TAGS = {"<tool_call>": "</tool_call>", "<tools>": "</tools>", "<tool_calls>": "</tool_calls>"}
_FENCE = "```"
_FENCE_LANGUAGES = ("", "json", "tool_call", "tool_calls", "tool_code")
_MAX_FENCE_INFO = 16  # a fence's info string longer than this is no call's
_SPACE = " \t\r\n"


class LooseToolParser(ToolParser):
    """`inner`'s calls, and the calls wrapped wrong in `inner`'s content (see the module docstring);
    only calls to `tool_names` count among the latter."""

    def __init__(self, inner: ToolParser, tool_names: Collection[str]) -> None:
        super().__init__()
        self.name = inner.name  # type: ignore[misc]  # the format's name, for logs
        self._inner = inner
        self._tool_names = frozenset(tool_names)
        self._inner_call = False  # an inner call is open (ours: self._open)
        self._buffer = ""  # content not yet emitted: from a possible opener on
        self._closer: str | None = None  # the open wrapper's closer ("" for a bare call)
        self._opener_length = 0  # the open wrapper's opener, at the buffer's start
        self._position = 0  # where in the buffer the open wrapper is read next
        self._in_array = False
        self._num_block_calls = 0  # calls found in the open wrapper
        self._body: CallBody | None = None  # the open call object, at the buffer's start
        self._object_end = ObjectScanner()
        self._line_start = True  # the content emitted so far ends at a line's start
        self._pending_space = ""
        self._after_call = False
        self._has_content = False

    # --- the format parser's deltas --------------------------------------------------------------

    def _feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._take(self._inner.feed(text), out)
        return out

    def _finish(self) -> list[Delta]:
        out: list[Delta] = []
        self._take(self._inner.finish(), out)
        if not self.done:
            self._end_inner_call(out)
        if not self.done:
            self._flush(out)
        if self._pending_space and not self._after_call and not self.done:
            out.append(ContentDelta(self._pending_space))
        self._pending_space = ""
        return out

    def _take(self, deltas: list[Delta], out: list[Delta]) -> None:
        for delta in deltas:
            if self.done:
                return
            if isinstance(delta, ContentDelta):
                self._end_inner_call(out)
                if not self.done:
                    self._scan(delta.text, out)
            elif delta.name is not None:
                self._end_inner_call(out)
                if not self.done:
                    self._flush(out)
                if not self.done:
                    out.extend(self._begin_call(delta.name))
                    self._inner_call = not self.done
            elif self._inner_call:
                out.extend(self._call_arguments(delta.arguments))
        if not self._inner.call_open:
            self._end_inner_call(out)

    def _end_inner_call(self, out: list[Delta]) -> None:
        if self._inner_call:
            self._inner_call = False
            out.extend(self._end_call())
            self._after_call = True
            if not self._has_content:
                self._pending_space = ""

    # --- the content's wrappers ------------------------------------------------------------------

    def _scan(self, text: str, out: list[Delta]) -> None:
        self._buffer += text
        progressed = True
        while progressed and not self.done:
            progressed = self._open_wrapper(out) if self._closer is None else self._read_wrapper(out)

    def _open_wrapper(self, out: list[Delta]) -> bool:
        """Emit content up to the next opener (holding what may start one); True on an opener."""
        found = self._next_opener()
        if found is None:
            keep = max(partial_suffix_length(self._buffer, tag) for tag in (*_TAGS, _FENCE))
            self._emit_content(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        start, opener_end, closer = found
        if opener_end < 0:  # a fence whose info line is not complete yet
            self._emit_content(self._buffer[:start], out)
            self._buffer = self._buffer[start:]
            return False
        self._emit_content(self._buffer[:start], out)
        self._buffer = self._buffer[start:]
        self._closer, self._in_array, self._num_block_calls = closer, False, 0
        self._opener_length = opener_end - start
        self._position = self._opener_length
        return True

    def _next_opener(self) -> tuple[int, int, str] | None:
        """(start, end, closer) of the first opener in the buffer; end -1 while a fence's info line
        is incomplete. None when there is none (yet)."""
        best: tuple[int, int, str] | None = None
        for tag, end_tag in _TAGS.items():
            at = self._buffer.find(tag)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(tag), end_tag)
        at = self._buffer.find(_FENCE)
        while at >= 0 and (best is None or at < best[0]):
            newline = self._buffer.find("\n", at + len(_FENCE))
            info = self._buffer[at + len(_FENCE) : newline if newline >= 0 else None]
            if len(info) > _MAX_FENCE_INFO or "`" in info:
                at = self._buffer.find(_FENCE, at + len(_FENCE))
                continue
            if newline < 0:
                best = (at, -1, _FENCE)
            elif info.strip().lower() in _FENCE_LANGUAGES:
                best = (at, newline + 1, _FENCE)
            else:  # a code block of another language: its text is content
                at = self._buffer.find(_FENCE, newline)
                continue
            break
        bare = self._bare_start(best[0] if best is not None else len(self._buffer))
        if bare is not None:
            best = (bare, bare, "")
        return best

    def _bare_start(self, before: int) -> int | None:
        """Where a `{` or `[` starts a line in the buffer, before `before`."""
        line_start = self._line_start
        for position, char in enumerate(self._buffer[:before]):
            if char in "{[" and line_start:
                return position
            if char == "\n":
                line_start = True
            elif char not in " \t":
                line_start = False
        return None

    def _read_wrapper(self, out: list[Delta]) -> bool:
        """Read the open wrapper's objects at `_position`; True when it is resolved."""
        assert self._closer is not None
        if self._body is not None:
            return self._read_object(out)
        rest = self._buffer[self._position :]
        head = rest.lstrip(_SPACE + ("," if self._num_block_calls else ""))
        skipped = len(rest) - len(head)
        if not head:
            return False
        if head[0] == "[" and not self._in_array and not self._num_block_calls:
            self._in_array = True
            self._position += skipped + 1
            return True
        if head[0] == "{":
            self._position += skipped
            self._body = CallBody(self, _ARGUMENT_KEYS, accept=self._accept, name_keys=_NAME_KEYS)
            self._object_end = ObjectScanner()
            return True
        if not self._num_block_calls:
            return self._reject(out)
        if self._in_array and head[0] == "]":
            self._in_array = False
            self._position += skipped + 1
            return True if self._closer else self._close_wrapper(self._position)
        if self._closer and not self._in_array:
            if head.startswith(self._closer):
                return self._close_wrapper(self._position + skipped + len(self._closer))
            if self._closer.startswith(head):
                return False  # may be the closer, still arriving
        return self._close_wrapper(self._position)

    def _read_object(self, out: list[Delta]) -> bool:
        """Stream the open object; resolve it once it is complete or shown to be no call."""
        assert self._body is not None
        text = self._buffer[self._position :]
        end = self._object_end.scan(text)
        if end is not None:
            text = text[:end]
        self._body.update(text, out)
        if self._body.rejected:
            self._body = None
            return self._close_wrapper(self._position) if self._num_block_calls else self._reject(out)
        if end is None:
            return False
        body, self._body = self._body, None
        body.close(text, out)
        self._call_found()
        self._position += end
        if self._closer == "" and not self._in_array:
            return self._close_wrapper(self._position)
        return True

    def _call_found(self) -> None:
        self._num_block_calls += 1
        self._after_call, self._line_start = True, False
        if not self._has_content:
            self._pending_space = ""

    def _accept(self, name: str) -> bool:
        return name in self._tool_names

    def _reject(self, out: list[Delta]) -> bool:
        """The wrapper holds no call: its first character is content, and scanning resumes after it."""
        self._body, self._closer = None, None
        length = max(1, self._opener_length)
        self._emit_content(self._buffer[:length], out)
        self._buffer = self._buffer[length:]
        return True

    def _close_wrapper(self, end: int) -> bool:
        """The wrapper's calls are over at `end`; what follows is content."""
        self._buffer = self._buffer[end:]
        self._body, self._closer, self._in_array = None, None, False
        return True

    def _flush(self, out: list[Delta]) -> None:
        """The content ended (the message, or before a format call): resolve what is held. An object
        cut off is a call once it streamed; a wrapper with calls drops its unclosed rest."""
        if self._closer is not None:
            body, self._body = self._body, None
            if body is not None and body.streamed:
                body.close(self._buffer[self._position :], out)
                self._call_found()
            if self._num_block_calls:
                self._buffer = ""
            self._closer = None
        if not self.done:
            self._emit_content(self._buffer, out)
        self._buffer = ""

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        """Content, minus whitespace next to calls: trailing whitespace waits for what follows."""
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        last_line = text.rsplit("\n", 1)
        self._line_start = not last_line[-1].strip(" \t") and (len(last_line) > 1 or self._line_start)
        text = self._pending_space + text
        stripped = text.rstrip()
        self._pending_space = text[len(stripped) :]
        if stripped:
            out.append(ContentDelta(stripped))
            self._has_content = True
