"""Prometheus text parsing and the `izh inspect` snapshot: one adapter per server's metric names.

izh's names are vLLM's with the ``izh:`` prefix; SGLang and llama.cpp have their own. Windowed quantiles
come from histogram bucket deltas between two scrapes, exactly as Prometheus's
``histogram_quantile(q, rate(x_bucket[w]))`` computes them. Pure stdlib: no httpx, no Rich.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

QUANTILES = (0.5, 0.95, 0.99)
BLOCK_FREE, BLOCK_CACHED, BLOCK_USED = 0, 1, 2
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Labels = tuple[tuple[str, str], ...]


# --- parsing ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


def _unescape(text: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], text)


def _parse_labels(text: str) -> Labels:
    labels: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _LABEL_RE.match(text, position)
        if match is None:
            raise ValueError(f"bad labels: {{{text}}}")
        labels.append((match.group(1), _unescape(match.group(2))))
        position = match.end()
    return tuple(labels)


def parse_sample_line(line: str) -> Sample:
    """``name{a="b"} 1.5 [timestamp]`` → Sample; raises ValueError."""
    if "{" in line:
        name, rest = line.split("{", 1)
        # The closing brace is the last one not inside a quoted value: scan from the right.
        labels_text, _, value_text = rest.rpartition("}")
        labels = _parse_labels(labels_text)
    else:
        name, _, value_text = line.partition(" ")
        labels = ()
    parts = value_text.split()
    if not parts:
        raise ValueError(f"no value: {line!r}")
    return Sample(name.strip(), labels, float(parts[0]))


def parse_prometheus_text(text: str) -> dict[str, list[Sample]]:
    """Samples by name (``_bucket``/``_sum``/``_count``/``_total`` suffixes kept); bad lines are skipped."""
    samples: dict[str, list[Sample]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            sample = parse_sample_line(line)
        except ValueError:
            continue
        samples.setdefault(sample.name, []).append(sample)
    return samples


@dataclass(slots=True)
class Scrape:
    """One /metrics scrape and when it was taken (monotonic seconds)."""

    samples: dict[str, list[Sample]]
    time_s: float

    @classmethod
    def from_text(cls, text: str, time_s: float) -> Scrape:
        return cls(parse_prometheus_text(text), time_s)

    def has(self, name: str) -> bool:
        return name in self.samples

    def total(self, name: str) -> float | None:
        """The sum over every label set (engines, models), or None when the metric is absent."""
        series = self.samples.get(name)
        return None if series is None else math.fsum(s.value for s in series)

    def mean(self, name: str) -> float | None:
        series = self.samples.get(name)
        return None if not series else math.fsum(s.value for s in series) / len(series)

    def by_label(self, name: str, key: str) -> dict[str, float]:
        values: dict[str, float] = {}
        for sample in self.samples.get(name, ()):
            label = sample.label(key)
            if label is not None:
                values[label] = values.get(label, 0.0) + sample.value
        return values

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """Cumulative (upper bound, count) pairs of a histogram, summed over label sets, sorted by bound."""
        counts: dict[float, float] = {}
        for sample in self.samples.get(f"{histogram}_bucket", ()):
            bound = sample.label("le")
            if bound is not None:
                upper = math.inf if bound in ("+Inf", "Inf", "inf") else float(bound)
                counts[upper] = counts.get(upper, 0.0) + sample.value
        return sorted(counts.items())


# --- histogram quantiles ------------------------------------------------------------------------------


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: linear interpolation inside the bucket that holds rank q·N.

    ``buckets`` are cumulative (upper bound, count) pairs sorted by bound, ending with +Inf. Returns None
    when there are no observations. A quantile in the +Inf bucket is the largest finite bound.
    """
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if index == 0 else buckets[index - 1]
    in_bucket = count - below
    return lower + (upper - lower) * ((rank - below) / in_bucket) if in_bucket > 0 else upper


def bucket_delta(
    current: Sequence[tuple[float, float]], previous: Sequence[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    """Bucket counts observed between two scrapes (a counter reset, e.g. a restart, keeps the current)."""
    if not previous:
        return list(current)
    before = dict(previous)
    delta = [(bound, count - before.get(bound, 0.0)) for bound, count in current]
    if any(count < 0 for _, count in delta):
        return list(current)
    return delta


# --- adapters -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Adapter:
    """Where one server family keeps each number; every field lists candidate names, first present wins."""

    server: str
    prefix: str
    kv_usage: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    prompt_tokens: tuple[str, ...] = ()
    generation_tokens: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()
    hit_rate_gauge: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    finish_label: str = "finished_reason"
    ttft: tuple[str, ...] = ()
    itl: tuple[str, ...] = ()
    e2e: tuple[str, ...] = ()
    prompt_tps_gauge: tuple[str, ...] = ()
    generation_tps_gauge: tuple[str, ...] = ()
    spec_draft_tokens: tuple[str, ...] = ()
    spec_accepted_tokens: tuple[str, ...] = ()


def _vllm_like(server: str, p: str) -> Adapter:
    return Adapter(
        server=server,
        prefix=p,
        kv_usage=(f"{p}kv_cache_usage_perc", f"{p}gpu_cache_usage_perc"),
        running=(f"{p}num_requests_running",),
        waiting=(f"{p}num_requests_waiting",),
        preemptions=(f"{p}num_preemptions_total",),
        prompt_tokens=(f"{p}prompt_tokens_total",),
        generation_tokens=(f"{p}generation_tokens_total",),
        prefix_queries=(f"{p}prefix_cache_queries_total", f"{p}gpu_prefix_cache_queries_total"),
        prefix_hits=(f"{p}prefix_cache_hits_total", f"{p}gpu_prefix_cache_hits_total"),
        finished=(f"{p}request_success_total",),
        ttft=(f"{p}time_to_first_token_seconds",),
        itl=(f"{p}inter_token_latency_seconds", f"{p}time_per_output_token_seconds"),
        e2e=(f"{p}e2e_request_latency_seconds",),
        spec_draft_tokens=(f"{p}spec_decode_num_draft_tokens_total",),
        spec_accepted_tokens=(f"{p}spec_decode_num_accepted_tokens_total",),
    )


ADAPTERS: dict[str, Adapter] = {
    "izh": _vllm_like("izh", "izh:"),
    "vllm": _vllm_like("vllm", "vllm:"),
    "sglang": Adapter(
        server="sglang",
        prefix="sglang:",
        kv_usage=("sglang:token_usage",),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        preemptions=("sglang:num_retracted_reqs_total", "sglang:num_retracted_requests_total"),
        prompt_tokens=("sglang:prompt_tokens_total",),
        generation_tokens=("sglang:generation_tokens_total",),
        hit_rate_gauge=("sglang:cache_hit_rate",),
        ttft=("sglang:time_to_first_token_seconds",),
        itl=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        e2e=("sglang:e2e_request_latency_seconds",),
        generation_tps_gauge=("sglang:gen_throughput",),
    ),
    "llamacpp": Adapter(
        server="llamacpp",
        prefix="llamacpp:",
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        prompt_tokens=("llamacpp:prompt_tokens_total",),
        generation_tokens=("llamacpp:tokens_predicted_total",),
        prompt_tps_gauge=("llamacpp:prompt_tokens_seconds",),
        generation_tps_gauge=("llamacpp:predicted_tokens_seconds",),
    ),
}


def detect_adapter(scrape: Scrape) -> Adapter | None:
    """The adapter whose prefix most metric names carry (izh before vLLM on a tie)."""
    counts = {
        key: sum(1 for name in scrape.samples if name.startswith(a.prefix)) for key, a in ADAPTERS.items()
    }
    best = max(counts, key=lambda key: counts[key])
    return ADAPTERS[best] if counts[best] else None


def _first(scrape: Scrape, names: Iterable[str]) -> str | None:
    return next((name for name in names if scrape.has(name)), None)


# --- the snapshot -------------------------------------------------------------------------------------


@dataclass(slots=True)
class BlockCounts:
    used: int
    cached: int
    free: int

    @property
    def total(self) -> int:
        return self.used + self.cached + self.free

    @classmethod
    def of(cls, states: Sequence[int]) -> BlockCounts:
        used = sum(1 for s in states if s == BLOCK_USED)
        cached = sum(1 for s in states if s == BLOCK_CACHED)
        return cls(used, cached, len(states) - used - cached)


@dataclass(slots=True)
class EngineRow:
    """One engine core as izh's /v1/izh/stats lists it under ``engines``."""

    engine: int
    alive: bool
    pid: int | None = None
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    dead_reason: str | None = None

    @classmethod
    def parse(cls, entry: Any) -> EngineRow | None:
        if not isinstance(entry, dict) or not isinstance(entry.get("engine"), int):
            return None

        def number(key: str) -> float | None:
            value = entry.get(key)
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

        pid, reason = entry.get("pid"), entry.get("dead_reason")
        return cls(
            engine=entry["engine"],
            alive=entry.get("alive") is not False,
            pid=pid if isinstance(pid, int) else None,
            kv_cache_usage=number("kv_cache_usage"),
            running=number("num_running"),
            waiting=number("num_waiting"),
            dead_reason=reason if isinstance(reason, str) else None,
        )


@dataclass(slots=True)
class Snapshot:
    """What the dashboard shows at one moment; ``to_dict`` is the ``--once --json`` output."""

    url: str
    up: bool
    server: str | None = None
    error: str | None = None
    health: str | None = None
    uptime_s: float | None = None
    seen_up_s: float | None = None
    """How long this inspector has seen the server up (when the server tells no uptime)."""
    model: str | None = None
    draining: bool | None = None
    in_flight: float | None = None
    window_s: float | None = None
    kv_cache_usage: float | None = None
    kv_blocks: BlockCounts | None = None
    kv_block_states: list[int] = field(default_factory=list)
    prefix_cache_hit_rate: float | None = None
    prefix_cache_hit_rate_lifetime: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    preemptions_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    spec_acceptance_rate: float | None = None
    """Speculative decoding: accepted / draft tokens over the window (None: no draft verified in it)."""
    spec_acceptance_rate_lifetime: float | None = None
    latency_window: dict[str, dict[str, float | None]] = field(default_factory=dict)
    latency_lifetime: dict[str, dict[str, float | None]] = field(default_factory=dict)
    finish_reasons: dict[str, float] = field(default_factory=dict)
    finish_reasons_window: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    """Paths that did not answer within the timeout (the snapshot shows what the others said)."""
    stats_age_s: float | None = None
    """How old izh's engine stats were when the server answered (it publishes them; see /v1/izh/stats)."""
    engines: list[EngineRow] = field(default_factory=list)
    """izh's engine cores, one row each (`izh serve --data-parallel-size N`: N of them)."""

    def to_dict(self, with_block_states: bool = False) -> dict[str, Any]:
        data = {
            name: getattr(self, name)
            for name in self.__slots__
            if name not in ("kv_blocks", "kv_block_states", "engines")
        }
        data["engines"] = [asdict(row) for row in self.engines]
        blocks = self.kv_blocks
        data["kv_blocks"] = None if blocks is None else {
            "used": blocks.used, "cached": blocks.cached, "free": blocks.free, "total": blocks.total,
        }  # fmt: skip
        if with_block_states:
            data["kv_block_states"] = self.kv_block_states
        return data


def quantiles(buckets: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    return {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}


def _rate(current: float | None, previous: float | None, seconds: float | None) -> float | None:
    if current is None or previous is None or not seconds or seconds <= 0:
        return None
    # A counter that went down was reset (a restart): all of its current value is new.
    return (current - previous) / seconds if current >= previous else current / seconds


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def build_snapshot(url: str, adapter: Adapter, current: Scrape, previous: Scrape | None) -> Snapshot:
    """The metrics part of a snapshot: gauges from ``current``, rates and windows against ``previous``."""
    snap = Snapshot(url=url, up=True, server=adapter.server)
    window = current.time_s - previous.time_s if previous is not None else None
    snap.window_s = window

    def now(names: tuple[str, ...], mean: bool = False) -> float | None:
        name = _first(current, names)
        if name is None:
            return None
        return current.mean(name) if mean else current.total(name)

    def before(names: tuple[str, ...]) -> float | None:
        name = _first(current, names)
        return previous.total(name) if previous is not None and name is not None else None

    snap.kv_cache_usage = now(adapter.kv_usage, mean=True)
    snap.running, snap.waiting = now(adapter.running), now(adapter.waiting)
    snap.preemptions_total = now(adapter.preemptions)
    snap.preemptions_per_s = _rate(snap.preemptions_total, before(adapter.preemptions), window)
    snap.prompt_tokens_total, snap.generation_tokens_total = (
        now(adapter.prompt_tokens),
        now(adapter.generation_tokens),
    )
    snap.prompt_tokens_per_s = _rate(snap.prompt_tokens_total, before(adapter.prompt_tokens), window)
    snap.generation_tokens_per_s = _rate(
        snap.generation_tokens_total, before(adapter.generation_tokens), window
    )
    if snap.prompt_tokens_per_s is None:
        snap.prompt_tokens_per_s = now(adapter.prompt_tps_gauge, mean=True)
    if snap.generation_tokens_per_s is None:
        snap.generation_tokens_per_s = now(adapter.generation_tps_gauge)
    _hit_rates(snap, adapter, current, previous)
    drafted, accepted = now(adapter.spec_draft_tokens), now(adapter.spec_accepted_tokens)
    snap.spec_acceptance_rate_lifetime = _ratio(accepted, drafted)
    drafted_before, accepted_before = before(adapter.spec_draft_tokens), before(adapter.spec_accepted_tokens)
    if (
        drafted is not None
        and accepted is not None
        and drafted_before is not None
        and accepted_before is not None
    ):
        snap.spec_acceptance_rate = _ratio(accepted - accepted_before, drafted - drafted_before)
    _latencies(snap, adapter, current, previous)
    _finish_reasons(snap, adapter, current, previous)
    return snap


def _hit_rates(snap: Snapshot, adapter: Adapter, current: Scrape, previous: Scrape | None) -> None:
    hits_name, queries_name = _first(current, adapter.prefix_hits), _first(current, adapter.prefix_queries)
    if hits_name and queries_name:
        hits, queries = current.total(hits_name), current.total(queries_name)
        snap.prefix_cache_hit_rate_lifetime = _ratio(hits, queries)
        if previous is not None and previous.has(hits_name) and previous.has(queries_name):
            delta_hits = (hits or 0.0) - (previous.total(hits_name) or 0.0)
            delta_queries = (queries or 0.0) - (previous.total(queries_name) or 0.0)
            snap.prefix_cache_hit_rate = delta_hits / delta_queries if delta_queries > 0 else None
        return
    gauge = _first(current, adapter.hit_rate_gauge)
    if gauge:
        snap.prefix_cache_hit_rate = snap.prefix_cache_hit_rate_lifetime = current.mean(gauge)


def _latencies(snap: Snapshot, adapter: Adapter, current: Scrape, previous: Scrape | None) -> None:
    for key, names in (("ttft", adapter.ttft), ("itl", adapter.itl), ("e2e", adapter.e2e)):
        name = _first(current, tuple(f"{n}_bucket" for n in names))
        if name is None:
            continue
        histogram = name.removesuffix("_bucket")
        buckets = current.buckets(histogram)
        snap.latency_lifetime[key] = quantiles(buckets)
        if previous is not None:
            snap.latency_window[key] = quantiles(bucket_delta(buckets, previous.buckets(histogram)))


def _finish_reasons(snap: Snapshot, adapter: Adapter, current: Scrape, previous: Scrape | None) -> None:
    name = _first(current, adapter.finished)
    if name is None:
        return
    snap.finish_reasons = current.by_label(name, adapter.finish_label)
    if previous is not None:
        before = previous.by_label(name, adapter.finish_label)
        snap.finish_reasons_window = {
            reason: count - before.get(reason, 0.0) for reason, count in snap.finish_reasons.items()
        }


# --- izh's stats endpoint -----------------------------------------------------------------------------


def apply_izh_stats(snap: Snapshot, stats: dict[str, Any]) -> None:
    """Engine detail from ``GET /v1/izh/stats``: the block map, and scheduler numbers /metrics lacks.

    Accepts the scheduler stats at the top level or under ``"scheduler"``.
    """
    nested = stats.get("scheduler")
    scheduler: dict[str, Any] = nested if isinstance(nested, dict) else stats
    states = stats.get("kv_block_states")
    if isinstance(states, list) and all(isinstance(s, int) for s in states):
        snap.kv_block_states = states
        snap.kv_blocks = BlockCounts.of(states)
    for attr, key in (
        ("running", "num_running"),
        ("waiting", "num_waiting"),
        ("preemptions_total", "num_preemptions"),
    ):
        if getattr(snap, attr) is None and isinstance(scheduler.get(key), int | float):
            setattr(snap, attr, float(scheduler[key]))
    if snap.kv_cache_usage is None and isinstance(scheduler.get("kv_cache_usage"), int | float):
        snap.kv_cache_usage = float(scheduler["kv_cache_usage"])
    if snap.prefix_cache_hit_rate_lifetime is None:
        snap.prefix_cache_hit_rate_lifetime = _ratio(
            scheduler.get("prefix_cache_hits"), scheduler.get("prefix_cache_queries")
        )
    uptime = stats.get("uptime_s", scheduler.get("uptime_s"))
    if isinstance(uptime, int | float):
        snap.uptime_s = float(uptime)
    if isinstance(stats.get("model"), str):
        snap.model = stats["model"]
    if isinstance(stats.get("draining"), bool):
        snap.draining = stats["draining"]
    if isinstance(stats.get("num_requests_in_flight"), int | float):
        snap.in_flight = float(stats["num_requests_in_flight"])
    if isinstance(stats.get("stats_age_s"), int | float):
        snap.stats_age_s = float(stats["stats_age_s"])
    engines = stats.get("engines")
    if isinstance(engines, list):
        snap.engines = [row for row in map(EngineRow.parse, engines) if row is not None]


def uptime_from_metrics(scrape: Scrape, wall_now: float) -> float | None:
    """From prometheus-client's ``process_start_time_seconds`` (vLLM, SGLang expose it)."""
    start = scrape.total("process_start_time_seconds")
    return wall_now - start if start else None
