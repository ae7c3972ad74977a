"""Structured-output specs → llguidance grammars, and their validation at the edge.

No torch here: the API process validates every spec before a request reaches the engine core, so a
bad schema, regex or grammar is a 400 naming the problem, never silently unconstrained output. The
engine core compiles the same grammar text (`compile_grammar`) into matchers (izh.engine.guided).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from izh.errors import InvalidRequest
from izh.sampling_params import StructuredOutputsParams
from izh.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "JSON_WHITESPACE_PATTERN",
    "SpecKey",
    "build_ll_tokenizer",
    "choice_lark",
    "compile_grammar",
    "json_compile_options",
    "lark_literal",
    "spec_key",
    "validate_spec",
]

# JSON whitespace: at most one line break and bounded indentation between two tokens. Pretty-printed
# JSON still fits; a model stuck emitting newlines (a known failure of unbounded JSON whitespace)
# is forced back to a structural character instead of running to max_tokens.
JSON_WHITESPACE_PATTERN = r"(?:\r?\n)?[\x20\x09]{0,24}"

_CACHE_SIZE = 512

# (kind, text): the spec reduced to what determines its grammar; the cache key on both sides.
SpecKey = tuple[str, str]


def json_compile_options() -> JsonCompileOptions:
    """llguidance's JSON-schema options: no lenient mode (an unsupported keyword is an error, not
    ignored), oneOf kept exact, bounded whitespace."""
    return {"whitespace_pattern": JSON_WHITESPACE_PATTERN, "lenient": False, "coerce_one_of": False}


def spec_key(spec: StructuredOutputsParams) -> SpecKey:
    """The (kind, text) pair that determines `spec`'s grammar; equal keys give equal grammars."""
    if spec.json is not None:
        return ("json", spec.json)
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.choice is not None:
        return ("choice", json.dumps(spec.choice, ensure_ascii=False))
    if spec.grammar is not None:
        return ("grammar", spec.grammar)
    if spec.json_object:
        return ("json_object", "")
    raise ValueError("structured outputs spec sets no constraint")


def compile_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text enforcing `spec`.

    Raises InvalidRequest(param="structured_outputs") when the spec cannot even be turned into a
    grammar (a schema that is not a JSON object, a grammar that is neither Lark nor GBNF); a grammar
    that compiles to text may still be invalid: `validate_spec` checks that.
    """
    return _compile_key(spec_key(spec))


def validate_spec(
    spec: StructuredOutputsParams,
    tokenizer: llguidance.LLTokenizer | None = None,
    *,
    param: str = "structured_outputs",
) -> None:
    """Raise InvalidRequest(param=param) naming the problem unless llguidance can enforce `spec`.

    Catches invalid JSON schemas, schema features llguidance cannot enforce (e.g. `if`/`then`,
    regex lookarounds in `pattern`, unknown formats), invalid regexes and invalid grammars. With
    `tokenizer` (see `build_ll_tokenizer`) special-token references in grammars are checked too.
    Results are cached by spec text, so calling this per request is cheap.
    """
    key = spec_key(spec)
    try:
        error = _validation_error(key, tokenizer)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param=param) from None
    if error:
        raise InvalidRequest(f"invalid {_KIND_NAMES[key[0]]}: {error}", param=param)


_KIND_NAMES = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "JSON object spec",
}


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile_key(key: SpecKey) -> str:
    kind, text = key
    if kind == "json":
        return _json_schema_grammar(text)
    if kind == "json_object":
        return _json_schema_grammar('{"type": "object"}')
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(json.loads(text)))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(_to_lark(text))
    raise ValueError(f"unknown structured outputs kind {kind!r}")


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _validation_error(key: SpecKey, tokenizer: llguidance.LLTokenizer | None) -> str:
    """llguidance's error message for the grammar of `key`, or "" when it is valid."""
    grammar = _compile_key(key)
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer)


def _json_schema_grammar(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}", param="structured_outputs") from None
    # Boolean schemas are valid JSON schema; llguidance's options apply only to object schemas.
    if schema is True:
        schema = {}
    elif schema is False:
        raise InvalidRequest("invalid JSON schema: `false` accepts nothing", param="structured_outputs")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_compile_options())
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}", param="structured_outputs") from None


def _to_lark(text: str) -> str:
    """Lark text as is; GBNF (llama.cpp's `root ::= ...`) converted to Lark."""
    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter raises its own error types
        raise InvalidRequest(f"invalid grammar: {exc}", param="structured_outputs") from None


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar accepting exactly one of `choices`, each an escaped string literal."""
    return "start: " + " | ".join(lark_literal(choice) for choice in choices)


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal: llguidance reads JSON string escapes in literals."""
    return json.dumps(text, ensure_ascii=False)


# ---- the engine's view of the tokenizer --------------------------------------------------------


class _TokenBytesWrapper:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each id's bytes, specials, EOS."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        # Ids past the tokenizer's vocabulary (padding rows of the logits) are empty: never allowed.
        self.tokens = [tokenizer.token_bytes(token_id) for token_id in range(vocab_size)]
        self.special_token_ids = sorted(i for i in tokenizer.all_special_ids if i < vocab_size)
        self._backend = tokenizer.backend

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._backend.encode(text, add_special_tokens=False).ids


def build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, covering `vocab_size` ids (the logits width, which
    may exceed the tokenizer's vocabulary). Expensive for large vocabularies: build once.

    Built from our own token-bytes table (the one the detokenizer uses), so HF and GGUF tokenizers
    take one path and the grammar sees exactly the bytes the client will see. Every id in
    `tokenizer.eos_token_ids` counts as EOS. Raises ValueError for a tokenizer without an EOS token.
    """
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    eos_ids = sorted(i for i in tokenizer.eos_token_ids if i < size)
    if not eos_ids:
        raise ValueError("structured outputs need a tokenizer with an EOS token")
    wrapper = llguidance.TokenizerWrapper(_TokenBytesWrapper(tokenizer, size, eos_ids[0]))
    return llguidance.LLTokenizer(wrapper, n_vocab=size, eos_token=eos_ids)
