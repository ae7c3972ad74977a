"""SamplingParams: every per-request sampling field, validated once at the edge.

No torch here: the API process builds these and sends them to the engine core as msgpack.
"""

from __future__ import annotations

import copy
import json
import math
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


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request: vLLM's fields and defaults, validated on construction and on decode.

    `top_k` 0 (or -1, normalised to 0) means off; `max_tokens` None means "up to the context length".
    The vocabulary-dependent checks (token ids in range) run in `validate(vocab_size)`, which the
    engine calls once it knows the model.
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
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """Accepted for vLLM compatibility; like transformers' and vLLM's fast (Rust) tokenizers, which are
    the only kind izh loads, decoding never inserts spaces between special tokens, so it changes nothing."""
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self.validate()

    @property
    def is_greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature < _GREEDY_EPSILON

    def clone(self) -> SamplingParams:
        """A deep copy: mutating the clone's lists or dicts leaves this one alone."""
        return copy.deepcopy(self)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the offending field for any invalid value.

        Without `vocab_size` token ids are only checked to be non-negative.
        """
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_logprobs()
        self._validate_stops(vocab_size)
        self._validate_token_constraints(vocab_size)
        for flag in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
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
            self.max_tokens = _check_int("max_tokens", self.max_tokens, 1)
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
