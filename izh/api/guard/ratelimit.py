"""API key identities and per-key rate limits: a token bucket on tokens, and a concurrency cap.

A key's id is the first 8 hex digits of its SHA-256: stable, not secret, and the only name of a key
that logs, metrics and the rate-limit settings ever use.

Tokens are charged in two phases, because the prompt's token count is known only after the route
has rendered and tokenized it:

1. `reserve`, before the route runs: an estimate from the body (prompt characters / 4, or the
   exact count of token-id prompts, plus max_tokens, for every prompt and each of n samples).
   A key whose bucket cannot cover it gets a 429 with Retry-After, the time the bucket needs.
2. `settle`, after the response: the difference to what the engine actually used (prompt plus
   completion tokens of every sequence) is given back, or charged as debt that later requests wait
   out. A refused or failed request costs nothing.

A request bigger than a key's whole bucket is admitted once the bucket is full (else it could never
run), and the debt it leaves throttles the key afterwards. State is one bucket per key id (the
configured keys only, so memory is bounded) and is never shared between keys.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from izh.errors import RateLimitExceeded
from izh.settings import KeyRateLimit

ANONYMOUS_KEY_ID = "anonymous"
"""The key id of every request when the server has no API keys."""
CHARS_PER_TOKEN = 4
"""Text-to-token estimate for the reservation (OpenAI's rule of thumb); settling corrects it."""
UNLIMITED = KeyRateLimit(tokens_per_minute=None, burst_tokens=None, max_concurrent_requests=None)


def api_key_id(key: str) -> str:
    """The non-secret id of an API key: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def api_key_cache_salt(key: str) -> str:
    """The prefix-cache salt of a key: derived from the secret, so unknown to other tenants, and of
    fixed length, so that appending a request's own salt stays unambiguous."""
    return hashlib.sha256(b"izh-cache-salt\0" + key.encode()).hexdigest()


@dataclass(slots=True)
class TokenBucket:
    """`capacity` tokens refilled at `rate_per_s`; the level may go negative (debt)."""

    capacity: float
    rate_per_s: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
            self.updated = now

    def take(self, cost: float, now: float) -> float:
        """Take `cost` if the bucket covers it (or is full); else take nothing and return the
        seconds until it will (0.0 when taken)."""
        self.refill(now)
        needed = min(cost, self.capacity)
        if self.level >= needed:
            self.level -= cost
            return 0.0
        return (needed - self.level) / self.rate_per_s

    def give_back(self, amount: float, now: float) -> None:
        """Return unused tokens (a negative amount charges more)."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class KeyState:
    """One key's bucket (None: no token limit) and its generation requests in flight."""

    limit: KeyRateLimit
    bucket: TokenBucket | None
    num_in_flight: int = 0


@dataclass(slots=True)
class Reservation:
    """What `reserve` took for one request; hand it to `settle` exactly once."""

    key_id: str
    num_tokens: int
    settled: bool = field(default=False)


class RateLimiter:
    """Per key id token buckets and concurrency counts (on the event loop only: no locking)."""

    def __init__(
        self,
        default: KeyRateLimit = UNLIMITED,
        per_key: Mapping[str, KeyRateLimit] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.default = default
        self.per_key = dict(per_key or {})
        self._clock = clock
        self._keys: dict[str, KeyState] = {}

    @property
    def enabled(self) -> bool:
        return any(_limits_anything(limit) for limit in (self.default, *self.per_key.values()))

    def limit_of(self, key_id: str) -> KeyRateLimit:
        return self.per_key.get(key_id, self.default)

    def _state(self, key_id: str) -> KeyState:
        state = self._keys.get(key_id)
        if state is None:
            limit = self.limit_of(key_id)
            bucket = None
            if limit.tokens_per_minute is not None:
                capacity = float(limit.burst_tokens or limit.tokens_per_minute)
                bucket = TokenBucket(capacity, limit.tokens_per_minute / 60.0, capacity, self._clock())
            state = self._keys[key_id] = KeyState(limit, bucket)
        return state

    def reserve(self, key_id: str, num_tokens: int) -> Reservation:
        """Admit one generation request of about `num_tokens`, or raise RateLimitExceeded (429)."""
        state = self._state(key_id)
        limit = state.limit
        if limit.max_concurrent_requests is not None and state.num_in_flight >= limit.max_concurrent_requests:
            raise RateLimitExceeded(
                f"Rate limit reached for key {key_id}: {state.num_in_flight} requests in flight "
                f"(limit {limit.max_concurrent_requests}). Retry when one has finished.",
                retry_after_s=1,
            )
        if state.bucket is not None:
            wait_s = state.bucket.take(num_tokens, self._clock())
            if wait_s > 0:
                raise RateLimitExceeded(
                    f"Rate limit reached for key {key_id}: this request needs about {num_tokens} tokens "
                    f"and the limit is {limit.tokens_per_minute} tokens per minute. Retry in "
                    f"{math.ceil(wait_s)} s.",
                    retry_after_s=max(1, math.ceil(wait_s)),
                )
        state.num_in_flight += 1
        return Reservation(key_id, num_tokens)

    def settle(self, reservation: Reservation, num_tokens_used: int) -> None:
        """The request is over and used `num_tokens_used`: correct the charge, free its slot."""
        if reservation.settled:
            return
        reservation.settled = True
        state = self._keys[reservation.key_id]
        state.num_in_flight -= 1
        if state.bucket is not None:
            state.bucket.give_back(reservation.num_tokens - num_tokens_used, self._clock())

    def snapshot(self, key_id: str) -> dict[str, Any]:
        """A key's current level and in-flight count (for tests and debugging)."""
        state = self._state(key_id)
        level = None
        if state.bucket is not None:
            state.bucket.refill(self._clock())
            level = state.bucket.level
        return {"tokens_available": level, "num_in_flight": state.num_in_flight}


def _limits_anything(limit: KeyRateLimit) -> bool:
    return limit.tokens_per_minute is not None or limit.max_concurrent_requests is not None


# --- the estimate ------------------------------------------------------------------------------------


def estimate_request_tokens(
    body: Any, *, default_max_tokens: int, max_model_len: int, path: str = "/v1/chat/completions"
) -> int:
    """What a chat, completion, responses or embeddings body (sent to `path`) may cost, before
    tokenization (see the module docstring).

    `default_max_tokens` stands in when the body sets none. Tolerates any JSON: a body the route
    will refuse anyway is estimated as cheaply as possible.
    """
    if not isinstance(body, dict):
        return 1
    prompts = _prompt_token_estimates(body, path)
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    max_tokens = _requested_max_tokens(body)
    total = 0
    for num_prompt_tokens in prompts:
        room = max(max_model_len - num_prompt_tokens, 0)
        output = min(max_tokens if max_tokens is not None else default_max_tokens, room)
        total += n * (num_prompt_tokens + output)
    return max(total, 1)


def _requested_max_tokens(body: dict[str, Any]) -> int | None:
    """The request's output budget; 0 (a prompt scored with echo) reserves no output tokens."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


SCORING_PATHS = frozenset({"/v1/rerank", "/rerank", "/score", "/v1/score"})
"""The rerank and score routes (izh.api.rerank): prompt-only, like /v1/embeddings."""


def _prompt_token_estimates(body: dict[str, Any], path: str) -> list[int]:
    """One estimate per prompt: exact for token ids, characters / CHARS_PER_TOKEN for text."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [_text_tokens(sum(_chars(message) for message in messages))]
    if path in SCORING_PATHS:  # every text is embedded once
        texts = [body.get(key) for key in ("query", "documents", "text_1", "text_2")]
        return [_text_tokens(sum(_chars(text) for text in texts))]
    if path == "/v1/embeddings":
        prompt = body.get("input")  # strings or token ids, as a completion's prompt
    elif "input" in body:  # /v1/responses: the input items and the instructions
        return [_text_tokens(_chars(body.get("input")) + _chars(body.get("instructions")))]
    else:
        prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_text_tokens(len(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) for item in prompt):
            return [len(prompt)]
        return [len(item) if isinstance(item, list) else _text_tokens(_chars(item)) for item in prompt]
    return [1]


def _text_tokens(num_chars: int) -> int:
    return max(1, math.ceil(num_chars / CHARS_PER_TOKEN))


def _chars(value: Any) -> int:
    """Characters of text anywhere in a JSON value (a message and its content parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(item) for item in value.values())
    if isinstance(value, list):
        return sum(_chars(item) for item in value)
    return 0
