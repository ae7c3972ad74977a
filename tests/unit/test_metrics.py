"""The izh: metrics: vLLM's names, types, labels and bucket edges, fed through the StatLogger."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from izh.api.ops.buckets import REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS
from izh.api.ops.metrics import PrometheusStatLogger, build_1_2_5_buckets
from izh.engine_messages import SchedulerStats
from izh.frontend.stats import RequestMetrics, StatLogger

LABELS = 'engine="0",model_name="tiny"'


def _logger() -> PrometheusStatLogger:
    return PrometheusStatLogger(
        "tiny", max_model_len=100, cache_config={"block_size": "16", "num_gpu_blocks": "64"}
    )


def _text(stat_logger: PrometheusStatLogger) -> str:
    body, content_type = stat_logger.render()
    assert content_type.startswith("text/plain")
    return body.decode()


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{sample} not exposed"
    return float(match[1])


def _edges(text: str, name: str) -> list[str]:
    return re.findall(
        rf'^{re.escape(name)}_bucket{{engine="0",le="([^"]+)",model_name="tiny"}}', text, re.MULTILINE
    )


def test_is_a_stat_logger() -> None:
    assert isinstance(_logger(), StatLogger)


def test_every_metric_is_exposed_with_vllm_names_and_types() -> None:
    families = {f.name: f.type for f in text_string_to_metric_families(_text(_logger()))}
    expected = {
        "izh:time_to_first_token_seconds": "histogram",
        "izh:inter_token_latency_seconds": "histogram",
        "izh:time_per_output_token_seconds": "histogram",
        "izh:request_time_per_output_token_seconds": "histogram",
        "izh:e2e_request_latency_seconds": "histogram",
        "izh:request_queue_time_seconds": "histogram",
        "izh:request_prefill_time_seconds": "histogram",
        "izh:request_decode_time_seconds": "histogram",
        "izh:request_inference_time_seconds": "histogram",
        "izh:num_requests_running": "gauge",
        "izh:num_requests_waiting": "gauge",
        "izh:kv_cache_usage_perc": "gauge",
        "izh:prefix_cache_queries": "counter",
        "izh:prefix_cache_hits": "counter",
        "izh:request_success": "counter",
        "izh:prompt_tokens": "counter",
        "izh:generation_tokens": "counter",
        "izh:num_preemptions": "counter",
        "izh:iteration_tokens_total": "histogram",
        "izh:request_prompt_tokens": "histogram",
        "izh:request_generation_tokens": "histogram",
        "izh:request_params_n": "histogram",
        "izh:request_params_max_tokens": "histogram",
        "izh:cache_config_info": "gauge",
    }
    assert {name: families.get(name) for name in expected} == expected


def test_bucket_edges_match_vllm() -> None:
    text = _text(_logger())
    assert _edges(text, "izh:time_to_first_token_seconds") == [*map(str, TTFT_BUCKETS), "+Inf"]
    assert _edges(text, "izh:time_to_first_token_seconds")[:3] == ["0.001", "0.005", "0.01"]
    assert _edges(text, "izh:time_to_first_token_seconds")[-2] == "2560.0"
    assert _edges(text, "izh:inter_token_latency_seconds") == [*map(str, TOKEN_LATENCY_BUCKETS), "+Inf"]
    assert _edges(text, "izh:e2e_request_latency_seconds")[-2] == "7680.0"
    assert len(REQUEST_LATENCY_BUCKETS) == 21
    assert _edges(text, "izh:request_prompt_tokens") == [
        "1.0",
        "2.0",
        "5.0",
        "10.0",
        "20.0",
        "50.0",
        "100.0",
        "+Inf",
    ]
    assert _edges(text, "izh:request_params_n") == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    assert build_1_2_5_buckets(1000)[-3:] == [200, 500, 1000]
    assert 'izh:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0' in text
    assert (
        'izh:cache_config_info{block_size="16",engine="0",model_name="tiny",num_gpu_blocks="64"} 1.0' in text
    )
    for reason in ("stop", "length", "abort", "error"):
        assert (
            f'izh:request_success_total{{engine="0",finished_reason="{reason}",model_name="tiny"}} 0.0'
            in text
        )


def test_a_finished_request_fills_the_latency_histograms() -> None:
    stat_logger = _logger()
    stat_logger.on_api_request(3, "/v1/chat/completions")
    stat_logger.on_new_tokens("r", 1, now=10.5, is_first=True)
    stat_logger.on_new_tokens("r", 2, now=10.6, is_first=False)
    stat_logger.on_new_tokens("r", 1, now=10.9, is_first=False)
    stat_logger.on_request_finished(
        RequestMetrics(
            request_id="r",
            arrival_time=10.0,
            num_prompt_tokens=7,
            max_tokens=4,
            queued_ts=10.1,
            scheduled_ts=10.3,
            first_token_time=10.5,
            last_token_time=10.9,
            num_generation_tokens=4,
            num_cached_tokens=0,
            finish_reason="length",
        )
    )
    text = _text(stat_logger)
    assert _value(text, f"izh:prompt_tokens_total{{{LABELS}}}") == 7
    assert _value(text, f"izh:generation_tokens_total{{{LABELS}}}") == 4
    assert (
        _value(text, 'izh:request_success_total{engine="0",finished_reason="length",model_name="tiny"}') == 1
    )
    # TTFT 0.5 s lands in the le=0.5 bucket, not below it.
    assert _value(text, 'izh:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="tiny"}') == 0
    assert _value(text, 'izh:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="tiny"}') == 1
    assert _value(text, f"izh:inter_token_latency_seconds_count{{{LABELS}}}") == 2
    assert _value(text, f"izh:time_per_output_token_seconds_count{{{LABELS}}}") == 2
    assert abs(_value(text, f"izh:request_time_per_output_token_seconds_sum{{{LABELS}}}") - 0.4 / 3) < 1e-9
    assert abs(_value(text, f"izh:request_queue_time_seconds_sum{{{LABELS}}}") - 0.2) < 1e-9
    assert abs(_value(text, f"izh:request_prefill_time_seconds_sum{{{LABELS}}}") - 0.2) < 1e-9
    assert abs(_value(text, f"izh:request_decode_time_seconds_sum{{{LABELS}}}") - 0.4) < 1e-9
    assert abs(_value(text, f"izh:request_inference_time_seconds_sum{{{LABELS}}}") - 0.6) < 1e-9
    assert abs(_value(text, f"izh:e2e_request_latency_seconds_sum{{{LABELS}}}") - 0.9) < 1e-9
    assert _value(text, 'izh:request_params_n_bucket{engine="0",le="2.0",model_name="tiny"}') == 0
    assert _value(text, 'izh:request_params_n_bucket{engine="0",le="5.0",model_name="tiny"}') == 1
    assert _value(text, f"izh:request_params_max_tokens_sum{{{LABELS}}}") == 4
    chat_requests = 'izh:api_requests_total{endpoint="/v1/chat/completions",engine="0",model_name="tiny"}'
    assert _value(text, chat_requests) == 1


def test_a_scored_prompt_counts_its_prompt_tokens_and_prefill_but_no_first_token() -> None:
    stat_logger = _logger()
    stat_logger.on_request_finished(
        RequestMetrics(
            request_id="r",
            arrival_time=10.0,
            num_prompt_tokens=9,
            max_tokens=0,
            queued_ts=10.1,
            scheduled_ts=10.25,
            finished_time=10.75,
            finish_reason="length",
        )
    )
    text = _text(stat_logger)
    assert _value(text, f"izh:prompt_tokens_total{{{LABELS}}}") == 9
    assert _value(text, f"izh:request_prompt_tokens_sum{{{LABELS}}}") == 9
    assert _value(text, f"izh:time_to_first_token_seconds_count{{{LABELS}}}") == 0
    assert abs(_value(text, f"izh:request_prefill_time_seconds_sum{{{LABELS}}}") - 0.5) < 1e-9
    assert abs(_value(text, f"izh:request_queue_time_seconds_sum{{{LABELS}}}") - 0.15) < 1e-9
    assert abs(_value(text, f"izh:e2e_request_latency_seconds_sum{{{LABELS}}}") - 0.75) < 1e-9


def test_an_abort_before_the_first_token_counts_no_latency() -> None:
    stat_logger = _logger()
    stat_logger.on_request_finished(
        RequestMetrics(
            request_id="r", arrival_time=1.0, num_prompt_tokens=5, max_tokens=3, finish_reason="abort"
        )
    )
    text = _text(stat_logger)
    assert (
        _value(text, 'izh:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}') == 1
    )
    assert _value(text, f"izh:time_to_first_token_seconds_count{{{LABELS}}}") == 0
    assert _value(text, f"izh:prompt_tokens_total{{{LABELS}}}") == 0


def test_scheduler_stats_set_gauges_and_advance_counters() -> None:
    stat_logger = _logger()
    stat_logger.on_scheduler_stats(
        SchedulerStats(
            num_running=2,
            num_waiting=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions=1,
            iteration_tokens=[8, 300],
        )
    )
    stat_logger.on_scheduler_stats(
        SchedulerStats(prefix_cache_queries=160, prefix_cache_hits=48, num_preemptions=1)
    )
    text = _text(stat_logger)
    assert _value(text, f"izh:num_requests_running{{{LABELS}}}") == 0
    assert _value(text, f"izh:kv_cache_usage_perc{{{LABELS}}}") == 0
    assert _value(text, f"izh:prefix_cache_queries_total{{{LABELS}}}") == 160
    assert _value(text, f"izh:prefix_cache_hits_total{{{LABELS}}}") == 48
    assert _value(text, f"izh:num_preemptions_total{{{LABELS}}}") == 1
    assert _value(text, f"izh:iteration_tokens_total_count{{{LABELS}}}") == 2
    assert _value(text, 'izh:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="tiny"}') == 1


def _counter_samples(text: str) -> set[str]:
    return {
        line.rpartition(" ")[0]
        for line in text.splitlines()
        if line.startswith("izh:") and line.partition("{")[0].endswith("_total")
    }


def test_a_scrape_before_the_first_stats_lists_every_counter_the_stats_advance() -> None:
    """A client diffing two scrapes (izh bench, a dashboard's rate()) finds each engine counter in both,
    the speculative-decoding ones included, even when the first scrape comes before the core's first
    stats."""
    stat_logger = _logger()
    fresh = _counter_samples(_text(stat_logger))
    stat_logger.on_scheduler_stats(
        SchedulerStats(prefix_cache_queries=16, spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6)
    )
    text = _text(stat_logger)
    assert _counter_samples(text) == fresh
    assert _value(text, f"izh:spec_decode_num_drafts_total{{{LABELS}}}") == 2
    assert _value(text, f"izh:spec_decode_num_draft_tokens_total{{{LABELS}}}") == 6
    assert _value(text, f"izh:spec_decode_num_accepted_tokens_total{{{LABELS}}}") == 0


def test_each_logger_has_its_own_registry() -> None:
    first, second = _logger(), _logger()
    first.on_new_tokens("r", 5, now=1.0, is_first=True)
    assert _value(_text(second), f"izh:generation_tokens_total{{{LABELS}}}") == 0
