"""gpt-oss's harmony format: recorded outputs (as gpt-oss writes them after its template's
`<|start|>assistant`; `<|call|>` / `<|return|>` end the generation, so most outputs end without them)
parse into the reasoning, content and tool calls the format means, through the reasoning parser and the
tool parser together as chat runs them (ChoiceParsers); streamed at every split point, and one
character at a time, they give exactly the non-streamed result. `auto` picks both parsers from
gpt-oss's template; the names are "harmony" and vLLM's "openai" / "openai_gptoss"."""

from __future__ import annotations

import json

import pytest

from izh.api.chat.choices import ChoiceParsers
from izh.parsers.harmony import HarmonyReasoningParser, HarmonyToolParser
from izh.parsers.reasoning_parsers import (
    REASONING_PARSERS,
    reasoning_in_think_block,
    resolve_reasoning_parser,
)
from izh.parsers.tool_calls import collect
from izh.parsers.tools import detect_tool_parser, select_tool_parser

# The parts of gpt-oss's chat template the detection reads (its generation prompt and tool calls).
GPT_OSS_TEMPLATE = (
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>commentary to=' + tool_call.name + ' <|constrain|>json<|message|>' }}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
)

# (recorded output, reasoning, content, [(name, arguments as JSON)])
RECORDED = [
    pytest.param(
        '<|channel|>analysis<|message|>User asks: "What is 2+2?" Simple arithmetic. Provide answer.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
        'User asks: "What is 2+2?" Simple arithmetic. Provide answer.',
        "2 + 2 = 4.",
        [],
        id="reasoning-then-final",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>The user wants the weather in Paris. We have get_weather. Call it."
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"Paris, France","unit":"celsius"}',
        "The user wants the weather in Paris. We have get_weather. Call it.",
        "",
        [("get_weather", '{"location":"Paris, France","unit":"celsius"}')],
        id="reasoning-then-call",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"location": "Tokyo"}<|call|>',
        "Need the weather.",
        "",
        [("get_weather", '{"location": "Tokyo"}')],
        id="recipient-before-channel",
    ),
    pytest.param(
        ' to=functions.get_current_time<|channel|>commentary json<|message|>{"timezone": "UTC"}',
        "",
        "",
        [("get_current_time", '{"timezone": "UTC"}')],
        id="recipient-right-after-the-prompt",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Check the weather first.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Let me check the weather for you.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"location":"Berlin"}<|call|>',
        "Check the weather first.",
        "Let me check the weather for you.",
        [("get_weather", '{"location":"Berlin"}')],
        id="preamble-then-call",
    ),
    pytest.param(
        "<|channel|>commentary to=functions.list_files <|constrain|>json<|message|><|call|>",
        "",
        "",
        [("list_files", "{}")],
        id="parameterless-call",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>Let me think about the <b>units</b> here|",
        "Let me think about the <b>units</b> here|",
        "",
        [],
        id="cut-off-in-analysis",
    ),
    pytest.param(
        "<|channel|>final<|message|>Done.<|return|>",
        "",
        "Done.",
        [],
        id="final-only-with-return",
    ),
    pytest.param(
        "<|channel|>analysis<|message|>No end marker<|start|>assistant<|channel|>final<|message|>Hi",
        "No end marker",
        "Hi",
        [],
        id="next-start-ends-a-message",
    ),
    pytest.param(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [],
        id="no-harmony-markup-is-content",
    ),
]


def _run(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    parsers = ChoiceParsers(reasoning=HarmonyReasoningParser(), tools=HarmonyToolParser())
    reasoning, deltas = "", []
    for i, piece in enumerate(pieces):
        more_reasoning, more = parsers.feed(piece, finished=i == len(pieces) - 1)
        reasoning += more_reasoning
        deltas += more
    content, calls = collect(deltas)
    return reasoning, content or "", [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize(("output", "reasoning", "content", "calls"), RECORDED)
def test_recorded_outputs_parse_alike_streamed_and_whole(
    output: str, reasoning: str, content: str, calls: list[tuple[str, str]]
) -> None:
    whole = _run([output])
    assert whole == (reasoning, content, calls)
    for name, arguments in calls:
        assert isinstance(json.loads(arguments), dict), name
    for split in range(1, len(output)):
        assert _run([output[:split], output[split:]]) == whole, split
    assert _run(list(output)) == whole


def test_the_tool_parser_alone_drops_analysis_and_keeps_the_answer() -> None:
    output = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    assert HarmonyToolParser.extract(output) == ("Hello!", [])
    reasoning = HarmonyReasoningParser().parse_all(output)
    assert (reasoning.reasoning, reasoning.content) == ("Think.", "Hello!")


def test_a_prompt_that_opened_the_analysis_starts_in_reasoning() -> None:
    parser = HarmonyReasoningParser(starts_in_reasoning=True)
    assert parser.thinking
    delta = parser.parse_all("still thinking<|end|><|start|>assistant<|channel|>final<|message|>ok")
    assert (delta.reasoning, delta.content) == ("still thinking", "ok")


def test_max_calls_ends_the_message_after_the_first_call() -> None:
    call = (
        '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    )
    parser = HarmonyToolParser()
    parser.limit_calls(1, drop_repeats=False)
    content, calls = collect(parser.feed(call + call.replace("functions.f", "functions.g")) + parser.finish())
    assert [c.name for c in calls] == ["f"] and parser.done and content is None


def test_auto_picks_harmony_from_gpt_oss_template() -> None:
    assert detect_tool_parser(GPT_OSS_TEMPLATE) == "harmony"
    assert resolve_reasoning_parser("auto", GPT_OSS_TEMPLATE) == "harmony"
    assert select_tool_parser("openai", None) is HarmonyToolParser
    assert select_tool_parser("harmony", None) is HarmonyToolParser
    assert REASONING_PARSERS["openai_gptoss"] is HarmonyReasoningParser
    assert resolve_reasoning_parser("auto", "{{ '<think>' }}") == "think"
    # A constraint on a harmony model's output applies to all of it: there is no <think> block to skip.
    assert not reasoning_in_think_block("harmony") and reasoning_in_think_block("think")
