"""OpenAI's harmony format (gpt-oss): the output as messages on channels, read as a stream.

gpt-oss's chat template ends the prompt with `<|start|>assistant`; the model then writes one or more
messages, each a header, `<|message|>`, a body and a terminator:

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The header names the channel (`analysis`: the chain of thought; `commentary`: tool calls and
preambles; `final`: the answer), and for a tool call its recipient (`to=functions.NAME`, before or
after the channel) and content type (`<|constrain|>json`, or a bare `json`). `<|call|>` and `<|return|>`
are end-of-sequence tokens, so the engine usually stops there without them in the text.

`HarmonyReader` is the streaming machine both parsers use: `feed` text, `finish` once; it reports
text outside any message, each message's header, its body as it arrives and its end. The markers are
special tokens: a request parsed as harmony is detokenized with them (skip_special_tokens false, set
by the chat route). A marker cut in two by the deltas is held back until it is known.

- `HarmonyReasoningParser` (reasoning parser "harmony"; "openai_gptoss" as vLLM names it): analysis
  bodies are the reasoning; final and commentary bodies without a recipient are the content; a message
  to a recipient (a tool call) passes into the content as canonical harmony markup, for the tool parser.
- `HarmonyToolParser` (tool parser "harmony"; "openai" as vLLM names it): a message to
  `functions.NAME` (or any other recipient, named as written) is a call whose arguments stream as the
  body is written; final and commentary bodies are content; analysis bodies are dropped (they are the
  reasoning parser's); text outside messages stays content.

Both are one machine fed the whole text or piece by piece, so streamed and non-streamed agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from izh.parsers.reasoning import ReasoningDelta
from izh.parsers.tool_calls import ContentDelta, Delta, ToolParser
from izh.parsers.tool_json import partial_suffix_length

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
_TERMINATORS = (END, CALL, RETURN)
_HEADER_OPENERS = (START, CHANNEL)
_BODY_ENDS = (*_TERMINATORS, START)
"""What ends a body: a terminator, or (none written) the next message's start."""
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_CONSTRAIN = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")
_BARE_TYPE = re.compile(r"\s(json)\s*$")
_LEADING_RECIPIENT = re.compile(r"\s*to=[^\s<]+\s*")
_LEADING_RECIPIENT_PREFIX = re.compile(r"\s*(t|to|to=[^\s<]*\s*)?")
_FUNCTIONS = "functions."
_SPACE = " \t\r\n"


def is_harmony_template(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return chat_template is not None and CHANNEL in chat_template and MESSAGE in chat_template


@dataclass(frozen=True, slots=True)
class Header:
    """A message's header: its channel ("" when none), recipient and content type (None when none)."""

    channel: str
    recipient: str | None
    content_type: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        content_type = _CONSTRAIN.search(text) or _BARE_TYPE.search(text)
        return cls(
            channel=channel[1] if channel else "",
            recipient=recipient[1] if recipient else None,
            content_type=content_type[1] if content_type else None,
        )

    def markup(self) -> str:
        """The header as harmony writes it after `<|start|>assistant`."""
        text = f"{CHANNEL}{self.channel or 'commentary'}"
        if self.recipient is not None:
            text += f" to={self.recipient}"
        if self.content_type is not None:
            text += f" {CONSTRAIN}{self.content_type}"
        return text + MESSAGE


@dataclass(frozen=True, slots=True)
class Outside:
    text: str


@dataclass(frozen=True, slots=True)
class Begin:
    header: Header


@dataclass(frozen=True, slots=True)
class Body:
    text: str


@dataclass(frozen=True, slots=True)
class Finish:
    terminator: str | None
    """The marker that ended the message; None when the output ended inside it (cut off)."""


Event = Outside | Begin | Body | Finish


class HarmonyReader:
    """Harmony text → events (Outside, Begin, Body, Finish), fed piece by piece."""

    def __init__(self, *, in_body: Header | None = None) -> None:
        self._held = ""
        self._state = "outside"  # → "header" → "body" → "outside"
        self._header = ""
        self._at_start = in_body is None
        """Nothing read yet: the output may open with the recipient of a header whose role the prompt
        wrote (`<|start|>assistant` + ` to=functions.f<|channel|>commentary json<|message|>`)."""
        if in_body is not None:
            self._state = "body"  # the prompt opened the message (its header is in the prompt)

    @property
    def in_body(self) -> bool:
        return self._state == "body"

    def feed(self, text: str) -> list[Event]:
        self._held += text
        events: list[Event] = []
        while self._held and self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The rest: a partial marker is text after all; a message cut off ends without a terminator."""
        events: list[Event] = []
        held, self._held = self._held, ""
        self._at_start = False
        if self._state == "outside" and held:
            events.append(Outside(held))
        elif self._state == "body":
            if held:
                events.append(Body(held))
            events.append(Finish(None))
        self._state, self._header = "outside", ""  # a header cut off is markup, and dropped
        return events

    def _step(self, events: list[Event]) -> bool:
        """Consume what can be decided; False when waiting for more text."""
        if self._at_start:
            leading = _LEADING_RECIPIENT.match(self._held)
            if leading is not None and self._held.startswith(CHANNEL, leading.end()):
                self._header, self._held = self._held[: leading.end()], self._held[leading.end() :]
            elif _LEADING_RECIPIENT_PREFIX.fullmatch(self._held) or (
                leading is not None and CHANNEL.startswith(self._held[leading.end() :])
            ):
                return False  # the recipient, maybe: wait for what follows it
            self._at_start = False
            return True
        if self._state == "header":
            end = self._held.find(MESSAGE)
            if end < 0:
                keep = partial_suffix_length(self._held, MESSAGE)
                self._header += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                return False
            events.append(Begin(Header.parse(self._header + self._held[:end])))
            self._held = self._held[end + len(MESSAGE) :]
            self._state, self._header = "body", ""
            return True
        markers = _BODY_ENDS if self._state == "body" else _HEADER_OPENERS
        found = [(self._held.find(m), m) for m in markers if m in self._held]
        if not found:
            keep = max(partial_suffix_length(self._held, m) for m in markers)
            text = self._held[: len(self._held) - keep]
            if text:
                events.append(Body(text) if self._state == "body" else Outside(text))
            self._held = self._held[len(self._held) - keep :]
            return False
        at, marker = min(found)
        if at:
            text = self._held[:at]
            events.append(Body(text) if self._state == "body" else Outside(text))
        self._held = self._held[at:]
        if self._state == "body":
            if marker != START:  # a `<|start|>` without a terminator ends the message as `<|end|>` does
                self._held = self._held[len(marker) :]
            events.append(Finish(marker if marker != START else END))
            self._state = "outside"
            return True
        # A header: `<|start|>ROLE...` or (its role in the prompt) `<|channel|>...`.
        if marker == START:
            self._held = self._held[len(START) :]
            self._header = ""
        self._state = "header"
        return True


_ANALYSIS = Header("analysis", None, None)


class HarmonyReasoningParser:
    """Analysis → reasoning; final and commentary → content; tool calls → content as markup (module
    docstring). The interface of izh.parsers.reasoning.ThinkReasoningParser.

    `starts_in_reasoning`: the prompt itself opened an analysis message (its `<|message|>` is the
    prompt's last token), so the output begins in its body.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._reader = HarmonyReader(in_body=_ANALYSIS if starts_in_reasoning else None)
        self._header: Header | None = _ANALYSIS if starts_in_reasoning else None

    @property
    def thinking(self) -> bool:
        """Inside an analysis message's body."""
        return self._reader.in_body and self._header is not None and self._header.channel == "analysis"

    @property
    def in_reasoning(self) -> bool:
        return self.thinking

    def feed(self, text: str) -> ReasoningDelta:
        return self._apply(self._reader.feed(text))

    def finish(self) -> ReasoningDelta:
        return self._apply(self._reader.finish())

    def parse_all(self, text: str) -> ReasoningDelta:
        first, last = self.feed(text), self.finish()
        return ReasoningDelta(
            reasoning=first.reasoning + last.reasoning, content=first.content + last.content
        )

    def _apply(self, events: list[Event]) -> ReasoningDelta:
        out = ReasoningDelta()
        for event in events:
            if isinstance(event, Outside):
                out.content += event.text
            elif isinstance(event, Begin):
                self._header = event.header
                if event.header.recipient is not None:
                    out.content += START + "assistant" + event.header.markup()
            elif isinstance(event, Body):
                header = self._header
                if header is not None and header.recipient is None and header.channel == "analysis":
                    out.reasoning += event.text
                else:
                    out.content += event.text
            else:
                header, self._header = self._header, None
                if header is not None and header.recipient is not None:
                    out.content += CALL if event.terminator in (None, CALL) else event.terminator
        return out


class HarmonyToolParser(ToolParser):
    """Calls from messages to a recipient; content from final and commentary (module docstring)."""

    name = "harmony"

    def __init__(self) -> None:
        super().__init__()
        self._reader = HarmonyReader()
        self._header: Header | None = None
        self._started = False  # the open call's arguments have begun (leading whitespace dropped)
        self._space = ""  # whitespace at the end of the arguments so far: sent only if more follows

    def _feed(self, text: str) -> list[Delta]:
        return self._apply(self._reader.feed(text))

    def _finish(self) -> list[Delta]:
        return self._apply(self._reader.finish())

    def _apply(self, events: list[Event]) -> list[Delta]:
        out: list[Delta] = []
        for event in events:
            if self.done:
                break
            if isinstance(event, Outside):
                out.append(ContentDelta(event.text))
            elif isinstance(event, Begin):
                self._header = event.header
                if event.header.recipient is not None:
                    out.extend(self._begin_call(event.header.recipient.removeprefix(_FUNCTIONS)))
                    self._started, self._space = False, ""
            elif isinstance(event, Body):
                out.extend(self._body(event.text))
            else:
                header, self._header = self._header, None
                if header is not None and header.recipient is not None and self.call_open:
                    if not self._started:
                        out.extend(self._call_arguments("{}"))  # a parameterless call
                    out.extend(self._end_call(complete=event.terminator is not None))
        return out

    def _body(self, text: str) -> list[Delta]:
        header = self._header
        if header is None or header.recipient is None:
            if header is not None and header.channel == "analysis":
                return []  # the reasoning parser's
            return [ContentDelta(text)]
        if not self.call_open:
            return []  # a call past max_calls: ignored (the parser is done)
        if not self._started:
            text = text.lstrip(_SPACE)
            if not text:
                return []
            self._started = True
        text = self._space + text
        kept = text.rstrip(_SPACE)
        self._space = text[len(kept) :]
        return self._call_arguments(kept) if kept else []
