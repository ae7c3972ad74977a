"""One chat choice's output, parsed: reasoning first, then tool calls in what is left (ChoiceParsers),
the tool-call parser a request gets, and ChatContext, what the stream and the collected answer share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from izh.api.chat.prompt import ChatPrompt
from izh.api.common.chat_protocol import (
    NamedToolChoice,
)
from izh.api.common.state import ApiState
from izh.parsers.hermes import HermesToolParser
from izh.parsers.loose import LooseToolParser
from izh.parsers.reasoning_parsers import ReasoningParser, make_reasoning_parser
from izh.parsers.tool_calls import ContentDelta, Delta, ToolParser
from izh.parsers.tools import select_tool_parser


def chat_tool_parser(
    state: ApiState, tool_choice: str | NamedToolChoice, tools_on: bool, prompt: ChatPrompt
) -> type[ToolParser] | None:
    """The parser for this request's output, or None when tool calls are not looked for.

    Forced calls and the Hermes tools prompt mean Hermes text, whatever the template; otherwise
    the configured parser ("auto": the one the template's tool format calls for).
    """
    if not tools_on:
        return None
    if tool_choice != "auto":
        return HermesToolParser
    if state.tool_call_parser == "none":
        return None
    if prompt.hermes_tools:
        return HermesToolParser
    return select_tool_parser(state.tool_call_parser, prompt.template)


@dataclass(slots=True)
class ChoiceParsers:
    """One choice's output parsers: reasoning first, then tool calls in what is left (the content).

    With `forced` calls, content can only be a block cut short (max_tokens): it is dropped, never
    shown as markup, and a repeated call ends the message. With `max_calls` (parallel_tool_calls
    false), the message ends after that many calls. Once it has ended (`stopped`), the caller stops
    the generation.
    """

    reasoning: ReasoningParser | None
    tools: ToolParser | None
    forced: bool = False
    max_calls: int | None = None
    num_calls: int = 0

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.tools.limit_calls(self.max_calls, drop_repeats=self.forced)

    @property
    def stopped(self) -> bool:
        """The tool calls ended the message: the rest of the output is to be ignored."""
        return self.tools is not None and self.tools.done

    def feed(self, text: str, finished: bool) -> tuple[str, list[Delta]]:
        """(reasoning, content and tool-call deltas) of the next piece of output."""
        reasoning, content = "", text
        if self.reasoning is not None:
            delta = self.reasoning.feed(text)
            reasoning, content = delta.reasoning, delta.content
            if finished:
                tail = self.reasoning.finish()
                reasoning, content = reasoning + tail.reasoning, content + tail.content
        if self.tools is None:
            return reasoning, [ContentDelta(content)] if content else []
        deltas = self.tools.feed(content) if content else []
        if finished:
            deltas += self.tools.finish()
        return reasoning, self._kept(deltas)

    def _kept(self, deltas: list[Delta]) -> list[Delta]:
        kept: list[Delta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                if not self.forced:
                    kept.append(delta)
            else:
                kept.append(delta)
                self.num_calls = max(self.num_calls, delta.index + 1)
        return kept

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools, or the calls ended the
        message (the engine's "abort" of a stopped choice is ours, not the client's)."""
        if self.stopped:
            return "tool_calls"
        return "tool_calls" if reason == "stop" and self.num_calls else reason


@dataclass(slots=True)
class ChatContext:
    """What the response builders need besides the outputs."""

    id: str
    created: int
    model: str
    parser_name: str | None
    starts_in_reasoning: bool
    echo_text: str | None
    top_logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    tool_parser: type[ToolParser] | None = None
    loose_tool_names: frozenset[str] | None = None
    """With tool_choice "auto": the offered tools, whose calls wrapped wrong count too (LooseToolParser)."""
    forced_tool_calls: bool = False
    max_tool_calls: int | None = None
    parsers: dict[int, ChoiceParsers] = field(default_factory=dict)

    @property
    def tools_on(self) -> bool:
        return self.tool_parser is not None

    def new_parsers(self) -> ChoiceParsers:
        reasoning = None
        if self.parser_name is not None:
            reasoning = make_reasoning_parser(self.parser_name, starts_in_reasoning=self.starts_in_reasoning)
        tools = self.tool_parser() if self.tool_parser is not None else None
        if tools is not None and self.loose_tool_names is not None:
            tools = LooseToolParser(tools, self.loose_tool_names)
        return ChoiceParsers(
            reasoning=reasoning,
            tools=tools,
            forced=self.forced_tool_calls,
            max_calls=self.max_tool_calls,
        )

    def parser(self, index: int) -> ChoiceParsers:
        """The streaming parsers of choice `index`."""
        parsers = self.parsers.get(index)
        if parsers is None:
            parsers = self.parsers[index] = self.new_parsers()
        return parsers
