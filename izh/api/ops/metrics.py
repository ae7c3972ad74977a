"""Prometheus metrics: the `izh:` mirror of vLLM's `vllm:` names, types, labels and buckets.

Same names (after the prefix), labels and bucket edges as vLLM's `vllm:` metrics, so vLLM's Grafana
dashboard and the vllm-htop / vllm-top monitors work on izh by swapping the prefix. Each app owns
its own CollectorRegistry, so several apps (tests) can live in one process.

Several API processes (`izh serve --api-server-count N`) use prometheus-client's multiprocess mode:
the supervisor points PROMETHEUS_MULTIPROC_DIR at a fresh directory before it starts them, each
process writes its values there, and /metrics, in whichever process answers, merges every process's
files (counters and histograms summed). The engine-side metrics (scheduler gauges, prefix-cache and
preemption counters, iteration tokens) come from the cores' stats, which every API process receives:
only API process 0 (`engine_metrics`) records them, so they count once per core, labelled with the
core's index (`engine`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from izh.api.ops import buckets
from izh.engine_messages import SchedulerStats
from izh.frontend.stats import RequestMetrics

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")
LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


API_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
"""The routes izh:api_requests_total counts, each exported from the start."""


class PrometheusStatLogger:
    """The StatLogger that feeds the `izh:` metrics, and the text /metrics serves.

    Called from the event loop only (AsyncLLM's output handler), so no locking is needed beyond
    prometheus-client's own.
    """

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int,
        cache_config: dict[str, str] | None = None,
        engine_index: int = 0,
        multiprocess: bool = False,
        engine_metrics: bool = True,
        max_loras: int = 0,
    ) -> None:
        """`multiprocess`: render every API process's values (prometheus-client's multiprocess
        mode, set up by the supervisor); `engine_metrics`: record the cores' scheduler stats (one
        API process of several does)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess
        self.engine_metrics = engine_metrics
        self._model_name = model_name
        self.max_loras = max_loras
        self._labels = (model_name, str(engine_index))
        self._last_token_time: dict[str, float] = {}
        self._last_cumulative: dict[tuple[int, str], int] = {}
        self._engines: dict[int, _EngineMetrics] = {}
        self._make_latency_metrics()
        self._make_request_metrics(max_model_len)
        self._make_scheduler_metrics()
        self._make_info(cache_config or {})
        self._make_lora_metrics()

    # --- construction ---------------------------------------------------------------------------

    def _histogram(self, name: str, doc: str, buckets: Any) -> Any:
        metric = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
        return metric.labels(*self._labels)

    def _counter(self, name: str, doc: str) -> Any:
        return self._counter_family(name, doc).labels(*self._labels)

    def _gauge_family(self, name: str, doc: str, labels: tuple[str, ...] = LABELS) -> Gauge:
        # One process writes each gauge; "mostrecent" shows its value without a pid label.
        return Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="mostrecent")

    def _counter_family(self, name: str, doc: str, labels: tuple[str, ...] = LABELS) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _make_latency_metrics(self) -> None:
        self.ttft = self._histogram(
            "izh:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets.TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "izh:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets.TOKEN_LATENCY_BUCKETS,
        )
        # Deprecated alias of inter_token_latency_seconds, kept because dashboards still plot it.
        self.tpot_alias = self._histogram(
            "izh:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (deprecated: use inter_token_latency_seconds).",
            buckets.TOKEN_LATENCY_BUCKETS,
        )
        self.request_tpot = self._histogram(
            "izh:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets.TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = self._histogram(
            "izh:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets.REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = self._histogram(
            "izh:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase.",
            buckets.REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = self._histogram(
            "izh:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase.",
            buckets.REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = self._histogram(
            "izh:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase.",
            buckets.REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = self._histogram(
            "izh:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            buckets.REQUEST_LATENCY_BUCKETS,
        )

    def _make_request_metrics(self, max_model_len: int) -> None:
        size_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.prompt_tokens = self._counter("izh:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(
            "izh:generation_tokens", "Number of generation tokens processed."
        )
        success = self._counter_family(
            "izh:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
        )
        # Every reason exists from the start, so rate() over a reason never sees a missing series.
        self.request_success = {reason: success.labels(*self._labels, reason) for reason in FINISH_REASONS}
        self.request_prompt_tokens = self._histogram(
            "izh:request_prompt_tokens", "Number of prefill tokens processed.", size_buckets
        )
        self.request_generation_tokens = self._histogram(
            "izh:request_generation_tokens", "Number of generation tokens processed.", size_buckets
        )
        self.request_params_n = self._histogram(
            "izh:request_params_n", "Histogram of the n request parameter.", buckets.N_BUCKETS
        )
        # izh's own (vLLM has none): admitted requests by route.
        self.api_requests = self._counter_family(
            "izh:api_requests",
            "Count of admitted requests by API endpoint (its path: /v1/chat/completions, /v1/completions, "
            "/v1/responses, /v1/embeddings).",
            (*LABELS, "endpoint"),
        )
        for endpoint in API_ENDPOINTS:  # every series exists from the start, at 0
            self.api_requests.labels(*self._labels, endpoint)
        self.request_params_max_tokens = self._histogram(
            "izh:request_params_max_tokens", "Histogram of the max_tokens request parameter.", size_buckets
        )

    def _make_scheduler_metrics(self) -> None:
        """The families; each core's series (label `engine`) on its first stats (`_engine`)."""
        self._num_running = self._gauge_family(
            "izh:num_requests_running", "Number of requests in model execution batches."
        )
        self._num_waiting = self._gauge_family(
            "izh:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self._kv_cache_usage = self._gauge_family(
            "izh:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self._prefix_cache_queries = self._counter_family(
            "izh:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_cache_hits = self._counter_family(
            "izh:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._num_preemptions = self._counter_family(
            "izh:num_preemptions", "Cumulative number of preemption from the engine."
        )
        # vLLM's speculative decoding counters (vllm/v1/spec_decode/metrics.py).
        self._spec_decode = {
            key: self._counter_family(f"izh:spec_decode_{key}", help_text)
            for key, help_text in (
                ("num_drafts", "Number of spec decoding drafts."),
                ("num_draft_tokens", "Number of draft tokens."),
                ("num_accepted_tokens", "Number of accepted tokens."),
            )
        }
        self._spec_decode_per_pos = self._counter_family(
            "izh:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            (*LABELS, "position"),
        )
        # vLLM's legacy quirk: a histogram whose name already ends in _total.
        self._iteration_tokens = Histogram(
            "izh:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            LABELS,
            buckets=buckets.ITERATION_TOKEN_BUCKETS,
            registry=self.registry,
        )
        # izh's own: data-parallel routing (izh.frontend.dp_router), by core and kind.
        self._dp_routed = self._counter_family(
            "izh:dp_routed_requests",
            "Requests routed to a data-parallel engine core, by route: affinity (to the core holding its "
            "prompt prefix), rebalanced (that core was too busy or dead), load (no known prefix).",
            (*LABELS, "route"),
        )
        if self.engine_metrics:
            self._engine(0)  # a single core's series exist from the start

    def _engine(self, index: int) -> _EngineMetrics:
        metrics = self._engines.get(index)
        if metrics is None:
            labels = (self._model_name, str(index))
            metrics = _EngineMetrics(
                num_running=self._num_running.labels(*labels),
                num_waiting=self._num_waiting.labels(*labels),
                kv_cache_usage=self._kv_cache_usage.labels(*labels),
                prefix_cache_queries=self._prefix_cache_queries.labels(*labels),
                prefix_cache_hits=self._prefix_cache_hits.labels(*labels),
                num_preemptions=self._num_preemptions.labels(*labels),
                iteration_tokens=self._iteration_tokens.labels(*labels),
            )
            # The speculative-decoding counters exist from the start too (at 0 without it), so a
            # scrape before the core's first stats already lists every counter a later one will.
            for counter in self._spec_decode.values():
                counter.labels(*labels)
            self._engines[index] = metrics
        return metrics

    def _make_lora_metrics(self) -> None:
        """vLLM's lora_requests_info (with LoRA on), and izh's own per-adapter request and token counts."""
        self.lora_requests_info: Gauge | None = None
        if self.max_loras:
            # vLLM's: one series, its labels the adapters of the running and waiting requests
            # (comma-separated), its value the time of the latest update.
            self.lora_requests_info = Gauge(
                "izh:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
                multiprocess_mode="mostrecent",
            )
            self.lora_requests_info.labels(str(self.max_loras), "", "").set(time.time())
        self.lora_requests = self._counter_family(
            "izh:lora_requests",
            "Count of finished requests by LoRA adapter (lora_name) and finish reason.",
            (*LABELS, "lora_name", "finished_reason"),
        )
        self.lora_prompt_tokens = self._counter_family(
            "izh:lora_prompt_tokens",
            "Prompt tokens of finished requests, by LoRA adapter.",
            (*LABELS, "lora_name"),
        )
        self.lora_generation_tokens = self._counter_family(
            "izh:lora_generation_tokens",
            "Generated tokens of finished requests, by LoRA adapter.",
            (*LABELS, "lora_name"),
        )
        self._lora_info_labels = (str(self.max_loras), "", "")

    def _make_info(self, cache_config: dict[str, str]) -> None:
        names = sorted(cache_config)
        info = self._gauge_family(
            "izh:cache_config_info", "Information of the KV cache config.", (*LABELS, *names)
        )
        info.labels(*self._labels, *(str(cache_config[name]) for name in names)).set(1)

    def on_route(self, engine: int, route: str) -> None:
        """A request was routed to data-parallel core `engine` (izh.frontend.dp_router's kinds)."""
        self._dp_routed.labels(self._model_name, str(engine), route).inc()

    def on_api_request(self, n: int, endpoint: str) -> None:
        """One admitted generation request to `endpoint` (its path) asking for `n` samples per prompt.

        Observed here, not per finished request: the engine only sees the n = 1 children.
        """
        self.request_params_n.observe(n)
        self.count_request(endpoint)

    def count_request(self, endpoint: str) -> None:
        """One admitted API request to `endpoint` (its path), with no sampling parameters to observe."""
        self.api_requests.labels(*self._labels, endpoint).inc()

    # --- the StatLogger protocol -------------------------------------------------------------------

    def on_new_tokens(self, request_id: str, num_tokens: int, now: float, is_first: bool) -> None:
        """Count generated tokens; one inter-token latency sample per event after the first."""
        self.generation_tokens.inc(num_tokens)
        last = self._last_token_time.get(request_id)
        if not is_first and last is not None:
            self.itl.observe(now - last)
            self.tpot_alias.observe(now - last)
        self._last_token_time[request_id] = now

    def on_request_finished(self, m: RequestMetrics) -> None:
        """Per-request latencies and sizes from a finished request's RequestMetrics."""
        self._last_token_time.pop(m.request_id, None)
        reason = m.finish_reason if m.finish_reason in self.request_success else "error"
        self.request_success[reason].inc()
        if m.lora_name is not None:
            self.lora_requests.labels(*self._labels, m.lora_name, reason).inc()
            self.lora_prompt_tokens.labels(*self._labels, m.lora_name).inc(m.num_prompt_tokens)
            self.lora_generation_tokens.labels(*self._labels, m.lora_name).inc(m.num_generation_tokens)
        if m.max_tokens is not None:
            self.request_params_max_tokens.observe(m.max_tokens)
        # A prompt scored with max_tokens 0 finishes "length" once its prefill is done, with no token.
        prompt_only = m.max_tokens == 0 and m.finish_reason == "length"
        if not m.first_token_time and not prompt_only:
            return  # never reached its first token: no prefill happened, no latencies to report
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.request_prompt_tokens.observe(m.num_prompt_tokens)
        self.request_generation_tokens.observe(m.num_generation_tokens)
        if prompt_only:
            self._observe_prompt_only_latencies(m)
        else:
            self._observe_latencies(m)

    def _observe_prompt_only_latencies(self, m: RequestMetrics) -> None:
        """No first token, so no TTFT, decode or per-token times: its prefill ends at its finish."""
        end = m.finished_time or m.arrival_time
        self.e2e.observe(max(end - m.arrival_time, 0.0))
        if m.scheduled_ts:
            self.prefill_time.observe(max(end - m.scheduled_ts, 0.0))
            self.inference_time.observe(max(end - m.scheduled_ts, 0.0))
            if m.queued_ts:
                self.queue_time.observe(max(m.scheduled_ts - m.queued_ts, 0.0))

    def _observe_latencies(self, m: RequestMetrics) -> None:
        self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
        last = m.last_token_time or m.first_token_time
        self.e2e.observe(max(last - m.arrival_time, 0.0))
        self.decode_time.observe(max(last - m.first_token_time, 0.0))
        if m.num_generation_tokens > 1:
            self.request_tpot.observe((last - m.first_token_time) / (m.num_generation_tokens - 1))
        # Engine timestamps share the monotonic clock with the frontend's (one machine).
        if m.scheduled_ts:
            self.prefill_time.observe(max(m.first_token_time - m.scheduled_ts, 0.0))
            self.inference_time.observe(max(last - m.scheduled_ts, 0.0))
            if m.queued_ts:
                self.queue_time.observe(max(m.scheduled_ts - m.queued_ts, 0.0))

    def on_scheduler_stats(self, s: SchedulerStats) -> None:
        """Gauges from the latest stats of core `s.engine_index`; counters advance by the growth of
        the cumulative values."""
        if not self.engine_metrics:
            return
        index = s.engine_index
        m = self._engine(index)
        m.num_running.set(s.num_running)
        m.num_waiting.set(s.num_waiting)
        m.kv_cache_usage.set(s.kv_cache_usage)
        self._advance(index, "prefix_cache_queries", s.prefix_cache_queries, m.prefix_cache_queries)
        self._advance(index, "prefix_cache_hits", s.prefix_cache_hits, m.prefix_cache_hits)
        self._advance(index, "num_preemptions", s.num_preemptions, m.num_preemptions)
        for num_tokens in s.iteration_tokens:
            m.iteration_tokens.observe(num_tokens)
        engine_labels = (self._model_name, str(index))
        for key, counter in self._spec_decode.items():
            cumulative = getattr(s, f"spec_decode_{key}")
            self._advance(index, f"spec_decode_{key}", cumulative, counter.labels(*engine_labels))
        for position, accepted in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos = self._spec_decode_per_pos.labels(*engine_labels, str(position))
            self._advance(index, f"spec_decode_per_pos_{position}", accepted, per_pos)
        if self.lora_requests_info is not None:
            labels = (
                str(self.max_loras),
                ",".join(s.waiting_lora_adapters),
                ",".join(s.running_lora_adapters),
            )
            if labels != self._lora_info_labels:
                self.lora_requests_info.remove(*self._lora_info_labels)
                self._lora_info_labels = labels
            self.lora_requests_info.labels(*labels).set(time.time())

    def _advance(self, index: int, key: str, cumulative: int, counter: Any) -> None:
        last = self._last_cumulative.get((index, key), 0)
        # A restarted core counts from zero again: its whole count is new.
        counter.inc(cumulative - last if cumulative >= last else cumulative)
        self._last_cumulative[(index, key)] = cumulative

    # --- exposition -------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type: this app's metrics, or (multiprocess) every
        API process's merged."""
        if not self.multiprocess:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


@dataclass(slots=True)
class _EngineMetrics:
    """One core's series of the engine-side metrics."""

    num_running: Any
    num_waiting: Any
    kv_cache_usage: Any
    prefix_cache_queries: Any
    prefix_cache_hits: Any
    num_preemptions: Any
    iteration_tokens: Any
