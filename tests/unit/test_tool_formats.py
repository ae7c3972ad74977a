"""The model-family tool-call formats (Mistral, Qwen3-Coder, pythonic, DeepSeek V3, Granite, Phi-4-mini):
recorded outputs, written as each family's chat template tells its model to write calls, parse into the
calls the template describes; streamed at every split point and one character at a time, the deltas
add up to the whole parse; `--tool-call-parser auto` picks each format from its template's markers.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from izh.parsers.deepseek import DeepSeekV3ToolParser
from izh.parsers.json_formats import GraniteToolParser, MistralToolParser, Phi4MiniJsonToolParser
from izh.parsers.pythonic import PythonicToolParser
from izh.parsers.qwen3_coder import Qwen3CoderToolParser
from izh.parsers.tool_calls import ContentDelta, Delta, ToolCallDelta, ToolParser, collect
from izh.parsers.tools import TOOL_PARSERS, detect_tool_parser, select_tool_parser

PARIS = {"city": "Paris", "days": 3}
TIME = {"tz": "Europe/Paris"}


def call(name: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return name, arguments


Case = tuple[type[ToolParser], str, str | None, list[tuple[str, dict[str, Any]]]]

CASES: list[Case] = [
    # Mistral v0.3: a JSON array after [TOOL_CALLS].
    (
        MistralToolParser,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        None,
        [call("get_weather", PARIS)],
    ),
    (
        MistralToolParser,
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        "Checking.",
        [call("get_weather", PARIS), call("get_time", TIME)],
    ),
    # Mistral Small 3.2 / Devstral (tokenizer v11+): name[ARGS]{...}, one marker per call.
    (
        MistralToolParser,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        None,
        [call("get_weather", PARIS), call("get_time", TIME)],
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Europe/Paris"}',
        None,
        [call("get_time", TIME)],
    ),
    (MistralToolParser, "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    (MistralToolParser, "[TOOL_CALLS] not a call", "[TOOL_CALLS] not a call", []),
    # Qwen3-Coder: XML functions and parameters inside <tool_call>.
    (
        Qwen3CoderToolParser,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [call("get_weather", PARIS)],
    ),
    (
        Qwen3CoderToolParser,
        "I'll look both up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>",
        "I'll look both up.",
        [call("get_weather", PARIS), call("get_time", TIME)],
    ),
    (
        Qwen3CoderToolParser,
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
        'print("hi")\nprint(2)\n</parameter>\n<parameter=options>\n{"mode": "w"}\n</parameter>\n</function>\n</tool_call>',
        None,
        [call("write_file", {"path": "a.py", "content": 'print("hi")\nprint(2)', "options": {"mode": "w"}})],
    ),
    (Qwen3CoderToolParser, "<function=list_files>\n</function>", None, [call("list_files", {})]),
    (Qwen3CoderToolParser, "Use <tool_call> tags, not this.", "Use <tool_call> tags, not this.", []),
    # Llama 3.2 / Llama 4 pythonic lists.
    (
        PythonicToolParser,
        '[get_weather(city="Paris", days=3), get_time(tz="Europe/Paris")]',
        None,
        [call("get_weather", PARIS), call("get_time", TIME)],
    ),
    (
        PythonicToolParser,
        '<|python_start|>[get_time(tz="Europe/Paris")]<|python_end|>',
        None,
        [call("get_time", TIME)],
    ),
    (
        PythonicToolParser,
        "[search(query='a ] b', filters={'lang': ['en', 'fr']}, exact=True)]",
        None,
        [call("search", {"query": "a ] b", "filters": {"lang": ["en", "fr"]}, "exact": True})],
    ),
    (PythonicToolParser, "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    (PythonicToolParser, "Paris is sunny.", "Paris is sunny.", []),
    # DeepSeek V3 (and R1) and V3.1.
    (
        DeepSeekV3ToolParser,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        '```json\n{"tz": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [call("get_weather", PARIS), call("get_time", TIME)],
    ),
    (
        DeepSeekV3ToolParser,
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
        '{"tz": "Europe/Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me check.",
        [call("get_time", TIME)],
    ),
    # Granite 3.x.
    (
        GraniteToolParser,
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        None,
        [call("get_weather", PARIS)],
    ),
    (
        GraniteToolParser,
        'Sure. <|tool_call|>[{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}] Done.',
        "Sure. Done.",
        [call("get_time", TIME)],
    ),
    # Phi-4-mini.
    (
        Phi4MiniJsonToolParser,
        'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        None,
        [call("get_weather", PARIS), call("get_time", TIME)],
    ),
    (
        Phi4MiniJsonToolParser,
        "functools are Python's; no call here.",
        "functools are Python's; no call here.",
        [],
    ),
]


def _parsed(deltas: list[Delta]) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    content, calls = collect(deltas)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser_cls: type[ToolParser], pieces: list[str]) -> list[Delta]:
    parser = parser_cls()
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


@pytest.mark.parametrize(("parser_cls", "text", "content", "expected"), CASES)
def test_recorded_outputs_parse_into_their_calls(
    parser_cls: type[ToolParser], text: str, content: str | None, expected: list[Any]
) -> None:
    whole_content, calls = parser_cls.extract(text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(("parser_cls", "text", "content", "expected"), CASES)
def test_streamed_and_whole_agree_at_every_split(
    parser_cls: type[ToolParser], text: str, content: str | None, expected: list[Any]
) -> None:
    one_by_one = _streamed(parser_cls, list(text))
    assert _parsed(one_by_one) == (content, expected)
    for split in range(1, len(text)):
        assert _parsed(_streamed(parser_cls, [text[:split], text[split:]])) == (content, expected), split
    # The first delta of each call carries its id and name; markup never reaches the content.
    firsts = [d for d in one_by_one if isinstance(d, ToolCallDelta) and d.id is not None]
    assert [d.name for d in firsts] == [name for name, _ in expected]
    text_out = "".join(d.text for d in one_by_one if isinstance(d, ContentDelta))
    if expected:
        for marker in (
            "[TOOL_CALLS]",
            "<function=",
            "<｜tool",
            "<|tool_call|>",
            "functools[",
            "<|python_start|>",
        ):
            assert marker not in text_out


def test_arguments_stream_as_they_are_written() -> None:
    # The JSON formats stream each call's arguments before the call is complete.
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
    parser = MistralToolParser()
    early = parser.feed(text[:-8])
    assert isinstance(early[0], ToolCallDelta) and early[0].name == "get_weather"
    assert "".join(d.arguments for d in early if isinstance(d, ToolCallDelta)) == text[:-8].split("[ARGS]")[1]
    qwen = Qwen3CoderToolParser()
    deltas = qwen.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    assert "".join(d.arguments for d in deltas if isinstance(d, ToolCallDelta)) == '{"city": "Paris"'


def test_a_call_cut_off_keeps_what_it_had() -> None:
    content, calls = Qwen3CoderToolParser.extract(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parame"
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    content, calls = MistralToolParser.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]


TEMPLATES = {
    "qwen3_coder": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + '>\\n' }}",
    "deepseek_v3": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
    "mistral": '{{- "[TOOL_CALLS]" }}{{- tool_call.function.name + "[ARGS]" }}',
    "granite": "{%- if message['role'] == 'assistant_tool_call' %}{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}",
    "phi4_mini_json": "{% if 'tools' in message %}{{'<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>'}}",
    "pythonic": "{{- '<|python_start|>' }}",
    "hermes": '{{- \'<tool_call>\\n{"name": "\' + tool_call.name }}',
    "llama3_json": "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}<|start_header_id|>",
}


@pytest.mark.parametrize(("name", "template"), sorted(TEMPLATES.items()))
def test_auto_picks_the_format_from_the_template(name: str, template: str) -> None:
    assert detect_tool_parser(template) == name
    assert select_tool_parser("auto", template) is TOOL_PARSERS[name]


def test_a_named_parser_is_forced_and_an_unknown_one_lists_them() -> None:
    assert select_tool_parser("pythonic", TEMPLATES["hermes"]) is PythonicToolParser
    with pytest.raises(ValueError, match="qwen3_coder"):
        select_tool_parser("nonsense", None)
