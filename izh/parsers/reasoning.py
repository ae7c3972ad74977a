"""Output parsers: the reasoning (`<think>`) parser, streaming and not.

Reasoning models wrap their chain of thought in `<think>...</think>` before the answer. The parser
splits generated text into `reasoning` and `content`, delta by delta, holding back any tail that
could be the start of a tag split across deltas. The non-streaming result is the streaming parser
fed the whole text at once, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    """What one piece of generated text adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


class _State(Enum):
    PREAMBLE = "preamble"
    """Nothing decided yet: the output may open with (whitespace and) the start tag."""
    REASONING = "reasoning"
    CONTENT_START = "content_start"
    """Just after the end tag: the whitespace that separates it from the answer is dropped."""
    CONTENT = "content"


def _partial_tag_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ThinkReasoningParser:
    """Splits `<think>reasoning</think>answer` (streaming) into reasoning and content.

    `starts_in_reasoning` is set when the prompt itself ends inside an open `<think>` (DeepSeek-R1
    and Qwen3 templates add it to the generation prompt), so the output begins with reasoning and
    has no start tag. Otherwise only a start tag at the very beginning of the output (after
    whitespace) opens reasoning: a `<think>` later in an answer is just text.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._state = _State.REASONING if starts_in_reasoning else _State.PREAMBLE
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state in (_State.PREAMBLE, _State.REASONING)

    @property
    def thinking(self) -> bool:
        """Inside a think block (its start tag seen, or opened by the prompt), not yet closed."""
        return self._state is _State.REASONING

    def feed(self, text: str) -> ReasoningDelta:
        """Parse the next piece of output; text that may be part of a tag is held for the next call."""
        out = ReasoningDelta()
        self._held += text
        # Each step consumes held text and may change state; stop when it can decide nothing more.
        while self._held and self._step(out):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        """Flush what is held at the end of the output: a partial tag is plain text after all."""
        out = ReasoningDelta()
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            out.reasoning = held
        elif self._state in (_State.PREAMBLE, _State.CONTENT):
            out.content = held
        # In CONTENT_START only whitespace can be held, and it is dropped.
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        if self._state is _State.PREAMBLE:
            return self._step_preamble()
        if self._state is _State.REASONING:
            return self._step_reasoning(out)
        if self._state is _State.CONTENT_START:
            stripped = self._held.lstrip()
            if not stripped:
                self._held = ""
                return False
            self._held = stripped
            self._state = _State.CONTENT
            return True
        out.content += self._held
        self._held = ""
        return False

    def _step_preamble(self) -> bool:
        stripped = self._held.lstrip()
        if stripped.startswith(THINK_START):
            self._held = stripped[len(THINK_START) :]
            self._state = _State.REASONING
            return True
        if THINK_START.startswith(stripped):
            return False  # whitespace and maybe the beginning of the tag: wait for more
        self._state = _State.CONTENT
        return True

    def _step_reasoning(self, out: ReasoningDelta) -> bool:
        end = self._held.find(THINK_END)
        if end >= 0:
            out.reasoning += self._held[:end]
            self._held = self._held[end + len(THINK_END) :]
            self._state = _State.CONTENT_START
            return True
        keep = _partial_tag_suffix(self._held, THINK_END)
        out.reasoning += self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return False

    def parse_all(self, text: str) -> ReasoningDelta:
        """The non-streaming split of a whole output."""
        first = self.feed(text)
        last = self.finish()
        return ReasoningDelta(
            reasoning=first.reasoning + last.reasoning, content=first.content + last.content
        )


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves a `<think>` open, so the output starts inside reasoning."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.rfind(THINK_END) < start
