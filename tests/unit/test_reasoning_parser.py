"""The <think> reasoning parser: streamed deltas split anywhere (even inside a tag) give exactly the
non-streaming split."""

from __future__ import annotations

import pytest

from izh.parsers.reasoning import ReasoningDelta, ThinkReasoningParser, prompt_ends_in_reasoning
from izh.parsers.reasoning_parsers import resolve_reasoning_parser


def _stream(pieces: list[str], *, starts_in_reasoning: bool = False) -> tuple[str, str, list[ReasoningDelta]]:
    parser = ThinkReasoningParser(starts_in_reasoning=starts_in_reasoning)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def _whole(text: str, *, starts_in_reasoning: bool = False) -> tuple[str, str]:
    split = ThinkReasoningParser(starts_in_reasoning=starts_in_reasoning).parse_all(text)
    return split.reasoning, split.content


CASES = [
    # (output, starts_in_reasoning, reasoning, content)
    ("<think>step 1, step 2</think>\n\nThe answer is 4.", False, "step 1, step 2", "The answer is 4."),
    ("\n<think>\nhmm\n</think>Yes", False, "\nhmm\n", "Yes"),
    ("step 1</think>\n\nDone.", True, "step 1", "Done."),
    ("Just an answer with a <think> tag inside.", False, "", "Just an answer with a <think> tag inside."),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    (
        "<think>a < b and </thinking> is not the end</think>ok",
        False,
        "a < b and </thinking> is not the end",
        "ok",
    ),
    ("<think></think>", False, "", ""),
    ("<thi", False, "", "<thi"),
    ("thinking with a partial end </thi", True, "thinking with a partial end </thi", ""),
    ("", False, "", ""),
]


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), CASES)
def test_whole_output_split(text: str, starts: bool, reasoning: str, content: str) -> None:
    assert _whole(text, starts_in_reasoning=starts) == (reasoning, content)


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), CASES)
def test_every_two_piece_split_streams_the_same(
    text: str, starts: bool, reasoning: str, content: str
) -> None:
    for cut in range(len(text) + 1):
        streamed = _stream([text[:cut], text[cut:]], starts_in_reasoning=starts)[:2]
        assert streamed == (reasoning, content), f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), CASES)
def test_one_character_at_a_time_streams_the_same(
    text: str, starts: bool, reasoning: str, content: str
) -> None:
    assert _stream(list(text), starts_in_reasoning=starts)[:2] == (reasoning, content)


def test_a_partial_tag_is_held_back_not_leaked() -> None:
    parser = ThinkReasoningParser()
    assert parser.feed("<th") == ReasoningDelta("", "")
    assert parser.feed("ink>abc </th") == ReasoningDelta("abc ", "")
    assert parser.feed("ink>") == ReasoningDelta("", "")  # the whitespace after the tag may follow
    assert parser.feed("\n\nHi") == ReasoningDelta("", "Hi")
    assert parser.feed(" there") == ReasoningDelta("", " there")


def test_prompt_that_opens_a_think_block() -> None:
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    # Qwen3 with enable_thinking=False closes an empty block in the prompt: the answer is content.
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n")


def test_resolve_parser_names() -> None:
    assert resolve_reasoning_parser("auto", "{{ '<think>' }}") == "think"
    assert resolve_reasoning_parser("auto", "{{ messages }}") is None
    assert resolve_reasoning_parser("auto", None) is None
    assert resolve_reasoning_parser("none", "<think>") is None
    assert resolve_reasoning_parser("qwen3", None) == "qwen3"
    with pytest.raises(ValueError, match="supported: auto, none, think"):
        resolve_reasoning_parser("nonsense", None)
