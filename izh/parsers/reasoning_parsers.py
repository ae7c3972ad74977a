"""Which reasoning parser: the parsers by name, and the one a chat template calls for (`--reasoning-parser
auto`). `<think>` blocks are izh.parsers.reasoning's; gpt-oss's harmony channels izh.parsers.harmony's.
"""

from __future__ import annotations

from typing import Protocol

from izh.parsers.harmony import HarmonyReasoningParser, is_harmony_template
from izh.parsers.reasoning import THINK_START, ReasoningDelta, ThinkReasoningParser


class ReasoningParser(Protocol):
    """Splits one generated message into reasoning and content, streaming (`feed`, then `finish`)."""

    @property
    def thinking(self) -> bool:
        """Inside the reasoning now (a think block, an analysis message)."""
        ...

    def feed(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...

    def parse_all(self, text: str) -> ReasoningDelta: ...


REASONING_PARSERS: dict[str, type[ThinkReasoningParser] | type[HarmonyReasoningParser]] = {
    "think": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "harmony": HarmonyReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,
}
"""Named reasoning parsers; "auto" picks "harmony" for gpt-oss's template, "think" for a template that
mentions `<think>`."""

HARMONY_PARSERS = frozenset({"harmony", "openai_gptoss"})
"""Parsers that read special tokens (the harmony markers): their requests keep them in the text."""


def make_reasoning_parser(name: str, *, starts_in_reasoning: bool) -> ReasoningParser:
    return REASONING_PARSERS[name](starts_in_reasoning=starts_in_reasoning)


def resolve_reasoning_parser(name: str | None, chat_template: str | None) -> str | None:
    """The parser to use for `name` ("auto", "none" or a key of REASONING_PARSERS), or None.

    Raises ValueError listing the supported names for anything else (a configuration error).
    """
    if name is None or name in ("", "none"):
        return None
    if name == "auto":
        if is_harmony_template(chat_template):
            return "harmony"
        return "think" if chat_template is not None and THINK_START in chat_template else None
    if name not in REASONING_PARSERS:
        supported = ", ".join(["auto", "none", *REASONING_PARSERS])
        raise ValueError(f"unknown reasoning parser {name!r}; supported: {supported}")
    return name


def reasoning_in_think_block(name: str | None) -> bool:
    """Whether the parser's reasoning is a `<think>` block, which a constraint on the answer leaves
    free (izh.api.common.constraints.answer_only); harmony's channels are not constrained that way."""
    return name is not None and name not in HARMONY_PARSERS
