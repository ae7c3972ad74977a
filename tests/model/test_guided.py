"""Grammar-constrained decoding with a random "model": whatever the logits, the masked output obeys
the spec (JSON validating against its schema, regexes matching, choices, Lark grammars parsing)."""

from __future__ import annotations

import ast
import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
import torch

from izh.engine.guided import GrammarManager, apply_bitmask, bitmask_words
from izh.sampling_params import StructuredOutputsParams
from izh.tokenizer import Tokenizer
from tests.fixtures.bpe import train_byte_level_bpe

EOS_TOKEN = "<|endoftext|>"
# The logits are wider than the tokenizer's vocabulary (padding rows), and not a multiple of 32.
PADDING_IDS = 37
MAX_STEPS = 1500

TRAINING_TEXT = [
    '{"name": "alice", "age": 31, "tags": ["red", "green"], "ok": true, "score": -2.5e3}',
    '{"id": 7, "items": [{"sku": "ab-12", "qty": 3}], "status": "shipped", "note": null}',
    "the quick brown fox jumps over the lazy dog 0123456789 (1+2)-3 yes no maybe",
    "alice@example.com bob@test.org 555-123-4567",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer (every byte is a token, plus merges) with an EOS special token."""
    backend = train_byte_level_bpe(TRAINING_TEXT * 20, 420, [EOS_TOKEN, "<|im_start|>"])
    return Tokenizer(backend, special_tokens={"eos_token": EOS_TOKEN})


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> Iterator[GrammarManager]:
    grammar_manager = GrammarManager(tokenizer, tokenizer.vocab_size + PADDING_IDS, max_num_rows=2)
    yield grammar_manager
    grammar_manager.shutdown()


_request_ids = iter(range(10**9))


def generate(
    manager: GrammarManager, tokenizer: Tokenizer, spec: StructuredOutputsParams, *, seed: int, greedy: bool
) -> str:
    """Decode one request under the grammar with random logits; the text once the request is done."""
    request_id = f"req-{next(_request_ids)}"
    manager.add_request(request_id, spec)
    generator = torch.Generator().manual_seed(seed)
    output_ids: list[int] = []
    try:
        for _ in range(MAX_STEPS):
            token_id = _sample_one(manager, request_id, generator, greedy)
            assert manager.accept_tokens(request_id, [token_id]), manager.error(request_id)
            assert manager.error(request_id) is None
            if token_id in tokenizer.eos_token_ids:
                return tokenizer.decode(output_ids)
            output_ids.append(token_id)
            if manager.is_terminated(request_id):
                return tokenizer.decode(output_ids)
        raise AssertionError(f"not done after {MAX_STEPS} steps: {tokenizer.decode(output_ids)!r}")
    finally:
        manager.remove(request_id)
        manager.check_invariants()


def _sample_one(manager: GrammarManager, request_id: str, generator: torch.Generator, greedy: bool) -> int:
    bitmask = manager.fill_bitmask([request_id])
    assert bitmask is not None
    logits = torch.randn(1, manager.vocab_size, generator=generator) * 3  # [1, vocab_size]
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits).any()
    if greedy:
        return int(logits.argmax(dim=-1))
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))


SAMPLING = [
    pytest.param(seed, greedy, id=f"{'greedy' if greedy else 'random'}-{seed}")
    for seed in range(3)
    for greedy in (True, False)
]


# ---- JSON schemas ---------------------------------------------------------------------------

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"type": "string", "maxLength": 4},
            },
            "required": ["zip"],
            "additionalProperties": False,
        },
        "scores": {
            "type": "array",
            "items": {"type": "number", "minimum": -1.5, "maximum": 10},
            "minItems": 1,
            "maxItems": 3,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "scores"],
    "additionalProperties": False,
}

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99},
        "items": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "status": {"type": "string", "enum": ["new", "shipped"]},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]},
    },
    "required": ["id", "items", "status"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("schema", [PERSON_SCHEMA, ORDER_SCHEMA], ids=["person", "order"])
@pytest.mark.parametrize(("seed", "greedy"), SAMPLING)
def test_json_schema_output_validates(
    manager: GrammarManager, tokenizer: Tokenizer, schema: dict[str, Any], seed: int, greedy: bool
) -> None:
    text = generate(
        manager, tokenizer, StructuredOutputsParams(json=json.dumps(schema)), seed=seed, greedy=greedy
    )
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("seed", "greedy"), SAMPLING)
def test_json_object_output_is_an_object(
    manager: GrammarManager, tokenizer: Tokenizer, seed: int, greedy: bool
) -> None:
    text = generate(manager, tokenizer, StructuredOutputsParams(json_object=True), seed=seed, greedy=greedy)
    assert isinstance(json.loads(text), dict)


# ---- regex, choice, grammar -----------------------------------------------------------------

REGEXES = [
    r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)",
    r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}",
    r"(yes|no)!{0,3}",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
]


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize(("seed", "greedy"), SAMPLING)
def test_regex_output_fully_matches(
    manager: GrammarManager, tokenizer: Tokenizer, regex: str, seed: int, greedy: bool
) -> None:
    text = generate(manager, tokenizer, StructuredOutputsParams(regex=regex), seed=seed, greedy=greedy)
    assert re.fullmatch(regex, text), text


CHOICES = ["yes", "no", "maybe so", 'say "hi"', "back\\slash", "ünï 😀", "yes!"]


@pytest.mark.parametrize(("seed", "greedy"), SAMPLING)
def test_choice_output_is_one_of_the_choices(
    manager: GrammarManager, tokenizer: Tokenizer, seed: int, greedy: bool
) -> None:
    text = generate(manager, tokenizer, StructuredOutputsParams(choice=CHOICES), seed=seed, greedy=greedy)
    assert text in CHOICES


ARITHMETIC = r"""
start: expr
expr: term (OP term)*
term: NUMBER | "(" expr ")"
OP: "+" | "-"
NUMBER: /[0-9]{1,3}/
"""


@pytest.mark.parametrize(("seed", "greedy"), SAMPLING)
def test_lark_grammar_output_parses(
    manager: GrammarManager, tokenizer: Tokenizer, seed: int, greedy: bool
) -> None:
    text = generate(manager, tokenizer, StructuredOutputsParams(grammar=ARITHMETIC), seed=seed, greedy=greedy)
    # The grammar's language is a subset of Python expressions: + and - over small integers.
    assert re.fullmatch(r"[0-9()+\-]+", text), text
    for node in ast.walk(ast.parse(text, mode="eval").body):
        assert isinstance(node, ast.BinOp | ast.Constant | ast.Add | ast.Sub), text
        assert not isinstance(node, ast.Constant) or isinstance(node.value, int)


def test_gbnf_grammar_is_accepted(manager: GrammarManager, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(grammar='root ::= "ab" [0-9] ("!" | "?")')
    text = generate(manager, tokenizer, spec, seed=0, greedy=False)
    assert re.fullmatch(r"ab[0-9][!?]", text)


# ---- EOS, termination, errors, batching -------------------------------------------------------


def _allowed(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    logits = torch.zeros(1, vocab_size)
    apply_bitmask(logits, bitmask_row.unsqueeze(0))
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_eos_masked_until_the_grammar_is_complete(manager: GrammarManager, tokenizer: Tokenizer) -> None:
    manager.add_request("eos", StructuredOutputsParams(regex="a+"))
    eos = tokenizer.eos_token_id
    assert eos is not None
    bitmask = manager.fill_bitmask(["eos"])
    assert bitmask is not None
    first = _allowed(bitmask[0], manager.vocab_size)
    assert eos not in first and first
    assert all(set(tokenizer.decode([i])) == {"a"} for i in first)
    a = tokenizer.token_to_id("a")
    assert a is not None and manager.accept_tokens("eos", [a])
    assert not manager.is_terminated("eos")
    bitmask = manager.fill_bitmask(["eos"])
    assert bitmask is not None
    assert eos in _allowed(bitmask[0], manager.vocab_size)
    assert manager.accept_tokens("eos", [eos])
    assert manager.is_terminated("eos") and manager.error("eos") is None
    manager.remove("eos")


def test_grammar_end_terminates_without_eos(manager: GrammarManager, tokenizer: Tokenizer) -> None:
    manager.add_request("end", StructuredOutputsParams(choice=["ok"]))
    for token_id in tokenizer.encode("ok", add_special_tokens=False):
        assert not manager.is_terminated("end")
        assert manager.accept_tokens("end", [token_id])
    assert manager.is_terminated("end")
    # Only EOS may follow a grammar that cannot go on.
    bitmask = manager.fill_bitmask(["end"])
    assert bitmask is not None
    assert _allowed(bitmask[0], manager.vocab_size) == set(tokenizer.eos_token_ids)
    manager.remove("end")


def test_padding_ids_and_special_tokens_are_never_allowed(
    manager: GrammarManager, tokenizer: Tokenizer
) -> None:
    manager.add_request("pad", StructuredOutputsParams(regex="(.|\n){0,5}"))
    bitmask = manager.fill_bitmask(["pad"])
    assert bitmask is not None
    assert bitmask.shape == (1, bitmask_words(tokenizer.vocab_size + PADDING_IDS))
    allowed = _allowed(bitmask[0], manager.vocab_size)
    assert max(allowed) < tokenizer.vocab_size
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert im_start not in allowed and tokenizer.eos_token_id in allowed
    manager.remove("pad")


def test_rejected_token_fails_that_request_alone(manager: GrammarManager, tokenizer: Tokenizer) -> None:
    manager.add_request("bad", StructuredOutputsParams(choice=["yes"]))
    manager.add_request("good", StructuredOutputsParams(choice=["yes"]))
    n = tokenizer.token_to_id("n")
    assert n is not None
    assert not manager.accept_tokens("bad", [n])
    assert manager.error("bad")
    assert manager.error("good") is None
    bitmask = manager.fill_bitmask(["bad", "good"])
    assert bitmask is not None
    # The failed row still has a token to sample (EOS) until the engine fails the request.
    assert _allowed(bitmask[0], manager.vocab_size) <= set(tokenizer.eos_token_ids)
    good_allowed = _allowed(bitmask[1], manager.vocab_size)
    assert good_allowed and not good_allowed & set(tokenizer.eos_token_ids)
    assert "yes".startswith(tokenizer.decode([min(good_allowed)]))
    manager.remove("bad")
    manager.remove("good")


def test_batch_rows_without_grammar_allow_everything(manager: GrammarManager) -> None:
    assert manager.fill_bitmask([None, None]) is None
    manager.add_request("one", StructuredOutputsParams(regex="[0-9]"))
    manager.add_request("two", StructuredOutputsParams(regex="[a-z]"))
    bitmask = manager.fill_bitmask([None, "one", None, "two"])  # more rows than preallocated
    assert bitmask is not None and bitmask.shape[0] == 4
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
    assert _allowed(bitmask[1], manager.vocab_size) != _allowed(bitmask[3], manager.vocab_size)
    with pytest.raises(KeyError):
        manager.fill_bitmask(["never-added"])
    manager.remove("one")
    manager.remove("two")


def test_apply_bitmask_masks_columns_past_the_bitmask() -> None:
    logits = torch.zeros(2, 40)
    bitmask = torch.tensor([[0b101]], dtype=torch.int32).repeat(2, 1)  # one word: ids 0 and 2
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 0], [0, 2], [1, 0], [1, 2]]
    top_bit = torch.tensor([[-(2**31)]], dtype=torch.int32)  # bit 31 is the sign bit
    logits = torch.zeros(1, 32)
    apply_bitmask(logits, top_bit)
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 31]]


def test_compile_runs_off_thread_and_is_cached(tokenizer: Tokenizer) -> None:
    with ThreadPoolExecutor(max_workers=1) as executor:
        grammar_manager = GrammarManager(tokenizer, tokenizer.vocab_size, cache_size=2, executor=executor)
        release = threading.Event()
        executor.submit(release.wait)  # occupies the only compile thread
        grammar_manager.add_request("a", StructuredOutputsParams(regex="x"))
        grammar_manager.add_request("b", StructuredOutputsParams(regex="x"))
        assert not grammar_manager.is_ready("a")
        assert grammar_manager.is_ready("never-added")
        assert grammar_manager.num_cached_grammars == 1
        release.set()
        assert grammar_manager.fill_bitmask(["a", "b"]) is not None  # waits for the compilation
        assert grammar_manager.is_ready("a") and grammar_manager.is_ready("b")
        grammar_manager.add_request("c", StructuredOutputsParams(regex="y"))
        grammar_manager.add_request("d", StructuredOutputsParams(regex="z"))
        assert grammar_manager.num_cached_grammars == 2
        grammar_manager.check_invariants()
        # Each request has its own matcher: advancing one leaves the other at the start.
        x = tokenizer.token_to_id("x")
        assert x is not None
        assert grammar_manager.accept_tokens("a", [x])
        assert grammar_manager.is_terminated("a") and not grammar_manager.is_terminated("b")


def test_invalid_grammar_reaching_the_engine_fails_the_request(
    manager: GrammarManager, tokenizer: Tokenizer
) -> None:
    manager.add_request("broken", StructuredOutputsParams(regex="(unclosed"))
    bitmask = manager.fill_bitmask(["broken"])
    assert bitmask is not None
    assert _allowed(bitmask[0], manager.vocab_size) <= set(tokenizer.eos_token_ids)
    error = manager.error("broken")
    assert error is not None and "unclosed" in error
    assert not manager.is_terminated("broken")
    manager.remove("broken")
    manager.add_request("bad-schema", StructuredOutputsParams(json='{"type": "object", "if": {}}'))
    assert manager.fill_bitmask(["bad-schema"]) is not None
    assert "if" in (manager.error("bad-schema") or "")
    assert not manager.accept_tokens("bad-schema", [0])
    manager.remove("bad-schema")
