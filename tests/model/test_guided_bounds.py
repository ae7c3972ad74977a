"""The grammar manager ANDs a request's JSON bounds into its grammar's bitmask: a "model" that only
wants digits still ends its numbers, and a schema that needs more than the bounds allow goes on under
its grammar alone instead of failing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch

from izh.engine.guided import GrammarManager, apply_bitmask
from izh.guided_spec import MAX_INTEGER_DIGITS, MAX_SIGNIFICANT_DIGITS
from izh.sampling_params import StructuredOutputsParams
from izh.tokenizer import Tokenizer
from tests.fixtures.bpe import train_byte_level_bpe

EOS_TOKEN = "<|endoftext|>"
MAX_STEPS = 400
TRAINING_TEXT = ['{"x": 3.14159265358979, "y": [1, 22, 333, 4444], "z": -0.5e-10}', "0123456789 " * 3]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = train_byte_level_bpe(TRAINING_TEXT * 20, 300, [EOS_TOKEN])
    return Tokenizer(backend, special_tokens={"eos_token": EOS_TOKEN})


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> Iterator[GrammarManager]:
    grammar_manager = GrammarManager(tokenizer, tokenizer.vocab_size, max_num_rows=4)
    yield grammar_manager
    grammar_manager.shutdown()


@pytest.fixture(scope="module")
def digit_loving_logits(tokenizer: Tokenizer) -> torch.Tensor:
    """Logits [vocab_size] preferring digit tokens, the longest first: left to itself, a model with
    these writes one number forever."""
    logits = torch.zeros(tokenizer.vocab_size)
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.token_bytes(token_id)
        if text and text.isdigit():
            logits[token_id] = 10.0 + len(text)
    return logits


def _allowed(manager: GrammarManager, request_id: str) -> set[int]:
    bitmask = manager.fill_bitmask([request_id])
    assert bitmask is not None
    logits = torch.zeros(1, manager.vocab_size)
    apply_bitmask(logits, bitmask)
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def _greedy(manager: GrammarManager, tokenizer: Tokenizer, request_id: str, logits: torch.Tensor) -> str:
    """Greedy decoding of `request_id` under its grammar; the text once it is done."""
    output: list[int] = []
    for _ in range(MAX_STEPS):
        bitmask = manager.fill_bitmask([request_id])
        assert bitmask is not None
        masked = apply_bitmask(logits.clone().unsqueeze(0), bitmask)
        token_id = int(masked.argmax())
        assert manager.accept_tokens(request_id, [token_id]), manager.error(request_id)
        if token_id in tokenizer.eos_token_ids:
            break
        output.append(token_id)
        if manager.is_terminated(request_id):
            break
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps: {tokenizer.decode(output)!r}")
    manager.check_invariants()
    return tokenizer.decode(output)


def _significant_digits(number: str) -> int:
    mantissa = re.split("[eE]", number.lstrip("-"))[0]
    return len(mantissa.replace(".", "").lstrip("0"))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number"},
        {"type": "integer"},
        {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3},
        {
            "type": "object",
            "properties": {"x": {"type": "number"}},
            "required": ["x"],
            "additionalProperties": False,
        },
    ],
    ids=["number", "integer", "array", "object"],
)
def test_a_model_that_only_wants_digits_still_ends_its_numbers(
    manager: GrammarManager, tokenizer: Tokenizer, digit_loving_logits: torch.Tensor, schema: object
) -> None:
    request_id = f"digits-{json.dumps(schema)}"
    manager.add_request(request_id, StructuredOutputsParams(json=json.dumps(schema)))
    try:
        text = _greedy(manager, tokenizer, request_id, digit_loving_logits)
    finally:
        manager.remove(request_id)
    value = json.loads(text)
    numbers = re.findall(r"-?[0-9][0-9.eE+-]*", text)
    assert numbers, text
    for number in numbers:
        if "." in number:
            assert _significant_digits(number) <= MAX_SIGNIFICANT_DIGITS, text
        else:
            assert len(re.split("[eE]", number.lstrip("-"))[0]) <= MAX_INTEGER_DIGITS, text
    assert value is not None


def test_the_bounds_mask_only_what_the_grammar_would_overrun(
    manager: GrammarManager, tokenizer: Tokenizer
) -> None:
    manager.add_request("pi", StructuredOutputsParams(json='{"type": "number"}'))
    try:
        digits = {t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t).isdigit()}
        for token_id in tokenizer.encode("3.1415926535897932", add_special_tokens=False):
            assert manager.accept_tokens("pi", [token_id])
        allowed = _allowed(manager, "pi")
        # 17 significant digits: no more digits, but the exponent and the end are still open.
        assert not allowed & digits
        assert tokenizer.token_to_id("e") in allowed and tokenizer.eos_token_id in allowed
    finally:
        manager.remove("pi")


def test_a_grammar_needing_more_than_the_bounds_goes_on_without_them(
    manager: GrammarManager, tokenizer: Tokenizer
) -> None:
    # A client's separator that the bounds do not know (and no whitespace): after a 20-digit item
    # only ";" may follow, which the bounds refuse. The request must go on under its grammar, not
    # die on an empty mask.
    schema = {
        "x-guidance": {"item_separator": ";", "whitespace_flexible": False, "whitespace_pattern": None},
        "type": "array",
        "items": {"type": "integer"},
        "minItems": 2,
        "maxItems": 2,
    }
    manager.add_request("sep", StructuredOutputsParams(json=json.dumps(schema)))
    try:
        for token_id in tokenizer.encode("[" + "1" * MAX_INTEGER_DIGITS, add_special_tokens=False):
            assert _allowed(manager, "sep")
            assert manager.accept_tokens("sep", [token_id])
        semicolon = tokenizer.token_to_id(";")
        assert semicolon in _allowed(manager, "sep")
        for token_id in tokenizer.encode(";2]", add_special_tokens=False):
            assert manager.accept_tokens("sep", [token_id])
        assert manager.is_terminated("sep") and manager.error("sep") is None
        manager.check_invariants()
    finally:
        manager.remove("sep")


def test_a_token_the_bounds_refuse_drops_them_not_the_request(
    manager: GrammarManager, tokenizer: Tokenizer
) -> None:
    # accept_tokens is told what was sampled; a token from outside the bounds (never from their own
    # mask) costs the request its bounds, never its grammar.
    manager.add_request("long", StructuredOutputsParams(json='{"type": "integer"}'))
    try:
        for token_id in tokenizer.encode("9" * 30, add_special_tokens=False):
            assert manager.accept_tokens("long", [token_id])
        assert manager.error("long") is None
        nine = tokenizer.token_to_id("9")
        assert nine in _allowed(manager, "long")  # the grammar alone: more digits are fine
        manager.check_invariants()
    finally:
        manager.remove("long")


def test_outputs_without_json_have_no_bounds(manager: GrammarManager, tokenizer: Tokenizer) -> None:
    manager.add_request("regex", StructuredOutputsParams(regex="[0-9]{30}"))
    try:
        for token_id in tokenizer.encode("1" * 29, add_special_tokens=False):
            assert manager.accept_tokens("regex", [token_id])
        assert tokenizer.token_to_id("1") in _allowed(manager, "regex")
    finally:
        manager.remove("regex")
