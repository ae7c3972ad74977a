"""SamplingParams: every per-request sampling field, validated once at the edge.

Construction (and msgspec's replace and decode) checks every field that the model does not
matter to; the frontend's one validation point (izh.frontend.input_processor) adds the
vocabulary-dependent checks with `validate_vocab` once it knows the model.

No torch here: the API process builds these and sends them to the engine core as msgpack.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from izh.errors import InvalidRequest

# Below this temperature a request samples greedily (vLLM's epsilon): dividing by it would overflow.
_GREEDY_EPSILON = 1e-5

MAX_TEMPERATURE = 100.0
# vLLM only asks for > 0. Above 2 a penalty flattens every seen token into noise and no model card
# recommends it, so a larger value is far more likely a client bug (a percentage, say) than intent.
MAX_REPETITION_PENALTY = 2.0
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# vLLM's GPU sampler caps bad words at 128 a request; their text is bounded too, so that the
# engine's matching of each word against the output's end every step stays small.
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 4096
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


def _is_number(value: object) -> bool:
    # bool is an int subclass, but `temperature=True` is a client bug, not a number.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_number(
    param: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return `value` as a float after checking it is a finite number in the given interval."""
    if not _is_number(value):
        raise InvalidRequest(f"{param} must be a number, got {value!r}", param=param)
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise InvalidRequest(f"{param} must be finite, got {value!r}", param=param)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise InvalidRequest(f"{param} must be in {interval}, got {value!r}", param=param)
    return number


def _check_int(param: str, value: object, low: int, high: int | None = None) -> int:
    """Return `value` after checking it is an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{param} must be an integer, got {value!r}", param=param)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"{param} must be {bound}, got {value}", param=param)
    return value


def _check_bool(param: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{param} must be a boolean, got {value!r}", param=param)


def _check_token_ids(param: str, token_ids: object, vocab_size: int | None) -> None:
    """Every id must be an int in [0, vocab_size) (just >= 0 while the vocabulary is unknown)."""
    if not isinstance(token_ids, list):
        raise InvalidRequest(f"{param} must be a list of token ids", param=param)
    for token_id in token_ids:
        _check_token_id(param, token_id, vocab_size)


def _check_below_vocab(param: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """The vocabulary-dependent half of `_check_token_ids` (ids already known to be ints >= 0)."""
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise InvalidRequest(
                f"{param} contains token id {token_id}, outside [0, {vocab_size})", param=param
            )


def _check_token_id(param: str, token_id: object, vocab_size: int | None) -> None:
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        raise InvalidRequest(f"{param} must contain integer token ids, got {token_id!r}", param=param)
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidRequest(f"{param} contains token id {token_id}, outside {bound}", param=param)


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One constraint on the output's shape; exactly one field must be set.

    `json` is a JSON schema serialised as a string; `grammar` is Lark/EBNF text; `json_object` asks for
    any JSON object. An empty spec is rejected: a request without a constraint sends None instead.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequest(param="structured_outputs") unless exactly one valid constraint is set."""
        param = "structured_outputs"
        _check_bool(f"{param}.json_object", self.json_object)
        kinds = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise InvalidRequest(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                f"(got {found})",
                param=param,
            )
        if self.json is not None:
            self._check_json_schema()
        for name, text in (("regex", self.regex), ("grammar", self.grammar)):
            if text is not None and (not isinstance(text, str) or not text):
                raise InvalidRequest(f"structured_outputs.{name} must be a non-empty string", param=param)
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(option, str) for option in self.choice)
        ):
            raise InvalidRequest("structured_outputs.choice must be a non-empty list of strings", param=param)

    def _check_json_schema(self) -> None:
        param = "structured_outputs"
        if not isinstance(self.json, str):
            raise InvalidRequest("structured_outputs.json must be a JSON schema as a string", param=param)
        try:
            schema = json.loads(self.json)
        except ValueError as exc:
            raise InvalidRequest(f"structured_outputs.json is not valid JSON: {exc}", param=param) from exc
        # A JSON schema is an object, or a boolean (true accepts anything, false nothing).
        if not isinstance(schema, dict | bool):
            raise InvalidRequest("structured_outputs.json must be a JSON schema object", param=param)


def context_room(max_model_len: int, num_prompt_tokens: int) -> int:
    """THE room a prompt leaves in the context: how many output tokens fit beside it within
    `max_model_len` (0 or less when the prompt fills it)."""
    return max_model_len - num_prompt_tokens


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request: vLLM's fields and defaults, validated on construction and on decode.

    `top_k` 0 (or -1, normalised to 0) means off; `max_tokens` None means "up to the context length",
    0 "compute the prompt only" (its prompt_logprobs; the request samples nothing).
    Construction checks every field with token ids only >= 0; the vocabulary-dependent checks
    (token ids < vocab_size) run once, in `validate_vocab`, where the frontend validates a request
    (izh.frontend.input_processor.validate_request).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    """Only these ids may be sampled (None: any). Duplicates are dropped."""
    bad_words: list[str] = []
    """Words never to generate, as vLLM bans them: see `with_bad_words_token_ids`."""
    bad_words_token_ids: list[list[int]] = []
    """Token sequences never to generate: a sequence's last token is masked whenever the output
    ends with the rest of it (a one-token sequence always). The engine adds bad_words' own."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """Accepted for vLLM compatibility; like transformers' and vLLM's fast (Rust) tokenizers, which are
    the only kind izh loads, decoding never inserts spaces between special tokens, so it changes nothing."""
    structured_outputs: StructuredOutputsParams | None = None
    speculative_decoding: bool = True
    """izh's extension: False opts this request out of speculative decoding (no drafts are proposed
    for it, as if the server ran without --speculative-config). Its tokens are the same either way."""

    def __post_init__(self) -> None:
        self._normalise()
        self._validate_fields()

    @property
    def is_greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < _GREEDY_EPSILON

    def clone(self) -> SamplingParams:
        """A deep copy: mutating the clone's lists or dicts leaves this one alone."""
        return copy.deepcopy(self)

    def child(self, sample_index: int) -> SamplingParams:
        """THE n -> children rule: the params of sample `sample_index` of n, sent as its own engine request
        (n=1), seeded samples given distinct seeds (seed + index) so that they still differ. A copy (this
        one is unchanged); no check runs again."""
        child = copy.copy(self)
        child.n = 1
        if child.seed is not None:
            child.seed = child.seed + sample_index
        return child

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with `max_tokens` set (this one is unchanged); no check runs again, so the caller
        guarantees 0 <= max_tokens, and min_tokens <= max_tokens unless max_tokens is 0."""
        resolved = copy.copy(self)
        resolved.max_tokens = max_tokens
        return resolved

    def with_bad_words_token_ids(self, encode: Callable[[str], list[int]], vocab_size: int) -> SamplingParams:
        """A copy whose bad_words_token_ids also hold bad_words' token sequences (this one is unchanged).

        As vLLM: each word, leading whitespace stripped, is encoded (`encode` adds no special
        tokens) as is and with a leading space, so it is banned at the start of the text and after
        a space. Unlike vLLM, the spaced form is always kept: vLLM drops it unless it has as many
        tokens as the bare one, which lets " sunny" (one SmolLM2 token) through because "sunny" takes
        two. (Where a tokenizer adds the space itself, the spaced form only repeats the bare one's
        ban.) A sequence with an id the model can never produce (>= vocab_size) can never appear,
        so it is left out.
        """
        if not self.bad_words:
            return self
        sequences = [list(ids) for ids in self.bad_words_token_ids]
        for word in self.bad_words:
            for form in (word.lstrip(), " " + word.lstrip()):
                ids = encode(form)
                if ids and max(ids) < vocab_size and ids not in sequences:
                    sequences.append(ids)
        # A shallow copy, not msgspec's replace: that would run every check again, and the new
        # sequences are the tokenizer's, valid by construction.
        resolved = copy.copy(self)
        resolved.bad_words_token_ids = sequences
        return resolved

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the offending field for any invalid value.

        Construction already ran the vocabulary-independent checks; call this only after mutating a
        field in place. With `vocab_size` the token ids are checked against it too (`validate_vocab`).
        """
        self._validate_fields()
        if vocab_size is not None:
            self.validate_vocab(vocab_size)

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequest unless every token id is below `vocab_size`.

        Only the vocabulary-dependent checks: the fields' types, ranges and non-negative ids were
        checked on construction. Fields are checked in `validate`'s order, with its messages.
        """
        _check_below_vocab("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.logit_bias is not None:
            _check_below_vocab("logit_bias", self.logit_bias, vocab_size)
        if self.allowed_token_ids is not None:
            _check_below_vocab("allowed_token_ids", self.allowed_token_ids, vocab_size)
        for ids in self.bad_words_token_ids:
            _check_below_vocab("bad_words_token_ids", ids, vocab_size)

    def max_token_id(self) -> int:
        """The largest token id a field names (-1 for none): the engine core's cheap invariant
        check that `validate_vocab` passed (an id past the vocabulary would fail its whole step)."""
        largest = max(self.stop_token_ids, default=-1)
        if self.logit_bias:
            largest = max(largest, max(self.logit_bias))
        if self.allowed_token_ids:
            largest = max(largest, max(self.allowed_token_ids))
        for ids in self.bad_words_token_ids:
            largest = max(largest, max(ids, default=-1))
        return largest

    def _validate_fields(self) -> None:
        """Every check that needs no vocabulary (token ids only >= 0)."""
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_logprobs()
        self._validate_stops(None)
        self._validate_token_constraints(None)
        for flag in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "speculative_decoding",
        ):
            _check_bool(flag, getattr(self, flag))
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequest(
                    "structured_outputs must be a StructuredOutputsParams", param="structured_outputs"
                )
            self.structured_outputs.validate()

    def _normalise(self) -> None:
        # vLLM and HF both spell "no top-k" as -1 as well as 0; keep one spelling.
        if self.top_k == -1:
            self.top_k = 0
        # OpenAI sends a single stop string as a bare string.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # JSON object keys are strings; OpenAI's logit_bias arrives as {"50256": -100}.
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_bias_key(key): value for key, value in self.logit_bias.items()}

    def _validate_sampling(self) -> None:
        self.n = _check_int("n", self.n, 1, MAX_N)
        self.temperature = _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _check_int("top_k", self.top_k, 0)
        self.min_p = _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, MIN_SEED, MAX_SEED)

    def _validate_penalties(self) -> None:
        self.presence_penalty = _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _check_number(
            "repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True
        )

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            # 0 asks for the prompt alone: computed (for prompt_logprobs), nothing sampled.
            self.max_tokens = _check_int("max_tokens", self.max_tokens, 0)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                param="min_tokens",
            )

    def _validate_logprobs(self) -> None:
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    def _validate_stops(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop, list):
            raise InvalidRequest("stop must be a string or a list of strings", param="stop")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequest(f"stop strings must be non-empty strings, got {stop!r}", param="stop")
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)

    def _validate_token_constraints(self, vocab_size: int | None) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias must map token ids to biases", param="logit_bias")
            for token_id, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token_id, vocab_size)
                _check_number("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
            # An empty allow-list would mask every token and leave nothing to sample.
            if not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        self._validate_bad_words(vocab_size)

    def _validate_bad_words(self, vocab_size: int | None) -> None:
        param = "bad_words"
        if not isinstance(self.bad_words, list) or not all(isinstance(word, str) for word in self.bad_words):
            raise InvalidRequest("bad_words must be a list of strings", param=param)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(
                f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are supported",
                param=param,
            )
        if sum(len(word) for word in self.bad_words) > MAX_BAD_WORDS_CHARS:
            raise InvalidRequest(f"bad_words exceed {MAX_BAD_WORDS_CHARS} characters in all", param=param)
        for word in self.bad_words:
            if not word.strip():
                raise InvalidRequest(f"bad_words entries must be words, got {word!r}", param=param)
        param = "bad_words_token_ids"
        sequences = self.bad_words_token_ids
        if not isinstance(sequences, list):
            raise InvalidRequest("bad_words_token_ids must be a list of token id lists", param=param)
        for ids in sequences:
            _check_token_ids(param, ids, vocab_size)
            if not ids:
                raise InvalidRequest("bad_words_token_ids must not contain an empty sequence", param=param)


def _bias_key(key: Any) -> Any:
    """A token id from a logit_bias key: "50256" becomes 50256; anything else is left for validation."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return key
