"""Tool calls written in the wrong wrapper (izh.parsers.loose) and the tool_choice "auto" grammar.

Outputs as small models write them when offered tools: Qwen2.5-Coder-1.5B driving Codex fences its
call in ```json; Qwen2.5 models drop the `<tool_call>` tags; some write `<tools>`; some write a JSON
array of calls. Each is parsed into the calls, whole and streamed at every split alike, on top of
the Hermes and the Llama 3 JSON parsers; JSON that is no call to an offered tool stays content.
The auto grammar accepts any text without the start tag, or text then well-formed calls, and
nothing else."""

from __future__ import annotations

import json

import llguidance
import pytest

from izh.guided_spec import compile_grammar
from izh.parsers.hermes import HermesToolParser
from izh.parsers.llama3 import Llama3JsonToolParser
from izh.parsers.loose import LooseToolParser
from izh.parsers.tool_calls import ContentDelta, Delta, ToolCallDelta, ToolParser, collect
from izh.parsers.tool_grammar import auto_tool_call_grammar
from tests.unit.test_tool_parsers import TOOLS, _ByteTokenizer

NAMES = {"exec_command", "get_weather"}
EXEC = '{"name": "exec_command", "arguments": {"cmd": ["python3", "hello.py"], "workdir": "/tmp/x"}}'
EXEC_CALL = ("exec_command", json.dumps({"cmd": ["python3", "hello.py"], "workdir": "/tmp/x"}))
EXEC_FUNCTION_KEY = EXEC.replace('"name"', '"function"')
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS_CALL = ("get_weather", '{"city": "Paris"}')
OSLO_CALL = ("get_weather", '{"city": "Oslo"}')

CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    # Qwen2.5-Coder-1.5B-Instruct Q4_K_M, asked by Codex to run hello.py (the recording).
    (f"```json\n{EXEC}\n```", None, [EXEC_CALL]),
    (
        f"To run the script, I'll call the tool:\n\n```json\n{EXEC}\n```\n",
        "To run the script, I'll call the tool:",
        [EXEC_CALL],
    ),
    (f"```\n{EXEC}\n```", None, [EXEC_CALL]),
    # The same model's other habits there: "function" for "name", and Python's \' inside strings
    # (repaired to ', so that the arguments parse; \d keeps its backslash).
    (f"```json\n{EXEC_FUNCTION_KEY}\n```", None, [EXEC_CALL]),
    (
        "```json\n"
        + r'{"function": "exec_command", "arguments": {"cmd": "python3 -c \'print(1)\' \d"}}'
        + "\n```",
        None,
        [("exec_command", '{"cmd": "python3 -c \'print(1)\' \\\\d"}')],
    ),
    (f"```tool_call\n{EXEC}\n```", None, [EXEC_CALL]),
    # Qwen2.5 without its tags: the whole message, or a line of its own after text.
    (PARIS, None, [PARIS_CALL]),
    (f"Checking.\n{PARIS}\nOne moment.", "Checking.\nOne moment.", [PARIS_CALL]),
    (f"  {PARIS}", None, [PARIS_CALL]),
    # The parameters key (Llama's) and a call cut off by max_tokens keep what streamed.
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS_CALL]),
    ('{"name": "get_weather", "arguments": {"city": "Par', None, [("get_weather", '{"city": "Par')]),
    # <tools> for <tool_call>, one or several calls inside.
    (f"<tools>\n{PARIS}\n</tools>", None, [PARIS_CALL]),
    (
        f"<tools>\n{PARIS}\n{PARIS.replace('Paris', 'Oslo')}\n</tools>\nDone.",
        "Done.",
        [PARIS_CALL, OSLO_CALL],
    ),
    (f"<tool_calls>{PARIS}</tool_calls>", None, [PARIS_CALL]),
    # A JSON array of calls, bare or fenced.
    (f"[{PARIS}, {PARIS.replace('Paris', 'Oslo')}]", None, [PARIS_CALL, OSLO_CALL]),
    (f"```json\n[\n  {PARIS}\n]\n```", None, [PARIS_CALL]),
    # Not calls: stay content exactly as written.
    (
        '```json\n{"name": "other_tool", "arguments": {}}\n```',
        '```json\n{"name": "other_tool", "arguments": {}}\n```',
        [],
    ),
    (
        '```json\n{"city": "Paris", "name": "get_weather"}\n```',
        '```json\n{"city": "Paris", "name": "get_weather"}\n```',
        [],
    ),
    (
        'Here:\n```python\nd = {"name": "get_weather", "arguments": {}}\n```',
        'Here:\n```python\nd = {"name": "get_weather", "arguments": {}}\n```',
        [],
    ),
    (f"Use {PARIS} like that", f"Use {PARIS} like that", []),
    ('{"a": [1, 2]}', '{"a": [1, 2]}', []),
    ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("a ``` b `` c", "a ``` b `` c", []),
    ("<tools>none</tools>", "<tools>none</tools>", []),
    ("Plain answer.", "Plain answer.", []),
]


def parse(
    inner: type[ToolParser], text: str, step: int | None
) -> tuple[str | None, list[tuple[str, str]], list[Delta]]:
    parser = LooseToolParser(inner(), NAMES)
    deltas: list[Delta] = []
    if step is None:
        deltas = parser.feed(text)
    else:
        for start in range(0, len(text), step):
            deltas += parser.feed(text[start : start + step])
    deltas += parser.finish()
    content, calls = collect(deltas)
    return content, [(call.name, call.arguments) for call in calls], deltas


@pytest.mark.parametrize(("text", "content", "expected"), CASES)
def test_wrapped_calls_whole_and_streamed(
    text: str, content: str | None, expected: list[tuple[str, str]]
) -> None:
    for step in (None, 1, 2, 5):
        got_content, got_calls, deltas = parse(HermesToolParser, text, step)
        assert (got_content, got_calls) == (content, expected), step
        # Each call's first delta names it; no delta mixes calls.
        firsts = [d for d in deltas if isinstance(d, ToolCallDelta) and d.name is not None]
        assert [d.index for d in firsts] == list(range(len(expected)))


def test_streamed_arguments_arrive_in_pieces() -> None:
    parser = LooseToolParser(HermesToolParser(), NAMES)
    deltas: list[Delta] = []
    for char in f"```json\n{EXEC}\n```":
        deltas += parser.feed(char)
    deltas += parser.finish()
    fragments = [d.arguments for d in deltas if isinstance(d, ToolCallDelta) and d.arguments]
    assert len(fragments) > 10
    assert json.loads("".join(fragments)) == json.loads(EXEC_CALL[1])
    assert not any(isinstance(d, ContentDelta) for d in deltas)


def test_hermes_calls_and_wrapped_calls_in_one_message() -> None:
    text = f"<tool_call>\n{PARIS}\n</tool_call>\n```json\n{EXEC}\n```"
    for step in (None, 1, 3):
        assert parse(HermesToolParser, text, step)[:2] == (None, [PARIS_CALL, EXEC_CALL])


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS_CALL]),
        (f"Sure.\n```json\n{EXEC}\n```", "Sure.", [EXEC_CALL]),
        (f"<tool_call>{PARIS}</tool_call>", None, [PARIS_CALL]),
    ],
)
def test_on_llama3_json(text: str, content: str | None, expected: list[tuple[str, str]]) -> None:
    for step in (None, 1, 4):
        assert parse(Llama3JsonToolParser, text, step)[:2] == (content, expected)


def test_max_calls_counts_wrapped_calls() -> None:
    parser = LooseToolParser(HermesToolParser(), NAMES)
    parser.limit_calls(1, drop_repeats=False)
    deltas = parser.feed(f"<tools>\n{PARIS}\n{PARIS.replace('Paris', 'Oslo')}\n</tools>") + parser.finish()
    assert parser.done and collect(deltas)[1][0].arguments == PARIS_CALL[1] and len(collect(deltas)[1]) == 1


# --- the auto grammar ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def auto_accepts(ll_tokenizer: llguidance.LLTokenizer, text: str, parallel: bool = True) -> bool:
    spec = auto_tool_call_grammar(TOOLS, parallel)
    assert spec is not None
    matcher = llguidance.LLMatcher(ll_tokenizer, compile_grammar(spec), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


WEATHER_BLOCK = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
)
NOW_BLOCK = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "serial", "parallel"),
    [
        ("It is sunny.", True, True),
        ("", True, True),
        ("a <tool_call b </tool_call> ```json\n{}\n```", True, True),
        (WEATHER_BLOCK, True, True),
        (f"Let me check.\n{WEATHER_BLOCK}", True, True),
        (f"{WEATHER_BLOCK}\n{NOW_BLOCK}", False, True),
        # A started call must be well-formed, to a tool offered, and end the message.
        (f"{WEATHER_BLOCK} and more", False, False),
        ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False, False),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>', False, False),
        ("<tool_call>\nplain text\n</tool_call>", False, False),
    ],
)
def test_auto_grammar(ll_tokenizer: llguidance.LLTokenizer, text: str, serial: bool, parallel: bool) -> None:
    assert auto_accepts(ll_tokenizer, text, parallel=False) is serial
    assert auto_accepts(ll_tokenizer, text, parallel=True) is parallel


def test_auto_grammar_without_tools() -> None:
    assert auto_tool_call_grammar([], True) is None
    assert auto_tool_call_grammar(None, True) is None


@pytest.mark.parametrize(
    ("arguments", "repaired"),
    [
        (r'{"city": "O\'Hare"}', '{"city": "O\'Hare"}'),
        (r'{"re": "\d+\.\w", "ok": "a\"b\\c\n\u00e9"}', r'{"re": "\\d+\\.\\w", "ok": "a\"b\\c\n\u00e9"}'),
        (r'{"a": "\'"}', '{"a": "\'"}'),
    ],
)
def test_format_calls_repair_escapes(arguments: str, repaired: str) -> None:
    """A format's own call (Hermes) with escapes JSON lacks streams repaired at every split."""
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    for step in (None, 1, 3):
        content, calls, _ = parse(HermesToolParser, text, step)
        assert (content, calls) == (None, [("get_weather", repaired)]), step
        json.loads(calls[0][1])


def test_call_cut_off_after_a_backslash_keeps_it() -> None:
    content, calls, _ = parse(
        HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "a\\', 1
    )
    assert (content, calls) == (None, [("get_weather", '{"city": "a\\\\')])
