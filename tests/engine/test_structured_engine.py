"""Structured outputs through the offline engine (tiny random Llama): constrained and free requests
share a batch without the constraint leaking into the free ones; constrained outputs match their
spec and finish with "stop" when the grammar ends; bad specs are InvalidRequest; nothing leaks.

Random weights are fond of whitespace, which JSON allows between tokens: the JSON requests ban
whitespace-only tokens with logit_bias so the outputs stay short (the grammar still does the work).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from izh import LLM, SamplingParams
from izh.errors import InvalidRequest
from izh.sampling_params import StructuredOutputsParams

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{2,3}"
CHOICES = ["yes", "no", "maybe so"]
FREE_PROMPTS = ["hello world", "the quick brown fox", "Once upon a time"]
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def no_whitespace(llm: LLM) -> dict[int, float]:
    """logit_bias banning every whitespace-only token of the tiny tokenizer."""
    tokenizer = llm.get_tokenizer()
    banned = [
        token_id
        for token_id in range(tokenizer.vocab_size)
        if tokenizer.token_bytes(token_id) and not tokenizer.token_bytes(token_id).strip()
    ]
    assert banned
    return {token_id: -100.0 for token_id in banned}


def _constrained(spec: StructuredOutputsParams, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec, **kwargs)


def _free() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _assert_all_free(llm: LLM) -> None:
    core = llm.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert core._grammar is None or core._grammar.num_requests == 0
    core.check_invariants()


def test_mixed_batch_constrained_valid_and_free_unchanged(llm: LLM, no_whitespace: dict[int, float]) -> None:
    json_spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    requests: list[tuple[str, SamplingParams]] = [
        (FREE_PROMPTS[0], _free()),
        ("Describe a person as JSON.", _constrained(json_spec, logit_bias=no_whitespace)),
        ("Give a code.", _constrained(StructuredOutputsParams(regex=REGEX))),
        (FREE_PROMPTS[1], _free()),
        ("Yes or no?", _constrained(StructuredOutputsParams(choice=CHOICES))),
        ("Another person.", _constrained(json_spec, logit_bias=no_whitespace, temperature=1.0, seed=7)),
        ("Pick one.", _constrained(StructuredOutputsParams(choice=CHOICES), temperature=1.0, seed=3)),
        (FREE_PROMPTS[2], _free()),
    ]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests])
    for i in (1, 5):
        out = outputs[i].outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    regex_out = outputs[2].outputs[0]
    assert regex_out.finish_reason == "stop"
    assert re.fullmatch(REGEX, regex_out.text), regex_out.text
    for i in (4, 6):
        out = outputs[i].outputs[0]
        assert out.finish_reason == "stop" and out.text in CHOICES, out.text

    alone = [llm.generate(prompt, _free())[0].outputs[0].token_ids for prompt in FREE_PROMPTS]
    mixed = [outputs[i].outputs[0].token_ids for i in (0, 3, 7)]
    assert mixed == alone
    assert all(len(t) == 24 for t in mixed)
    _assert_all_free(llm)


def test_grammar_end_finishes_with_stop_before_max_tokens(llm: LLM) -> None:
    # "maybe so" (or any choice) ends the grammar: the request stops there, not at max_tokens,
    # and the bounded regex can go no further than 4 letters, a dash and 3 digits.
    choice, regex = llm.generate(
        ["Pick.", "Code?"],
        [
            _constrained(StructuredOutputsParams(choice=CHOICES)),
            _constrained(StructuredOutputsParams(regex=r"[a-z]{4}-[0-9]{3}")),
        ],
    )
    assert choice.outputs[0].finish_reason == "stop" and choice.outputs[0].text in CHOICES
    assert len(choice.outputs[0].token_ids) < MAX_TOKENS
    assert regex.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{4}-[0-9]{3}", regex.outputs[0].text), regex.outputs[0].text
    assert len(regex.outputs[0].token_ids) <= 8
    _assert_all_free(llm)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"regex": "(a"}, "unclosed group"),
        ({"json": json.dumps({"type": "strin"})}, "strin"),
        ({"json": json.dumps({"type": "string", "pattern": "(?<=a)b"})}, "look-around"),
        ({"grammar": "start: missing"}, "missing"),
    ],
)
def test_compile_errors_raise_invalid_request_and_leave_nothing_behind(
    llm: LLM, fields: dict[str, Any], problem: str
) -> None:
    spec = StructuredOutputsParams(**fields)
    with pytest.raises(InvalidRequest) as info:
        llm.generate(["fine", "bad"], [_free(), _constrained(spec)])
    assert info.value.param == "structured_outputs"
    assert problem in info.value.message
    _assert_all_free(llm)
    # The engine still serves constrained requests afterwards.
    (out,) = llm.generate("Pick.", _constrained(StructuredOutputsParams(choice=CHOICES)))
    assert out.outputs[0].text in CHOICES
    _assert_all_free(llm)
