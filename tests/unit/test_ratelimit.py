"""Per-key token buckets and concurrency (izh.api.guard.ratelimit), on a fake clock: exact levels, waits,
debt and refunds, and no state shared between keys."""

from __future__ import annotations

import hashlib

import pytest

from izh.api.guard.ratelimit import (
    RateLimiter,
    TokenBucket,
    api_key_cache_salt,
    api_key_id,
    estimate_request_tokens,
)
from izh.errors import RateLimitExceeded
from izh.settings import KeyRateLimit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limit(tpm: int | None = None, burst: int | None = None, concurrent: int | None = None) -> KeyRateLimit:
    return KeyRateLimit(tokens_per_minute=tpm, burst_tokens=burst, max_concurrent_requests=concurrent)


def test_key_id_is_the_sha256_prefix_and_the_salt_is_not_derivable_from_it() -> None:
    key = "sk-live-123"
    assert api_key_id(key) == hashlib.sha256(key.encode()).hexdigest()[:8]
    assert api_key_id("a") != api_key_id("b")
    salt = api_key_cache_salt(key)
    assert len(salt) == 64 and api_key_id(key) not in salt
    assert api_key_cache_salt("a") != api_key_cache_salt("b")


def test_bucket_takes_refills_and_reports_the_wait() -> None:
    bucket = TokenBucket(capacity=100, rate_per_s=10, level=100, updated=0.0)
    assert bucket.take(60, now=0.0) == 0.0
    assert bucket.level == 40
    assert bucket.take(60, now=0.0) == pytest.approx(2.0)  # 20 missing at 10/s
    assert bucket.level == 40  # a refused take changes nothing
    assert bucket.take(60, now=2.0) == 0.0
    assert bucket.level == 0
    bucket.refill(now=1000.0)
    assert bucket.level == 100  # never above capacity


def test_a_request_bigger_than_the_bucket_runs_once_it_is_full_and_leaves_debt() -> None:
    bucket = TokenBucket(capacity=100, rate_per_s=10, level=100, updated=0.0)
    assert bucket.take(250, now=0.0) == 0.0
    assert bucket.level == -150
    assert bucket.take(1, now=0.0) == pytest.approx(15.1)


def test_over_the_bucket_is_429_with_retry_after_and_settle_refunds() -> None:
    clock = Clock()
    limiter = RateLimiter(_limit(tpm=600, burst=100), clock=clock)  # 10 tokens/s
    first = limiter.reserve("k1", 80)
    with pytest.raises(RateLimitExceeded) as info:
        limiter.reserve("k1", 80)
    assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.retry_after_s == 6  # 60 missing at 10/s
    assert "600 tokens per minute" in info.value.message
    # The first request used only 30 of its 80: 50 come back and the second fits.
    limiter.settle(first, 30)
    assert limiter.snapshot("k1")["tokens_available"] == 70
    second = limiter.reserve("k1", 70)
    limiter.settle(second, 70)
    limiter.settle(second, 70)  # settling twice is a no-op
    assert limiter.snapshot("k1") == {"tokens_available": 0, "num_in_flight": 0}


def test_using_more_than_reserved_is_charged_as_debt() -> None:
    clock = Clock()
    limiter = RateLimiter(_limit(tpm=60, burst=100), clock=clock)  # 1 token/s
    limiter.settle(limiter.reserve("k", 10), 110)
    assert limiter.snapshot("k")["tokens_available"] == -10
    with pytest.raises(RateLimitExceeded) as info:
        limiter.reserve("k", 5)
    assert info.value.retry_after_s == 15
    clock.now += 15
    limiter.reserve("k", 5)


def test_keys_never_share_a_bucket_or_a_slot() -> None:
    clock = Clock()
    limiter = RateLimiter(
        _limit(tpm=60, burst=10, concurrent=1),
        {"big": _limit(tpm=6000, burst=1000, concurrent=3)},
        clock=clock,
    )
    limiter.reserve("a", 10)
    with pytest.raises(RateLimitExceeded):
        limiter.reserve("a", 1)  # a's slot (and bucket) is taken
    b = limiter.reserve("b", 10)  # b is untouched by a
    limiter.settle(b, 10)
    held = [limiter.reserve("big", 100) for _ in range(3)]  # its own, larger limits
    with pytest.raises(RateLimitExceeded) as info:
        limiter.reserve("big", 1)
    assert "3 requests in flight" in info.value.message and info.value.retry_after_s == 1
    assert limiter.snapshot("a") == {"tokens_available": 0, "num_in_flight": 1}
    assert limiter.snapshot("b")["num_in_flight"] == 0
    for reservation in held:
        limiter.settle(reservation, 0)
    assert limiter.snapshot("big") == {"tokens_available": 1000, "num_in_flight": 0}


def test_no_limits_means_disabled_and_unbounded() -> None:
    limiter = RateLimiter()
    assert not limiter.enabled
    for _ in range(100):
        limiter.reserve("k", 10**9)
    assert RateLimiter(per_key={"k": _limit(concurrent=1)}).enabled


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "x" * 40, "max_tokens": 5}, 10 + 5),
        ({"prompt": [1, 2, 3], "max_tokens": 5, "n": 2}, 2 * (3 + 5)),
        ({"prompt": ["abcd", [1, 2]], "max_tokens": 1}, (1 + 1) + (2 + 1)),
        # Every string of a message counts ("user" too: the template renders roles).
        ({"messages": [{"role": "user", "content": "y" * 8}], "max_completion_tokens": 3}, 3 + 3),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 12}]}]}, 5 + 7),
        ({"prompt": "hi", "max_tokens": 10_000}, 1 + 99),  # the output is capped by the context
        ({"prompt": [1, 2, 3], "max_tokens": 0, "echo": True}, 3),  # a scored prompt: no output
        ({"prompt": "hi", "max_tokens": "lots", "n": -1}, 1 + 7),  # junk: the route refuses it
        # /v1/responses: the input items and the instructions, then max_output_tokens.
        ({"input": "x" * 8, "instructions": "y" * 4, "max_output_tokens": 2}, 3 + 2),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "z" * 8}]}]}, 6 + 7),
        ([1, 2], 1),
    ],
)
def test_estimate(body: object, expected: int) -> None:
    assert estimate_request_tokens(body, default_max_tokens=7, max_model_len=100) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input": "x" * 8}, 2),
        ({"input": ["x" * 8, "y" * 16]}, 2 + 4),
        ({"input": [1, 2, 3]}, 3),
        ({"input": [[1, 2, 3], [4, 5]]}, 3 + 2),
    ],
)
def test_estimate_embeddings_counts_each_input_and_no_output(body: object, expected: int) -> None:
    """/v1/embeddings: `input` is its prompts (texts or token ids), each costing no output tokens."""
    assert (
        estimate_request_tokens(body, default_max_tokens=0, max_model_len=100, path="/v1/embeddings")
        == expected
    )
