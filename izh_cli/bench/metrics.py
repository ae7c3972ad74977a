"""Per-request timings and the serving metrics computed from them, with `vllm bench serve`'s definitions.

Definitions (times are client-side, from the moment the request is sent):
- TTFT: until the first chunk that carries generated text.
- ITL: the gaps between consecutive chunks that carry text (one sample per gap, pooled over requests).
- E2EL (latency): until the last chunk that carries a choice.
- TPOT (excl. the 1st token): ``(latency - ttft) / (output_tokens - 1)``, for requests with more than one
  output token; output tokens come from the server's usage.
- Throughputs divide by the benchmark duration (first request sent to last request done); goodput counts
  the successful requests that meet every SLO (a one-token request has a TPOT of 0 there).
- Peak output tokens/s: the most text chunks in one 1-second bucket after the first request started;
  peak concurrency: the most requests in flight at once (exact, over half-open intervals).
Percentiles interpolate linearly between order statistics (numpy's default), so numbers compare.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el", "e2el": "e2el"}
SLO_UNITS_MS = {"ms": 1.0, "s": 1000.0, "": 1.0}
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90.0, 99.0)
_SLO_RE = re.compile(r"^\s*([a-z0-9]+)\s*[=:]\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


@dataclass(slots=True)
class RequestRecord:
    """One request's measurements; times in seconds, ``start_s`` relative to the start of its run."""

    index: int
    start_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    num_chunks: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.latency_s is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "start_s": _round(self.start_s),
            "ttft_s": _round(self.ttft_s),
            "itl_s": [_round(gap) for gap in self.itl_s],
            "latency_s": _round(self.latency_s),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "num_chunks": self.num_chunks,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(
            index=int(data["index"]),
            start_s=float(data.get("start_s") or 0.0),
            ttft_s=data.get("ttft_s"),
            itl_s=list(data.get("itl_s") or []),
            latency_s=data.get("latency_s"),
            prompt_tokens=data.get("prompt_tokens"),
            output_tokens=data.get("output_tokens"),
            num_chunks=int(data.get("num_chunks") or 0),
            error=data.get("error"),
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


# --- statistics ------------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of already sorted values, interpolating linearly (numpy's default)."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * p / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of one latency metric, in milliseconds (all zero when there are no samples, like vLLM)."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, values_s: Iterable[float], percentiles: Sequence[float] = PERCENTILES) -> Distribution:
        values = sorted(v * 1000.0 for v in values_s)
        if not values:
            return cls(0, 0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
        mean = math.fsum(values) / len(values)
        variance = math.fsum((v - mean) ** 2 for v in values) / len(values)  # population std, as numpy
        return cls(
            count=len(values),
            mean=mean,
            median=percentile(values, 50.0),
            std=math.sqrt(variance),
            percentiles={p: percentile(values, p) for p in percentiles},
        )


def percentile_label(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


# --- SLOs ------------------------------------------------------------------------------------------


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms,e2e=2s`` → ``{"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}`` (milliseconds).

    A bare number is milliseconds. Raises ValueError naming the bad part.
    """
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        match = _SLO_RE.match(part.lower())
        if match is None or match.group(1) not in SLO_KEYS:
            raise ValueError(f"bad SLO {part.strip()!r}: expected ttft|tpot|e2e=<number>[ms|s]")
        key, number, unit = SLO_KEYS[match.group(1)], float(match.group(2)), match.group(3) or ""
        slo[key] = number * SLO_UNITS_MS[unit]
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds); TPOT is 0 for a one-token output."""
    assert record.ttft_s is not None and record.latency_s is not None
    values_ms = {
        "ttft": record.ttft_s * 1000.0,
        "tpot": (record_tpot_s(record) or 0.0) * 1000.0,
        "e2el": record.latency_s * 1000.0,
    }
    return all(values_ms[key] <= limit for key, limit in slo.items())


def record_tpot_s(record: RequestRecord) -> float | None:
    """``(latency - ttft) / (output_tokens - 1)``, or None for outputs of one token or fewer."""
    if record.ttft_s is None or record.latency_s is None or not record.output_tokens:
        return None
    if record.output_tokens <= 1:
        return None
    return (record.latency_s - record.ttft_s) / (record.output_tokens - 1)


# --- peaks -----------------------------------------------------------------------------------------


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """The most successful requests in flight at once; an end at the same instant as a start comes first."""
    events: list[tuple[float, int]] = []
    for record in records:
        if record.ok and record.latency_s is not None:
            events.append((record.start_s, 1))
            events.append((record.start_s + record.latency_s, -1))
    events.sort()
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_tokens_per_s(records: Sequence[RequestRecord]) -> float:
    """The most text chunks received in one 1-second bucket, buckets counted from the first start."""
    done = [r for r in records if r.ok and r.ttft_s is not None]
    if not done:
        return 0.0
    origin = min(r.start_s for r in done)
    buckets: Counter[int] = Counter()
    for record in done:
        assert record.ttft_s is not None
        t = record.start_s + record.ttft_s
        buckets[int(t - origin)] += 1
        for gap in record.itl_s:
            t += gap
            buckets[int(t - origin)] += 1
    return float(max(buckets.values()))


# --- the whole run ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    """One run's results; ``to_dict`` uses `vllm bench serve`'s JSON keys."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latencies: dict[str, Distribution]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name, dist in self.latencies.items():
            data[f"mean_{name}_ms"] = dist.mean
            data[f"median_{name}_ms"] = dist.median
            data[f"std_{name}_ms"] = dist.std
            for p, value in dist.percentiles.items():
                data[f"{percentile_label(p)}_{name}_ms"] = value
        return data


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> BenchMetrics:
    """The run's metrics from its records; failed requests count only in ``failed``."""
    done = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    total_input = sum(r.prompt_tokens or 0 for r in done)
    total_output = sum(r.output_tokens or 0 for r in done)
    tpots = [t for t in (record_tpot_s(r) for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itl_s]
    latencies = {
        "ttft": Distribution.of((r.ttft_s for r in done if r.ttft_s is not None), percentiles),
        "tpot": Distribution.of(tpots, percentiles),
        "itl": Distribution.of(itls, percentiles),
        "e2el": Distribution.of((r.latency_s for r in done if r.latency_s is not None), percentiles),
    }
    goodput = sum(1 for r in done if meets_slo(r, slo)) / duration if slo else None
    return BenchMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration,
        request_goodput=goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_output_tokens_per_s(done),
        max_concurrent_requests=peak_concurrency(done),
        latencies=latencies,
    )


def error_summary(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by kind (status code and message), most frequent first."""
    kinds = Counter(r.error or "no tokens received" for r in records if not r.ok)
    return dict(kinds.most_common())
