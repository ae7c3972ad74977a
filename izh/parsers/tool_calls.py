"""Tool calls as parsers find them: the deltas, and ToolParser, the streaming machine every format's
parser is (`feed` each new piece of text, then `finish`; `extract` is the same machine fed the whole
text, so the two can never disagree, wherever the deltas split: the argument fragments differ, their
concatenation does not).

Arguments stream as they are generated, like OpenAI's and vLLM's: a call whose JSON starts
`{"name": "<name>", "arguments": {` (whitespace aside; "parameters" counts too) is a call from then
on. Its first delta carries index, id, type and name; the following ones the arguments' text as the
model writes it, up to the `}` closing the arguments object; what comes after that inside the call
is dropped. The one rewrite: string escapes JSON lacks (`\\'`, which models used to Python write)
are repaired as they stream (tool_json.EscapeRepair), so that the arguments parse. Such a call
cannot turn back into content: if the model breaks the JSON inside the arguments otherwise
(possible only without a grammar, tool_choice "auto"), the client gets the arguments as written,
as OpenAI warns its clients they may. A call cut off (max_tokens, a stop string) keeps the
arguments it had. A call whose JSON starts any other way (arguments before the name, arguments as a
string) is parsed once complete: a valid one is emitted with its arguments re-serialized, in one
fragment, and a malformed one stays content as the raw text it was. Arguments are a JSON object's
text ("{}" for a parameterless call).

Forcing calls (tool_choice "required" or a named tool) is a grammar (izh.parsers.tool_grammar).
Small models forced that way tend to repeat their call until max_tokens (SmolLM2-135M writes the
same `get_local_time` call five times): the grammar cannot forbid a repeat, since it is fixed before
the first token. So the parser guards the end instead (`limit_calls`):

- with `drop_repeats` (set for forced calls), a call is a repeat when its name and arguments are
  those of an earlier call, compared as JSON text without the whitespace between tokens (under
  the grammar the properties come in the schema's order, so the same call is the same text). A
  call held back while its text so far could still be a repeat; once it differs, its deltas go out
  at once and it streams on. A repeat, or a call cut off while it still could be one, is dropped,
  and the message is over;
- with `max_calls` (1 for parallel_tool_calls false, in every tool_choice mode), the message is
  over once that many calls are complete.

A parser whose message is over is `done`: it ignores the rest of the text, and the caller stops the
generation there (aborting the request in the engine) and finishes with "tool_calls". vLLM, for
comparison, forces a JSON array of calls for "required" and the tool's parameters for a named tool,
and lets a model repeat inside the array until max_tokens.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from izh.parsers.tool_json import (
    NAME_KEYS,
    EscapeRepair,
    ObjectScanner,
    call_header,
    parse_call,
    without_json_space,
)

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


@dataclass(slots=True)
class _OpenCall:
    """The call being streamed: its deltas so far, and whether they are held back (a possible repeat)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    held: bool = False
    repair: EscapeRepair = field(default_factory=EscapeRepair)

    def first_delta(self) -> ToolCallDelta:
        return ToolCallDelta(self.index, id=self.id, type="function", name=self.name)


class ToolParser(ABC):
    """A streaming tool-call parser for one generated message: `feed` each new piece of text,
    then `finish` once; `extract` parses a whole message. Once `done`, the rest is ignored."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._num_calls = 0
        self._max_calls: int | None = None
        self._drop_repeats = False
        self._call_keys: set[str] = set()  # _call_key of every complete call
        self._open: _OpenCall | None = None
        self.done = False
        """The message is over (its last allowed call, or a repeat): stop generating."""

    @property
    def call_open(self) -> bool:
        """A call has begun and its arguments are not complete yet."""
        return self._open is not None

    def limit_calls(self, max_calls: int | None, *, drop_repeats: bool) -> None:
        """End the message after `max_calls` calls, and (`drop_repeats`) at a repeated call, as
        the module docstring describes. Call before the first `feed`."""
        self._max_calls, self._drop_repeats = max_calls, drop_repeats

    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text`, appended to what came before, makes certain."""
        return [] if self.done else self._feed(text)

    def finish(self) -> list[Delta]:
        """The deltas held back so far: the message is complete."""
        return [] if self.done else self._finish()

    @abstractmethod
    def _feed(self, text: str) -> list[Delta]: ...

    @abstractmethod
    def _finish(self) -> list[Delta]: ...

    @classmethod
    def extract(cls, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content (None when empty) and tool calls of a whole message."""
        parser = cls()
        return collect(parser.feed(text) + parser.finish())

    # ---- the calls, as the subclasses find them -------------------------------------------------

    def _begin_call(self, name: str) -> list[Delta]:
        """A call to `name` starts; its arguments follow (`_call_arguments`), then `_end_call`."""
        assert self._open is None, self._open
        if self._max_calls is not None and self._num_calls >= self._max_calls:
            self.done = True  # past the last call allowed (one cut off before it was complete)
            return []
        call = _OpenCall(self._num_calls, new_call_id(), name)
        call.held = self._drop_repeats and self._may_repeat(call)
        self._open = call
        return [] if call.held else [call.first_delta()]

    def _call_arguments(self, fragment: str) -> list[Delta]:
        call = self._open
        assert call is not None
        fragment = call.repair.feed(fragment)
        call.arguments += fragment
        if not call.held:
            return [ToolCallDelta(call.index, arguments=fragment)] if fragment else []
        if self._may_repeat(call):
            return []
        call.held = False
        return self._release(call)

    def _end_call(self, *, complete: bool = True) -> list[Delta]:
        """The open call ends: its arguments are complete, or (not `complete`) cut off."""
        call = self._open
        assert call is not None
        tail = call.repair.finish()  # a backslash that ended arguments cut off
        deltas = self._call_arguments(tail) if tail else []
        self._open = None
        key = _call_key(call.name, call.arguments)
        if call.held and (key in self._call_keys or not complete):
            self.done = True  # a repeat, or cut off while it could be one: the message ends before it
            return []
        deltas += self._release(call) if call.held else []
        self._call_keys.add(key)
        self._num_calls += 1
        if complete and self._max_calls is not None and self._num_calls >= self._max_calls:
            self.done = True
        return deltas

    def _whole_call(self, name: str, arguments: str) -> list[Delta]:
        deltas = self._begin_call(name)
        if self.done:
            return deltas
        return deltas + self._call_arguments(arguments) + self._end_call()

    def _may_repeat(self, call: _OpenCall) -> bool:
        """Whether an earlier call starts with what `call` has written so far."""
        prefix = _call_key(call.name, call.arguments)
        return any(key.startswith(prefix) for key in self._call_keys)

    @staticmethod
    def _release(call: _OpenCall) -> list[Delta]:
        """The deltas a held-back call kept: its first, and its arguments so far in one fragment."""
        deltas: list[Delta] = [call.first_delta()]
        if call.arguments:
            deltas.append(ToolCallDelta(call.index, arguments=call.arguments))
        return deltas


def _call_key(name: str, arguments: str) -> str:
    """What makes two calls the same: the name, and the arguments without whitespace between tokens."""
    return f"{name}\x00{without_json_space(arguments)}"


class CallBody:
    """One call object's text as it grows, turned into call deltas by `parser`.

    A body that starts `{"name": "<name>", "<arguments key>": {` streams (see the module docstring);
    any other waits for its end and is parsed whole. With `accept`, only a body that streams, to a
    name `accept` takes, is a call: any other is `rejected` as soon as that shows.
    """

    def __init__(
        self,
        parser: ToolParser,
        argument_keys: tuple[str, ...],
        accept: Callable[[str], bool] | None = None,
        name_keys: tuple[str, ...] = NAME_KEYS,
    ) -> None:
        self._parser = parser
        self._argument_keys = argument_keys
        self._name_keys = name_keys
        self._accept = accept
        self._state = "header"  # → "arguments" → "after"; or "header" → "whole" | "rejected"
        self._arguments = ObjectScanner()
        self._emitted = 0  # the end of the arguments text sent so far

    @property
    def streamed(self) -> bool:
        """The body is a call since its header: it can no longer be content."""
        return self._state in ("arguments", "after")

    @property
    def rejected(self) -> bool:
        """The body is no call `accept` takes (only with `accept`)."""
        return self._state == "rejected"

    def update(self, body: str, out: list[Delta]) -> None:
        """`body` is the text so far; each call sees the previous one's text extended."""
        if self._state == "header":
            header = call_header(body, self._argument_keys, self._name_keys)
            if header is False:
                self._state = "whole" if self._accept is None else "rejected"
            elif header is not True and self._accept is not None and not self._accept(header[0]):
                self._state = "rejected"
            elif header is not True:
                name, start = header
                out.extend(self._parser._begin_call(name))
                self._state, self._emitted = "arguments", start
                self._arguments = ObjectScanner(start)
                if self._parser.done:
                    self._state = "after"
        if self._state == "arguments":
            end = self._arguments.scan(body)
            stop = len(body) if end is None else end
            if stop > self._emitted:
                out.extend(self._parser._call_arguments(body[self._emitted : stop]))
                self._emitted = stop
            if end is not None:
                out.extend(self._parser._end_call())
                self._state = "after"

    def close(self, body: str, out: list[Delta]) -> bool:
        """`body` is complete: resolve it. False when it is no call (the caller keeps it as content)."""
        self.update(body, out)
        if self._state == "arguments" and not self._parser.done:
            out.extend(self._parser._end_call(complete=False))
            self._state = "after"
        if self.streamed or self._parser.done:
            return True
        if self._accept is not None:
            return False
        call = parse_call(body, self._argument_keys, self._name_keys)
        if call is None:
            return False
        out.extend(self._parser._whole_call(*call))
        return True
