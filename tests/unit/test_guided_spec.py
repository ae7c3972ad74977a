"""Structured-output specs are validated at the edge: every invalid one is a 400 naming the problem."""

from __future__ import annotations

import json

import llguidance
import pytest

from izh.errors import InvalidRequest
from izh.guided_spec import compile_grammar, spec_key, validate_spec
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


def accepts(ll_tokenizer: llguidance.LLTokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, compile_grammar(spec), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def _problem(spec: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    with pytest.raises(InvalidRequest) as info:
        validate_spec(spec, param=param)
    assert info.value.param == param
    assert info.value.status_code == 400
    return info.value.message


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "strin"}, "strin"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"type": "string", "format": "bogus"}, "bogus"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ({"$ref": "http://example.com/schema.json"}, "example.com"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        (False, "accepts nothing"),
    ],
)
def test_invalid_or_unenforceable_schema_is_rejected(schema: object, problem: str) -> None:
    message = _problem(StructuredOutputsParams(json=json.dumps(schema)), param="response_format")
    assert "JSON schema" in message and problem in message


@pytest.mark.parametrize(
    ("regex", "problem"), [("(a", "unclosed group"), ("[a-", "unclosed character class"), ("a{2,1}", "")]
)
def test_invalid_regex_is_rejected(regex: str, problem: str) -> None:
    message = _problem(StructuredOutputsParams(regex=regex))
    assert message.startswith("invalid regex") and problem in message


@pytest.mark.parametrize(
    ("grammar", "problem"),
    [
        ("start: undefined_rule", "undefined_rule"),
        ('start: ("a"', ""),
        ('root ::= "unterminated', ""),
        ("this is neither lark nor gbnf", ""),
    ],
)
def test_invalid_grammar_is_rejected(grammar: str, problem: str) -> None:
    message = _problem(StructuredOutputsParams(grammar=grammar))
    assert message.startswith("invalid grammar") and problem in message


def test_special_token_in_grammar_is_checked_against_the_tokenizer(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    spec = StructuredOutputsParams(grammar="start: <|no_such_token|>")
    with pytest.raises(InvalidRequest, match="no_such_token"):
        validate_spec(spec, ll_tokenizer)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(
            json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
        ),
        StructuredOutputsParams(json="true"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
        StructuredOutputsParams(choice=["a", 'b"c', "d\\e"]),
        StructuredOutputsParams(grammar='start: "x" NUM\nNUM: /[0-9]+/'),
        StructuredOutputsParams(grammar='root ::= "x" [0-9]+'),
    ],
)
def test_valid_specs_pass(spec: StructuredOutputsParams, ll_tokenizer: llguidance.LLTokenizer) -> None:
    validate_spec(spec)
    validate_spec(spec, ll_tokenizer)


def test_grammars_enforce_their_spec(ll_tokenizer: llguidance.LLTokenizer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
    as_json = StructuredOutputsParams(json=json.dumps(schema))
    assert accepts(ll_tokenizer, as_json, '{"n": 3}')
    assert accepts(ll_tokenizer, as_json, '{\n  "n": 3\n}')
    assert not accepts(ll_tokenizer, as_json, '{"n": 10}')
    assert not accepts(ll_tokenizer, as_json, "{}")
    # Whitespace is bounded: one line break per gap, so a newline loop cannot run forever.
    assert not accepts(ll_tokenizer, as_json, '{\n\n"n": 3}')
    any_object = StructuredOutputsParams(json_object=True)
    assert accepts(ll_tokenizer, any_object, '{"a": [1, {"b": null}]}')
    assert not accepts(ll_tokenizer, any_object, "[1]")
    choice = StructuredOutputsParams(choice=["yes", 'say "hi"', "a\\b", "new\nline", "ünï 😀", ""])
    for option in choice.choice or []:
        assert accepts(ll_tokenizer, choice, option)
    assert not accepts(ll_tokenizer, choice, "ye")
    assert not accepts(ll_tokenizer, choice, "say hi")
    regex = StructuredOutputsParams(regex="[a-c]{2}x")
    assert accepts(ll_tokenizer, regex, "abx") and not accepts(ll_tokenizer, regex, "abcx")
    gbnf = StructuredOutputsParams(grammar='root ::= "x" [0-9]+')
    assert accepts(ll_tokenizer, gbnf, "x42") and not accepts(ll_tokenizer, gbnf, "x")


def test_spec_key_is_the_cache_identity() -> None:
    assert spec_key(StructuredOutputsParams(regex="a")) == spec_key(StructuredOutputsParams(regex="a"))
    assert spec_key(StructuredOutputsParams(regex="a")) != spec_key(StructuredOutputsParams(grammar="a"))
    assert spec_key(StructuredOutputsParams(choice=["a", "b"])) != spec_key(
        StructuredOutputsParams(choice=["a,b"])
    )
    grammar = compile_grammar(StructuredOutputsParams(regex="a"))
    assert compile_grammar(StructuredOutputsParams(regex="a")) is grammar  # cached
