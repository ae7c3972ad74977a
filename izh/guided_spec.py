r"""Structured-output specs → llguidance grammars, and their validation at the edge.

No torch here: the API process validates every spec before a request reaches the engine core, so a
bad schema, regex or grammar is a 400 naming the problem, never silently unconstrained output. The
engine core compiles the same grammar text (`compile_grammar`) into matchers (izh.engine.guided).

JSON that terminates. llguidance's JSON numbers have no length limit (`-?(0|[1-9][0-9]*)(\.[0-9]+)?
([eE][+-]?[0-9]+)?`, not configurable), so SmolLM2-135M writing pi as JSON goes on
`3.1415926535987392653616336323128128128...` until max_tokens. Every grammar whose output holds
JSON (a JSON schema, json_object, and each `%json {...}` inside a Lark grammar: tool calls, the
answer after a reasoning block, a client's own grammar) therefore gets a second grammar,
`bounds_grammar`: the same shape with each JSON value replaced by any JSON value whose lexemes are
bounded. The engine samples only tokens both grammars allow. The bounds:

- a number without a fraction: at most 20 digits (every int64 and uint64);
- a number with a fraction: at most 17 significant digits (what a double carries), and a number
  below 1 at most 6 zeros after the point before its first significant digit (serializers switch to
  an exponent there: Python below 1e-4, JavaScript below 1e-6);
- an exponent: at most 3 digits (a double's exponent is within ±324);
- whitespace between two JSON tokens: at most one line break and 24 spaces or tabs
  (`JSON_WHITESPACE_PATTERN`, which the JSON grammars izh builds also use themselves).

Strings are not bounded: their length is content. Where the two grammars leave no token in common
(a schema whose x-guidance sets a separator the bounds do not know, after a 20-digit item), the
engine drops the bounds for that request rather than fail it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from izh.errors import InvalidRequest
from izh.sampling_params import StructuredOutputsParams
from izh.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "JSON_WHITESPACE_PATTERN",
    "MAX_EXPONENT_DIGITS",
    "MAX_INTEGER_DIGITS",
    "MAX_LEADING_ZEROS",
    "MAX_SIGNIFICANT_DIGITS",
    "MAX_WHITESPACE_COLUMNS",
    "SpecKey",
    "bounds_grammar",
    "build_ll_tokenizer",
    "choice_lark",
    "close_objects",
    "compile_grammar",
    "json_compile_options",
    "lark_literal",
    "lark_opaque_end",
    "spec_key",
    "validate_spec",
]

MAX_INTEGER_DIGITS = 20
MAX_SIGNIFICANT_DIGITS = 17
MAX_LEADING_ZEROS = 6
MAX_EXPONENT_DIGITS = 3
MAX_WHITESPACE_COLUMNS = 24

# JSON whitespace: at most one line break and bounded indentation between two tokens. Pretty-printed
# JSON still fits; a model stuck emitting newlines (a known failure of unbounded JSON whitespace)
# is forced back to a structural character instead of running to max_tokens.
JSON_WHITESPACE_PATTERN = rf"(?:\r?\n)?[\x20\x09]{{0,{MAX_WHITESPACE_COLUMNS}}}"

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
        return llguidance.LLMatcher.grammar_from_json_schema(
            close_objects(schema), defaults=json_compile_options()
        )
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}", param="structured_outputs") from None


_T = TypeVar("_T")

# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object schema with one of these says (or composes) what else it takes: left as it is.
_OPEN_BY_DESIGN = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf",
                   "oneOf", "$ref", "if", "dependentSchemas")  # fmt: skip


def close_objects(schema: _T, *, in_all_of: bool = False) -> _T:
    """`schema` with every object schema that lists `properties` and says nothing of other keys
    (no `additionalProperties`, `patternProperties`, `unevaluatedProperties`, composition or `$ref`
    beside them) closed to those properties: `additionalProperties: false`.

    JSON Schema's default admits any other key, and a small model then invents keys until max_tokens
    (`"area2"`, `"area3"`, ...). Closed objects are what OpenAI's strict mode requires and what vLLM's
    default backend (xgrammar's strict mode) assumes. A schema that wants extra keys says so
    (`additionalProperties: true` or a schema). Branches of `allOf` stay open, since each one sees
    only part of the object. Returns a new schema; the input is not modified.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, object] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            out[key] = close_objects(value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [close_objects(v, in_all_of=key == "allOf") for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(v) for name, v in value.items()}
        else:
            out[key] = value
    if (
        isinstance(schema.get("properties"), dict)
        and not in_all_of
        and not any(k in schema for k in _OPEN_BY_DESIGN)
    ):
        out["additionalProperties"] = False
    return cast(_T, out)


def _to_lark(text: str) -> str:
    """Lark text as is; GBNF (llama.cpp's `root ::= ...`) converted to Lark."""
    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter raises its own error types
        raise InvalidRequest(f"invalid grammar: {exc}", param="structured_outputs") from None


# ---- the lexical bounds on JSON (see the module docstring) --------------------------------------

# Any JSON value, its lexemes bounded. Whitespace may sit wherever llguidance's JSON allows it
# (between two tokens), at most once; strings accept every escape JSON has, so that these rules
# accept everything llguidance's JSON grammars do except the over-long lexemes.
_BOUNDED_JSON_RULES = rf"""
izh_json_value: izh_json_object | izh_json_array | IZH_JSON_STRING | IZH_JSON_NUMBER | "true" | "false" | "null"
izh_json_object: "{{" IZH_JSON_WS? (izh_json_member (IZH_JSON_WS? "," IZH_JSON_WS? izh_json_member)* IZH_JSON_WS?)? "}}"
izh_json_member: IZH_JSON_STRING IZH_JSON_WS? ":" IZH_JSON_WS? izh_json_value
izh_json_array: "[" IZH_JSON_WS? (izh_json_value (IZH_JSON_WS? "," IZH_JSON_WS? izh_json_value)* IZH_JSON_WS?)? "]"
IZH_JSON_STRING: /"(?:[^"\\\x00-\x1F]|\\(?:["\\\/bfnrt]|u[0-9a-fA-F]{{4}}))*"/
IZH_JSON_WS: /\r?\n[\x20\x09]{{0,{MAX_WHITESPACE_COLUMNS}}}|[\x20\x09]{{1,{MAX_WHITESPACE_COLUMNS}}}/
IZH_JSON_NUMBER: /-?/ (IZH_JSON_INTEGER | IZH_JSON_FRACTION | IZH_JSON_SMALL_FRACTION) IZH_JSON_EXPONENT?
IZH_JSON_INTEGER: /0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}}/
IZH_JSON_FRACTION: /[1-9][0-9]*\.[0-9]+/ & /[0-9.]{{1,{MAX_SIGNIFICANT_DIGITS + 1}}}/
IZH_JSON_SMALL_FRACTION: /0\.(?:0{{0,{MAX_LEADING_ZEROS}}}[1-9][0-9]{{0,{MAX_SIGNIFICANT_DIGITS - 1}}}|0{{1,{MAX_SIGNIFICANT_DIGITS}}})/
IZH_JSON_EXPONENT: /[eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}}/
"""
# In a client's Lark grammar the bounded JSON is a nested grammar: its own lexemes, so that the
# grammar's own %ignore (which a %json block does not see either) never applies inside it.
_BOUNDED_JSON_RULE = "izh_json_bounded"
_NESTED_BOUNDED_JSON = f"{_BOUNDED_JSON_RULE}: %lark {{\nstart: izh_json_value\n{_BOUNDED_JSON_RULES}}}\n"

_LARK_TOKEN_REFERENCE = re.compile(r"<[^<>\s]+>")
_LARK_NAME_CHAR = re.compile(r"[A-Za-z0-9_\-]")
_JSON_DECODER = json.JSONDecoder()


def bounds_grammar(spec: StructuredOutputsParams) -> str | None:
    """The llguidance grammar bounding the JSON lexemes of `spec`'s output, or None when its output
    holds no JSON (a regex, a choice, a grammar without `%json`).

    It accepts what `compile_grammar(spec)` accepts, except numbers and whitespace past the bounds of
    the module docstring; the engine samples only tokens both allow.
    """
    return _bounds_key(spec_key(spec))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _bounds_key(key: SpecKey) -> str | None:
    kind, text = key
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_lark("start: izh_json_value\n" + _BOUNDED_JSON_RULES)
    if kind != "grammar":
        return None
    try:
        lark = _to_lark(text)
    except InvalidRequest:
        return None  # compile_grammar refuses it too
    bounded = _replace_json_blocks(lark, _BOUNDED_JSON_RULE)
    if bounded is None:
        return None
    return llguidance.LLMatcher.grammar_from_lark(bounded + "\n" + _NESTED_BOUNDED_JSON)


def _replace_json_blocks(lark: str, rule: str) -> str | None:
    """`lark` with every `%json {...}` replaced by a reference to `rule`; None when it has none (or
    one whose JSON does not parse: llguidance refuses that grammar anyway).

    "%json" inside a string literal, regex, comment or special-token reference is left alone
    (`lark_opaque_end`).
    """
    pieces: list[str] = []
    copied = position = 0
    while position < len(lark):
        if (end := lark_opaque_end(lark, position)) is not None:
            position = end
        elif lark.startswith("%json", position) and not _LARK_NAME_CHAR.match(lark, position + 5):
            start = position
            position += 5
            while position < len(lark) and lark[position] in " \t\r\n":
                position += 1
            try:
                _, position = _JSON_DECODER.raw_decode(lark, position)
            except ValueError:
                return None
            pieces += [lark[copied:start], rule]
            copied = position
        else:
            position += 1
    if not pieces:
        return None
    return "".join(pieces) + lark[copied:]


def lark_opaque_end(text: str, position: int) -> int | None:
    """The index just past the string literal, regex, comment or special-token reference (`<name>`)
    that starts at `position` in Lark grammar `text`, or None when none starts there.

    The one scanner rule for Lark text: whoever looks for names or directives in a grammar skips
    these, so a name inside a literal is never taken for one.
    """
    char = text[position]
    if char == '"' or (char == "/" and not text.startswith("//", position)):
        return _lark_literal_end(text, position)
    if char == "#" or text.startswith("//", position):
        newline = text.find("\n", position)
        return len(text) if newline < 0 else newline
    if char == "<" and (token := _LARK_TOKEN_REFERENCE.match(text, position)):
        return token.end()
    return None


def _lark_literal_end(text: str, start: int) -> int:
    """The index after the string or regex literal opened at `start` (backslash escapes skipped;
    the end of `text` for one left open)."""
    quote = text[start]
    position = start + 1
    while position < len(text) and text[position] != quote:
        position += 2 if text[position] == "\\" else 1
    return min(position + 1, len(text))


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
