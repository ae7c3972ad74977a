"""Tool-call parsers: whole and streaming parsing agree at every split, arguments stream as they are
written, no markup reaches content, and the tool_choice grammar accepts exactly the well-formed calls."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from izh.errors import InvalidRequest
from izh.guided_spec import compile_grammar
from izh.parsers.hermes import HermesToolParser, render_tools_system_prompt
from izh.parsers.llama3 import Llama3JsonToolParser
from izh.parsers.tool_calls import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    collect,
    new_call_id,
)
from izh.parsers.tool_grammar import tool_call_grammar
from izh.parsers.tools import select_tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'


def calls(*pairs: tuple[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """Expected (name, arguments) pairs, arguments as JSON text."""
    return [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in pairs]


def whole(parser: type[ToolParser], text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, tool_calls = parser.extract(text)
    return content, [(call.name, call.arguments) for call in tool_calls]


HERMES_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        calls(("get_weather", {"city": "Paris", "unit": "celsius"})),
    ),
    (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        "Let me check.",
        calls(("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})),
    ),
    (
        f"<tool_call>{TIME}</tool_call> and then <tool_call>{WEATHER}</tool_call> done",
        "and then done",
        calls(("get_time", {"tz": "Europe/Paris"}), ("get_weather", {"city": "Paris", "unit": "celsius"})),
    ),
    # Whitespace around calls collapses; content on both sides keeps the space before the call.
    (
        f"Hello\n<tool_call>{TIME}</tool_call>\n\nBye\n",
        "Hello\nBye\n",
        calls(("get_time", {"tz": "Europe/Paris"})),
    ),
    (f"  \n<tool_call>{TIME}</tool_call>\n \n", None, calls(("get_time", {"tz": "Europe/Paris"}))),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', None, calls(("now", {}))),
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call>', None, calls(("now", {}))),
    ('<tool_call>{"name": "now", "arguments": null}</tool_call>', None, calls(("now", {}))),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, calls(("f", {"x": 1}))),
    (
        '<tool_call>{"arguments": {"q": "<tool_call>"}, "name": "s"}</tool_call>',
        None,
        calls(("s", {"q": "<tool_call>"})),
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"s": "a}</b> é \\n"}}</tool_call>',
        None,
        calls(("f", {"s": "a}</b> é \n"})),
    ),
    # Unclosed at the end (max_tokens, a stop string): a complete JSON still counts.
    (
        f"Sure.<tool_call>\n{WEATHER}\n</tool_",
        "Sure.",
        calls(("get_weather", {"city": "Paris", "unit": "celsius"})),
    ),
    # Plain text, including things that look like the start of a tag.
    ("The answer is 42.\n", "The answer is 42.\n", []),
    ("a < b and <tool but not a call <tool_cal", "a < b and <tool but not a call <tool_cal", []),
    ("  ", "  ", []),
    ("", None, []),
]

MALFORMED_HERMES = [
    "<tool_call>not json at all</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": NaN}"}</tool_call>',
    '<tool_call>{"arguments": {"x": 1}, "name": "f"',
]

# Calls from their header on: the arguments are what the model wrote, broken or cut off.
STREAMED_HERMES: list[tuple[str, list[tuple[str, str]]]] = [
    ('<tool_call>{"name": "f", "arguments": {"a": }</tool_call>', [("f", '{"a": }')]),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [("f", '{"x": NaN}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}, "extra": 2}</tool_call>', [("f", '{"x": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}', [("f", '{"x": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"x": [1, "a', [("f", '{"x": [1, "a')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>', [("f", '{"x": 1')]),
]

LLAMA3_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        calls(("get_weather", {"city": "Paris"})),
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [1, {"z": "}"}]}}',
        None,
        calls(("a", {"x": 1}), ("b", {"y": [1, {"z": "}"}]})),
    ),
    ('  {"name": "now", "parameters": {}};\n', None, calls(("now", {}))),
    ('{"name": "now"}', None, calls(("now", {}))),
    ('{"name": "f", "arguments": {"k": "v"}}', None, calls(("f", {"k": "v"}))),
    ('{"name": "a", "parameters": {}} then text', " then text", calls(("a", {}))),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("  plain {with braces}", "  plain {with braces}", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "a", "parameters": {"x": ', None, [("a", '{"x": ')]),  # cut off after its header
    ('{"name": "a", "parameters": [1]} more', '{"name": "a", "parameters": [1]} more', []),
    (
        '{"name": "a", "parameters": {"x": 1}, "id": 7} ; {"name": "b"}',
        None,
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    ('<|python_tag|>brave_search.call(query="x")', 'brave_search.call(query="x")', []),
    ("<|python_", "<|python_", []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "expected"), HERMES_CASES)
def test_hermes_whole(text: str, content: str | None, expected: list[tuple[str, str]]) -> None:
    assert whole(HermesToolParser, text) == (content, expected)


@pytest.mark.parametrize("text", MALFORMED_HERMES)
def test_hermes_malformed_call_stays_content(text: str) -> None:
    assert whole(HermesToolParser, text) == (text, [])
    assert whole(HermesToolParser, f"<tool_call>{TIME}</tool_call>{text}") == (
        text,
        calls(("get_time", {"tz": "Europe/Paris"})),
    )


@pytest.mark.parametrize(("text", "expected"), STREAMED_HERMES)
def test_hermes_call_streamed_from_its_header_keeps_its_arguments_as_written(
    text: str, expected: list[tuple[str, str]]
) -> None:
    assert whole(HermesToolParser, text) == (None, expected)


@pytest.mark.parametrize(("text", "content", "expected"), LLAMA3_CASES)
def test_llama3_json_whole(text: str, content: str | None, expected: list[tuple[str, str]]) -> None:
    assert whole(Llama3JsonToolParser, text) == (content, expected)


def test_call_ids_are_fresh_and_well_formed() -> None:
    _, tool_calls = HermesToolParser.extract(f"<tool_call>{TIME}</tool_call><tool_call>{TIME}</tool_call>")
    ids = [call.id for call in tool_calls]
    assert len(set(ids)) == 2
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id in ids)
    assert all(call.type == "function" for call in tool_calls)
    assert new_call_id() != new_call_id()


# ---- streaming ----------------------------------------------------------------------------------


def stream(parser_class: type[ToolParser], pieces: list[str]) -> list[Delta]:
    parser = parser_class()
    deltas: list[Delta] = []
    for piece in pieces:
        deltas.extend(parser.feed(piece))
    deltas.extend(parser.finish())
    return deltas


def assert_stream_matches_whole(parser_class: type[ToolParser], text: str, pieces: list[str]) -> None:
    deltas = stream(parser_class, pieces)
    content, tool_calls = collect(deltas)
    assert (content, [(c.name, c.arguments) for c in tool_calls]) == whole(parser_class, text), pieces
    _assert_call_deltas_well_formed(deltas, tool_calls)


def _assert_call_deltas_well_formed(deltas: list[Delta], tool_calls: list[ToolCall]) -> None:
    """The first delta of each call has id, type and name; the rest only argument fragments."""
    seen: set[int] = set()
    for delta in deltas:
        if not isinstance(delta, ToolCallDelta):
            assert delta.text
            continue
        if delta.index not in seen:
            assert delta.index == len(seen)
            assert delta.id and delta.type == "function" and delta.name
            seen.add(delta.index)
        else:
            assert delta.id is None and delta.name is None and delta.type is None
    assert len(seen) == len(tool_calls)


def splits(text: str) -> list[list[str]]:
    """Every two-piece split, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


HERMES: type[ToolParser] = HermesToolParser
LLAMA3: type[ToolParser] = Llama3JsonToolParser
ALL_CASES = [(HERMES, text) for text, _, _ in HERMES_CASES] + [(HERMES, text) for text in MALFORMED_HERMES]
ALL_CASES += [(HERMES, text) for text, _ in STREAMED_HERMES]
ALL_CASES += [(LLAMA3, text) for text, _, _ in LLAMA3_CASES]


@pytest.mark.parametrize(("parser_class", "text"), ALL_CASES)
def test_streaming_at_every_split_equals_whole(parser_class: type[ToolParser], text: str) -> None:
    for pieces in splits(text):
        assert_stream_matches_whole(parser_class, text, pieces)


@settings(max_examples=150, deadline=None)
@given(
    case=st.sampled_from(ALL_CASES),
    cut_points=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_streaming_at_random_splits_equals_whole(
    case: tuple[type[ToolParser], str], cut_points: list[int]
) -> None:
    parser_class, text = case
    cuts = sorted({0, len(text), *(min(cut, len(text)) for cut in cut_points)})
    pieces = [text[a:b] for a, b in itertools.pairwise(cuts)]
    assert_stream_matches_whole(parser_class, text, pieces)


@pytest.mark.parametrize("text", [text for text, _, expected in HERMES_CASES if expected])
def test_hermes_markup_never_reaches_content(text: str) -> None:
    for pieces in splits(text):
        for delta in stream(HermesToolParser, pieces):
            if isinstance(delta, ContentDelta):
                assert "<" not in delta.text and "tool_call" not in delta.text


def test_llama3_python_tag_never_reaches_content() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {}}'
    for pieces in splits(text):
        assert not any(isinstance(delta, ContentDelta) for delta in stream(Llama3JsonToolParser, pieces))


def test_content_streams_before_the_message_ends() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hello there") == [ContentDelta("Hello there")]
    assert parser.feed(" <tool") == []  # maybe a tag: held back
    assert parser.feed("kit>") == [ContentDelta(" <toolkit>")]
    header, fragment = parser.feed(f"\n<tool_call>{TIME}")
    assert isinstance(header, ToolCallDelta) and isinstance(fragment, ToolCallDelta)
    assert header.name == "get_time" and fragment.arguments == '{"tz": "Europe/Paris"}'
    assert parser.feed("</tool_call>") == []
    assert parser.finish() == []
    llama = Llama3JsonToolParser()
    assert llama.feed(" ") == []
    assert llama.feed("Hi") == [ContentDelta(" Hi")]
    assert llama.feed(" {x}") == [ContentDelta(" {x}")]


@pytest.mark.parametrize(
    ("parser_class", "text"),
    [
        (HERMES, f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>"),
        (LLAMA3, WEATHER.replace("arguments", "parameters")),
    ],
)
def test_arguments_stream_as_they_are_written(parser_class: type[ToolParser], text: str) -> None:
    """Fed a character at a time, a call's arguments arrive in as many fragments as they have
    characters, after a first delta with its name and empty arguments."""
    parser = parser_class()
    per_piece = [parser.feed(char) for char in text] + [parser.finish()]
    fragments = [d for piece in per_piece for d in piece if isinstance(d, ToolCallDelta) and d.id is None]
    (first,) = [d for piece in per_piece for d in piece if isinstance(d, ToolCallDelta) and d.id]
    assert (first.index, first.type, first.name, first.arguments) == (0, "function", "get_weather", "")
    arguments = '{"city": "Paris", "unit": "celsius"}'
    assert [f.arguments for f in fragments] == list(arguments)
    # Each fragment goes out with the character that completes it, not at the call's end.
    end_of_arguments = text.index(arguments) + len(arguments)
    assert all(not any(isinstance(d, ToolCallDelta) for d in piece) for piece in per_piece[end_of_arguments:])


def test_a_call_whose_json_starts_otherwise_waits_for_its_end() -> None:
    parser = HermesToolParser()
    assert parser.feed('<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}') == []
    header, fragment = parser.feed("</tool_call>")
    assert isinstance(header, ToolCallDelta) and isinstance(fragment, ToolCallDelta)
    assert (header.name, fragment.arguments) == ("get_time", '{"tz": "UTC"}')


# ---- registry and prompt ------------------------------------------------------------------------

QWEN_TEMPLATE = "{%- if tools %}<tools>{{ tool | tojson }}</tools> <tool_call>{% endif %}<|im_start|>"
LLAMA3_TEMPLATE = (
    '<|start_header_id|>ipython<|end_header_id|>{"name": function name, "parameters": ...}<|python_tag|>'
)


def test_registry_selects_by_name_or_template() -> None:
    assert select_tool_parser("auto", QWEN_TEMPLATE) is HermesToolParser
    assert select_tool_parser("auto", LLAMA3_TEMPLATE) is Llama3JsonToolParser
    assert select_tool_parser("auto", "{{ messages }}") is HermesToolParser
    assert select_tool_parser("auto", None) is HermesToolParser
    assert select_tool_parser("llama3_json", QWEN_TEMPLATE) is Llama3JsonToolParser
    assert select_tool_parser("none", QWEN_TEMPLATE) is None
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        select_tool_parser("xlam", None)


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The current time."}},
]


def test_tools_system_prompt_lists_every_tool() -> None:
    prompt = render_tools_system_prompt(TOOLS)
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == TOOLS
    assert "<tool_call>" in prompt and "</tool_call>" in prompt


# ---- the tool_choice grammar --------------------------------------------------------------------


class _ByteTokenizer:
    """One token per byte plus EOS, so a matcher checks strings exactly."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def grammar_accepts(
    ll_tokenizer: llguidance.LLTokenizer, tool_choice: Any, text: str, parallel: bool = True
) -> bool:
    spec = tool_call_grammar(TOOLS, tool_choice, parallel)
    assert spec is not None
    matcher = llguidance.LLMatcher(ll_tokenizer, compile_grammar(spec), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER_CALL = block('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}')
NOW_CALL = block('{"name": "now", "arguments": {}}')


def test_required_accepts_valid_calls_of_any_tool(ll_tokenizer: llguidance.LLTokenizer) -> None:
    for text in (
        WEATHER_CALL,
        NOW_CALL,
        f"{WEATHER_CALL}\n{NOW_CALL}",
        block('{"name":"get_weather","arguments":{"city":"x"}}'),
    ):
        assert grammar_accepts(ll_tokenizer, "required", text), text
        content, tool_calls = HermesToolParser.extract(text)
        assert content is None and tool_calls


@pytest.mark.parametrize(
    "text",
    [
        "Sure! " + WEATHER_CALL,  # content before the call
        block('{"name": "get_weather", "arguments": {"unit": "celsius"}}'),  # a required argument missing
        block('{"name": "get_weather", "arguments": {"city": 3}}'),  # wrong type
        block('{"name": "get_weather", "arguments": {"city": "x", "extra": 1}}'),  # not allowed
        block('{"name": "get_weather", "arguments": {"city": "x", "unit": "kelvin"}}'),  # not in the enum
        block('{"name": "now", "arguments": {"x": 1}}'),  # a parameterless tool takes {}
        block('{"name": "unknown", "arguments": {}}'),
        block('{"arguments": {}, "name": "now"}'),
        "<tool_call>"
        + '{"name": "now", "arguments": {}}'
        + "</tool_call>",  # newlines are part of the format
        WEATHER_CALL[:-3],
        "",
    ],
)
def test_required_rejects_invalid_calls(ll_tokenizer: llguidance.LLTokenizer, text: str) -> None:
    assert not grammar_accepts(ll_tokenizer, "required", text)


def test_named_tool_and_parallel_calls(ll_tokenizer: llguidance.LLTokenizer) -> None:
    named = {"type": "function", "function": {"name": "now"}}
    assert grammar_accepts(ll_tokenizer, named, NOW_CALL)
    assert not grammar_accepts(ll_tokenizer, named, WEATHER_CALL)
    # A named tool is called exactly once (OpenAI's behaviour), parallel calls or not.
    assert not grammar_accepts(ll_tokenizer, named, f"{NOW_CALL}\n{NOW_CALL}")
    assert not grammar_accepts(ll_tokenizer, named, f"{NOW_CALL}\n{NOW_CALL}", parallel=False)
    assert grammar_accepts(ll_tokenizer, "required", f"{NOW_CALL}\n{WEATHER_CALL}")
    assert grammar_accepts(ll_tokenizer, "required", WEATHER_CALL, parallel=False)
    assert not grammar_accepts(ll_tokenizer, "required", f"{NOW_CALL}\n{WEATHER_CALL}", parallel=False)


def test_listed_arguments_are_all_a_call_takes_unless_the_schema_opens_them(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    def accepts(parameters: dict[str, Any], arguments: str) -> bool:
        tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        spec = tool_call_grammar(tools, "required", False)
        assert spec is not None
        matcher = llguidance.LLMatcher(ll_tokenizer, compile_grammar(spec), log_level=0)
        text = block(f'{{"name": "f", "arguments": {arguments}}}')
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    # LangChain's @tool schemas list properties and say nothing of other keys.
    silent = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert accepts(silent, '{"city": "Oslo"}')
    assert not accepts(silent, '{"city": "Oslo", "country": "NO"}')
    nested = {"type": "object", "properties": {"place": silent}}
    assert not accepts(nested, '{"place": {"city": "Oslo", "zip": 1}}')
    opened = dict(silent, additionalProperties=True)
    assert accepts(opened, '{"city": "Oslo", "country": "NO"}')


def test_tool_choice_without_constraint_or_invalid() -> None:
    assert tool_call_grammar(TOOLS, "auto", True) is None
    assert tool_call_grammar(TOOLS, "none", True) is None
    assert tool_call_grammar(TOOLS, None, True) is None
    with pytest.raises(InvalidRequest) as info:
        tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "missing"}}, True)
    assert info.value.param == "tool_choice" and "missing" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        tool_call_grammar([], "required", True)
    assert info.value.param == "tools"
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]
    with pytest.raises(InvalidRequest) as info:
        tool_call_grammar(bad_schema, "required", True)
    assert info.value.param == "tools" and "if" in info.value.message
