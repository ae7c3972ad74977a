"""JSON in constrained output has bounded lexemes: numbers no longer than a double carries, bounded
exponents and whitespace, in every grammar izh builds around JSON (schemas, json_object, tool calls,
%json blocks in a client's Lark grammar). Checked at the grammar level, one token per byte."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from izh.api.common.constraints import Constraint, answer_only
from izh.guided_spec import (
    MAX_EXPONENT_DIGITS,
    MAX_INTEGER_DIGITS,
    MAX_SIGNIFICANT_DIGITS,
    MAX_WHITESPACE_COLUMNS,
    bounds_grammar,
    compile_grammar,
)
from izh.parsers.tool_grammar import tool_call_grammar
from izh.sampling_params import StructuredOutputsParams

EOS = 256


class _ByteTokenizer:
    """One token per byte plus EOS: a matcher over it accepts exactly the grammar's strings."""

    def __init__(self) -> None:
        self.eos_token_id = EOS
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [EOS]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def _accepts(ll_tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def grammar_accepts(ll_tokenizer: llguidance.LLTokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    """What the spec's own grammar accepts (no bounds)."""
    return _accepts(ll_tokenizer, compile_grammar(spec), text)


def engine_accepts(ll_tokenizer: llguidance.LLTokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    """What the engine lets through: the spec's grammar and its bounds both accept."""
    bounds = bounds_grammar(spec)
    assert bounds is not None
    return grammar_accepts(ll_tokenizer, spec, text) and _accepts(ll_tokenizer, bounds, text)


def _schema(schema: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema))


NUMBER = _schema({"type": "number"})

ACCEPTED_NUMBERS = [
    "12345678901234567",  # 17 digits
    "0.12345678901234567",  # 17 significant digits, below 1
    "12345678.901234567",
    "-1234567890123456.7",
    "3.141592653589793",  # repr(math.pi)
    "0.30000000000000004",  # repr(0.1 + 0.2)
    "9" * MAX_INTEGER_DIGITS,  # the largest uint64 has 20 digits
    "-9223372036854775808",
    "0.0000001",  # JavaScript's String(1e-7 * 1) is still fixed notation above 1e-7
    "0.00000000000000000",
    "1e308",
    "-2.2250738585072014E-308",
    "6.02214076e+23",
    "5e-324",
    "0",
    "-0.0",
    "100.5",
]
REJECTED_NUMBERS = [
    "311.223989888888888888888888888",  # 30 digits: what SmolLM2 wrote until max_tokens
    "123456789012345678901234567890",
    "3.141592653589793238",  # 19 significant digits
    "1" + "0" * MAX_INTEGER_DIGITS,  # 21 digits
    "0.123456789012345678",  # 18 significant digits
    "1e" + "3" * (MAX_EXPONENT_DIGITS + 1),
    "1.5e-0308",
    "0.00000001",  # 7 zeros before the first significant digit: that is 1e-8
    "0.000000000000000000",  # 18 zeros
]


@pytest.mark.parametrize("text", ACCEPTED_NUMBERS)
def test_numbers_a_double_carries_are_accepted(ll_tokenizer: llguidance.LLTokenizer, text: str) -> None:
    assert engine_accepts(ll_tokenizer, NUMBER, text)


@pytest.mark.parametrize("text", REJECTED_NUMBERS)
def test_longer_numbers_are_rejected(ll_tokenizer: llguidance.LLTokenizer, text: str) -> None:
    # llguidance's own JSON grammar takes them all: the bounds are what stops them.
    assert grammar_accepts(ll_tokenizer, NUMBER, text)
    assert not engine_accepts(ll_tokenizer, NUMBER, text)


def test_the_bound_constants_are_the_documented_ones() -> None:
    assert (MAX_INTEGER_DIGITS, MAX_SIGNIFICANT_DIGITS, MAX_EXPONENT_DIGITS) == (20, 17, 3)
    assert MAX_WHITESPACE_COLUMNS == 24


def test_integers_are_bounded_too(ll_tokenizer: llguidance.LLTokenizer) -> None:
    integer = _schema({"type": "integer", "minimum": 0})
    assert engine_accepts(ll_tokenizer, integer, "1" * MAX_INTEGER_DIGITS)
    assert grammar_accepts(ll_tokenizer, integer, "1" * 30)
    assert not engine_accepts(ll_tokenizer, integer, "1" * (MAX_INTEGER_DIGITS + 1))


def test_numbers_nested_anywhere_are_bounded(ll_tokenizer: llguidance.LLTokenizer) -> None:
    schema = _schema(
        {
            "type": "object",
            "properties": {
                "points": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
            },
            "required": ["points"],
            "additionalProperties": True,
        }
    )
    assert engine_accepts(ll_tokenizer, schema, '{"points": [[1.5, -2e10], [0.25]]}')
    assert not engine_accepts(ll_tokenizer, schema, '{"points": [[1.5, 2.0000000000000000001]]}')
    # An extra property (the schema asks for them) holds any JSON: its numbers are bounded as well.
    assert engine_accepts(ll_tokenizer, schema, '{"points": [], "extra": {"n": [1, 2.5]}}')
    assert not engine_accepts(ll_tokenizer, schema, '{"points": [], "extra": {"n": [' + "7" * 25 + "]}}")


def test_json_object_numbers_are_bounded(ll_tokenizer: llguidance.LLTokenizer) -> None:
    spec = StructuredOutputsParams(json_object=True)
    assert engine_accepts(ll_tokenizer, spec, '{"a": [1, {"b": 3.25, "c": null}], "d": "x"}')
    assert not engine_accepts(ll_tokenizer, spec, '{"a": 3.14159265358979323846}')


def test_strings_are_not_bounded(ll_tokenizer: llguidance.LLTokenizer) -> None:
    spec = _schema({"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]})
    long_digits = "1" * 200
    assert engine_accepts(ll_tokenizer, spec, json.dumps({"id": long_digits}))
    assert engine_accepts(
        ll_tokenizer, spec, json.dumps({"id": 'a "quoted" \\ \u00e9 \n'}, ensure_ascii=False)
    )


# ---- whitespace --------------------------------------------------------------------------------


def test_whitespace_is_bounded_between_tokens(ll_tokenizer: llguidance.LLTokenizer) -> None:
    spec = _schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    indent = " " * MAX_WHITESPACE_COLUMNS
    assert engine_accepts(ll_tokenizer, spec, '{\n  "a": 1\n}')
    assert engine_accepts(ll_tokenizer, spec, "{\r\n" + indent + '"a" :\t1}')
    assert not engine_accepts(ll_tokenizer, spec, "{\n" + indent + ' "a": 1}')
    assert not engine_accepts(ll_tokenizer, spec, '{\n\n"a": 1}')


def test_whitespace_is_bounded_even_where_the_schema_loosens_it(ll_tokenizer: llguidance.LLTokenizer) -> None:
    # A schema's own x-guidance may bring back unbounded whitespace; the bounds stay.
    spec = _schema(
        {
            "x-guidance": {"whitespace_pattern": "[ \\n]*"},
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
        }
    )
    flooded = "{" + "\n" * 50 + '"a": 1}'
    assert grammar_accepts(ll_tokenizer, spec, flooded)
    assert not engine_accepts(ll_tokenizer, spec, flooded)
    assert engine_accepts(ll_tokenizer, spec, '{\n  "a": 1\n}')


# ---- JSON inside Lark grammars ------------------------------------------------------------------


def test_tool_call_arguments_are_bounded(ll_tokenizer: llguidance.LLTokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "set_temperature",
                "parameters": {
                    "type": "object",
                    "properties": {"celsius": {"type": "number"}},
                    "required": ["celsius"],
                },
            },
        }
    ]
    spec = tool_call_grammar(tools, "required")
    assert spec is not None

    def call(celsius: str) -> str:
        return (
            '<tool_call>\n{"name": "set_temperature", "arguments": {"celsius": '
            + celsius
            + "}}\n</tool_call>"
        )

    assert engine_accepts(ll_tokenizer, spec, call("21.5"))
    assert engine_accepts(ll_tokenizer, spec, call("21.5") + "\n" + call("-3"))
    assert grammar_accepts(ll_tokenizer, spec, call("21.55555555555555555555555"))
    assert not engine_accepts(ll_tokenizer, spec, call("21.55555555555555555555555"))


def test_the_answer_after_reasoning_is_bounded_not_the_reasoning(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    constraint = answer_only(Constraint(_schema({"type": "number"}), "response_format"), in_reasoning=True)
    spec = constraint.spec
    reasoning = "pi is 3.14159265358979323846264338327950288419716939937510 and so on</think>\n"
    assert engine_accepts(ll_tokenizer, spec, reasoning + "3.141592653589793")
    assert not engine_accepts(ll_tokenizer, spec, reasoning + "3.14159265358979323846")


def test_client_lark_grammar_json_blocks_are_bounded(ll_tokenizer: llguidance.LLTokenizer) -> None:
    # "%json" inside a string literal, a regex and a comment is not a JSON block.
    grammar = (
        'start: "%json {" PREFIX value "}"  // %json {"type": "string"}\n'
        "PREFIX: /[%json ]*/\n"
        'value: %json {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}\n'
    )
    spec = StructuredOutputsParams(grammar=grammar)
    assert engine_accepts(ll_tokenizer, spec, '%json {js {"x": 1.25}}')
    assert grammar_accepts(ll_tokenizer, spec, '%json {{"x": 1.2500000000000000000001}}')
    assert not engine_accepts(ll_tokenizer, spec, '%json {{"x": 1.2500000000000000000001}}')


def test_a_client_ignore_rule_does_not_loosen_the_bounds(ll_tokenizer: llguidance.LLTokenizer) -> None:
    # A %json block without x-guidance has llguidance's unbounded whitespace; the grammar's %ignore
    # does not reach into the bounded JSON either.
    spec = StructuredOutputsParams(
        grammar='start: "a" value\nvalue: %json {"type": "array"}\n%ignore /[ \\n]+/\n'
    )
    assert engine_accepts(ll_tokenizer, spec, "a[1, 2]")
    assert grammar_accepts(ll_tokenizer, spec, "a[1," + " " * 40 + "2]")
    assert not engine_accepts(ll_tokenizer, spec, "a[1," + " " * 40 + "2]")


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(choice=["1", "2"]),
        StructuredOutputsParams(grammar='start: "x" NUMBER\nNUMBER: /[0-9]+/\n'),
        StructuredOutputsParams(grammar='root ::= "x" [0-9]+'),
    ],
)
def test_outputs_without_json_have_no_bounds(spec: StructuredOutputsParams) -> None:
    # A client's own regex or grammar says how long its lexemes may be.
    assert bounds_grammar(spec) is None


def test_every_bounds_grammar_is_valid(ll_tokenizer: llguidance.LLTokenizer) -> None:
    for spec in (NUMBER, StructuredOutputsParams(json_object=True), _schema(True)):
        bounds = bounds_grammar(spec)
        assert bounds is not None
        assert llguidance.LLMatcher.validate_grammar(bounds, ll_tokenizer) == ""
