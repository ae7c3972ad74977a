"""Object schemas that list properties and say nothing of other keys take no other keys (a small model
otherwise invents keys until max_tokens); schemas that ask for extra keys keep them."""

from __future__ import annotations

import json

import llguidance
import pytest

from izh.guided_spec import close_objects, compile_grammar
from izh.sampling_params import StructuredOutputsParams
from tests.unit.test_json_bounds import _ByteTokenizer, grammar_accepts


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def _spec(schema: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema))


def test_listed_properties_close_the_object_at_every_depth() -> None:
    schema = {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": {"type": "string"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        },
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["user"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["Pet"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is left as it was


def test_a_property_named_like_a_keyword_is_a_name_not_a_schema() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "string"}, "items": {"type": "integer"}},
    }
    closed = close_objects(schema)
    assert closed["properties"] == schema["properties"]
    assert closed["additionalProperties"] is False


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
        {"type": "object"},  # no properties listed: any object, as asked
        {"const": {"properties": {"a": 1}}},  # a value, not a schema
    ],
)
def test_schemas_that_say_what_else_they_take_are_left_open(schema: dict) -> None:
    closed = close_objects(schema)
    assert closed.get("additionalProperties") == schema.get("additionalProperties")
    if "allOf" in schema:
        assert "additionalProperties" not in closed["allOf"][0]  # each branch sees part of the object
    if "const" in schema:
        assert closed == schema


def test_the_grammar_refuses_invented_keys_and_keeps_asked_for_ones(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    plain = _spec({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert grammar_accepts(ll_tokenizer, plain, '{"a": 1}')
    assert not grammar_accepts(ll_tokenizer, plain, '{"a": 1, "a2": 2}')
    open_ = _spec({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True})
    assert grammar_accepts(ll_tokenizer, open_, '{"a": 1, "a2": 2}')
    assert compile_grammar(plain) != compile_grammar(open_)
