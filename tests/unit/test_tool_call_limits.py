"""The end of a message of tool calls: repeated calls (forced tool_choice) and max_calls
(parallel_tool_calls false) end it, at every split of the text, without a repeat's delta ever
going out; what the parser returns streamed equals what it returns whole."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from izh.api.chat.choices import ChoiceParsers
from izh.parsers.hermes import HermesToolParser
from izh.parsers.llama3 import Llama3JsonToolParser
from izh.parsers.tool_calls import ContentDelta, Delta, ToolCallDelta, ToolParser, collect

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
PARIS_SPACED = '{ "name":"get_weather" ,"arguments":{\n  "city" : "Paris",\n  "days" : 2\n} }'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
NOW = '{"name": "now", "arguments": {}}'


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def run(
    pieces: list[str],
    *,
    max_calls: int | None = None,
    drop_repeats: bool = False,
    parser_class: type[ToolParser] = HermesToolParser,
) -> tuple[list[Delta], ToolParser]:
    parser = parser_class()
    parser.limit_calls(max_calls, drop_repeats=drop_repeats)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)]
    return deltas + parser.finish(), parser


def outcome(deltas: list[Delta]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = collect(deltas)
    return content, [(call.name, call.arguments) for call in calls]


def splits(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


PARIS_ARGUMENTS = '{"city": "Paris", "days": 2}'
OSLO_ARGUMENTS = '{"city": "Oslo", "days": 2}'

# (text, limits, expected calls, done)
CASES: list[tuple[str, dict[str, object], list[tuple[str, str]], bool]] = [
    # A repeat ends the message: neither it nor anything after it comes back.
    (
        "\n".join([block(PARIS), block(PARIS), block(NOW)]),
        {"drop_repeats": True},
        [("get_weather", PARIS_ARGUMENTS)],
        True,
    ),
    # The same call spelled with other whitespace is the same call.
    (
        "\n".join([block(PARIS), block(PARIS_SPACED)]),
        {"drop_repeats": True},
        [("get_weather", PARIS_ARGUMENTS)],
        True,
    ),
    # The same function with other arguments is a new call, and so is one after it.
    (
        "\n".join([block(PARIS), block(OSLO), block(NOW)]),
        {"drop_repeats": True},
        [("get_weather", PARIS_ARGUMENTS), ("get_weather", OSLO_ARGUMENTS), ("now", "{}")],
        False,
    ),
    # Cut off while it could still be a repeat: taken for one.
    (
        block(PARIS) + "\n<tool_call>\n" + PARIS[:40],
        {"drop_repeats": True},
        [("get_weather", PARIS_ARGUMENTS)],
        True,
    ),
    # Cut off once it differs: a call with the arguments it had.
    (
        block(PARIS) + "\n<tool_call>\n" + OSLO[:48],
        {"drop_repeats": True},
        [("get_weather", PARIS_ARGUMENTS), ("get_weather", OSLO_ARGUMENTS[:11])],
        False,
    ),
    # Without drop_repeats (tool_choice "auto") repeats come back.
    (
        "\n".join([block(PARIS), block(PARIS)]),
        {},
        [("get_weather", PARIS_ARGUMENTS)] * 2,
        False,
    ),
    # max_calls: the message is over after that many calls; content after them is ignored too.
    (
        "Sure. " + block(PARIS) + " and " + block(NOW),
        {"max_calls": 1},
        [("get_weather", PARIS_ARGUMENTS)],
        True,
    ),
    (
        "\n".join([block(PARIS), block(NOW), block(OSLO)]),
        {"max_calls": 2},
        [("get_weather", PARIS_ARGUMENTS), ("now", "{}")],
        True,
    ),
    # A call cut off (max_tokens) does not end the message: the engine's finish reason stands.
    ("<tool_call>\n" + PARIS[:52], {"max_calls": 1}, [("get_weather", PARIS_ARGUMENTS[:15])], False),
    # One whose block closed before its arguments did still counts: the next call is past the limit.
    (
        '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>' + block(NOW),
        {"max_calls": 1},
        [("f", '{"x": 1')],
        True,
    ),
    # A call parsed whole (its JSON starts with the arguments) counts the same way.
    (
        block(PARIS) + block('{"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}'),
        {"drop_repeats": True},
        [("get_weather", PARIS_ARGUMENTS)],
        True,
    ),
]


@pytest.mark.parametrize(("text", "limits", "expected", "done"), CASES)
def test_limits_end_the_message_at_every_split(
    text: str, limits: dict[str, object], expected: list[tuple[str, str]], done: bool
) -> None:
    content = "Sure." if text.startswith("Sure.") else None
    for pieces in splits(text):
        deltas, parser = run(pieces, **limits)  # type: ignore[arg-type]
        assert outcome(deltas) == (content, expected), pieces
        assert parser.done == done
        # No delta of a dropped call ever went out: the indices are exactly the returned calls'.
        assert {d.index for d in deltas if isinstance(d, ToolCallDelta)} == set(range(len(expected)))


@settings(max_examples=100, deadline=None)
@given(case=st.sampled_from(CASES), cut_points=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_limits_at_random_splits(
    case: tuple[str, dict[str, object], list[tuple[str, str]], bool], cut_points: list[int]
) -> None:
    text, limits, expected, done = case
    cuts = sorted({0, len(text), *(min(cut, len(text)) for cut in cut_points)})
    deltas, parser = run([text[a:b] for a, b in itertools.pairwise(cuts)], **limits)  # type: ignore[arg-type]
    assert outcome(deltas)[1] == expected and parser.done == done


def test_a_possible_repeat_is_held_back_until_it_differs() -> None:
    text = block(PARIS) + "\n" + block(OSLO)
    parser = HermesToolParser()
    parser.limit_calls(None, drop_repeats=True)
    first_of_second = None
    for position, char in enumerate(text):
        for delta in parser.feed(char):
            if isinstance(delta, ToolCallDelta) and delta.index == 1 and delta.id is not None:
                first_of_second = position
    # "Oslo" differs from "Paris" at its first letter: the call goes out there, its end still to come.
    second = len(block(PARIS)) + 1
    assert (
        first_of_second == second + len('<tool_call>\n{"name": "get_weather", "arguments": {"city": "O') - 1
    )
    assert not parser.done


def test_the_rest_is_ignored_once_done() -> None:
    parser = HermesToolParser()
    parser.limit_calls(1, drop_repeats=False)
    deltas = parser.feed(block(NOW))
    assert parser.done and outcome(deltas) == (None, [("now", "{}")])
    assert parser.feed("more text " + block(PARIS)) == [] and parser.finish() == []


def test_llama3_json_repeats_and_max_calls() -> None:
    paris = PARIS.replace("arguments", "parameters")
    text = f"{paris}; {paris}; {NOW}"
    for pieces in splits(text):
        deltas, parser = run(pieces, drop_repeats=True, parser_class=Llama3JsonToolParser)
        assert outcome(deltas) == (None, [("get_weather", PARIS_ARGUMENTS)]) and parser.done
        deltas, parser = run(pieces, max_calls=2, parser_class=Llama3JsonToolParser)
        assert outcome(deltas) == (None, [("get_weather", PARIS_ARGUMENTS)] * 2) and parser.done
    deltas, parser = run([f"{NOW} and then some"], max_calls=1, parser_class=Llama3JsonToolParser)
    assert not any(isinstance(d, ContentDelta) for d in deltas) and parser.done


# ---- the chat route's view: when to stop, and the finish reason ---------------------------------


def test_choice_parsers_stop_at_a_forced_repeat_and_finish_with_tool_calls() -> None:
    forced = ChoiceParsers(reasoning=None, tools=HermesToolParser(), forced=True)
    _, deltas = forced.feed(block(NOW) + "\n" + block(NOW), finished=False)
    assert forced.stopped and outcome(deltas) == (None, [("now", "{}")])
    # The engine's answer to the abort that follows is ours, not the client's.
    assert forced.finish_reason("abort") == forced.finish_reason(None) == "tool_calls"
    # Not forced (tool_choice "auto"): repeats are the model's to make.
    auto = ChoiceParsers(reasoning=None, tools=HermesToolParser())
    _, deltas = auto.feed(block(NOW) + "\n" + block(NOW), finished=True)
    assert not auto.stopped and len(outcome(deltas)[1]) == 2 and auto.finish_reason("stop") == "tool_calls"


def test_choice_parsers_keep_length_for_a_call_cut_off() -> None:
    one = ChoiceParsers(reasoning=None, tools=HermesToolParser(), forced=True, max_calls=1)
    _, deltas = one.feed("<tool_call>\n" + PARIS[:52], finished=True)
    assert not one.stopped and one.finish_reason("length") == "length"
    assert outcome(deltas) == (None, [("get_weather", PARIS_ARGUMENTS[:15])])
    # Cut off while still the same text as the call before it: taken for a repeat.
    again = ChoiceParsers(reasoning=None, tools=HermesToolParser(), forced=True)
    _, deltas = again.feed(block(PARIS) + "\n<tool_call>\n" + PARIS[:52], finished=True)
    assert again.stopped and again.finish_reason("length") == "tool_calls"
    assert outcome(deltas) == (None, [("get_weather", PARIS_ARGUMENTS)])
