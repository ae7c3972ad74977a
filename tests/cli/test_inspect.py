"""`izh inspect`: Prometheus text parsing, adapters for izh/vLLM/SGLang/llama.cpp, windowed histogram
quantiles, izh's stats, and `--once --json` against the fake server."""

from __future__ import annotations

import bisect
import json
import math
import random
import socket
import subprocess
import sys
from typing import Any

import httpx
import pytest
import typer
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from typer.testing import CliRunner

from izh_cli import inspect_cmd
from izh_cli.inspect_metrics import (
    BlockCounts,
    Scrape,
    Snapshot,
    apply_izh_stats,
    bucket_delta,
    build_snapshot,
    detect_adapter,
    histogram_quantile,
    parse_prometheus_text,
    uptime_from_metrics,
)
from tests.cli.fake_openai_server import FakeConfig, fake_server

app = typer.Typer()
app.command("inspect")(inspect_cmd.inspect)


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, env={"COLUMNS": "140"})


# --- fixture texts -------------------------------------------------------------------------------------

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 250.0
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5000.0
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1200.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.2
process_start_time_seconds 1.7e9
"""

SGLANG_TEXT = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 16.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 355.0
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 50.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
"""

LLAMACPP_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
llamacpp:tokens_predicted_total 512
llamacpp:prompt_tokens_seconds 812.5
llamacpp:predicted_tokens_seconds 41.25
llamacpp:kv_cache_usage_ratio 0.125
llamacpp:kv_cache_tokens 1024
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
llamacpp:n_tokens_max 4096
"""


def test_parse_labels_values_and_comments() -> None:
    text = (
        "# HELP x a metric\n"
        'x_total{path="/a,b",q="say \\"hi\\"",brace="}{"} 3 1700000000000\n'
        "y NaN\n"
        "z +Inf\n"
        "not a metric line {\n"
    )
    samples = parse_prometheus_text(text)
    (x,) = samples["x_total"]
    assert (
        x.value == 3.0
        and x.label("path") == "/a,b"
        and x.label("q") == 'say "hi"'
        and x.label("brace") == "}{"
    )
    assert math.isnan(samples["y"][0].value) and samples["z"][0].value == math.inf
    assert "not" not in samples


def test_vllm_adapter() -> None:
    scrape = Scrape.from_text(VLLM_TEXT, 10.0)
    adapter = detect_adapter(scrape)
    assert adapter is not None and adapter.server == "vllm"
    snap = build_snapshot("http://x", adapter, scrape, None)
    assert (snap.running, snap.waiting, snap.kv_cache_usage, snap.preemptions_total) == (7.0, 3.0, 0.42, 2.0)
    assert snap.prefix_cache_hit_rate_lifetime == 0.25
    assert snap.finish_reasons == {"stop": 9.0, "length": 1.0}
    # Rank 5 of 10 falls in (0.1, 0.5] holding 4: 0.1 + 0.4 * (5 - 4) / 4.
    assert snap.latency_lifetime["ttft"]["p50"] == pytest.approx(0.2)
    assert snap.latency_lifetime["ttft"]["p99"] == 0.5  # in the +Inf bucket: the largest finite bound
    assert uptime_from_metrics(scrape, 1.7e9 + 3600) == 3600.0


def test_sglang_adapter() -> None:
    scrape = Scrape.from_text(SGLANG_TEXT, 0.0)
    adapter = detect_adapter(scrape)
    assert adapter is not None and adapter.server == "sglang"
    snap = build_snapshot("http://x", adapter, scrape, None)
    assert (snap.kv_cache_usage, snap.running, snap.waiting) == (0.28, 16.0, 0.0)
    assert snap.prefix_cache_hit_rate == 0.0075
    assert snap.generation_tokens_per_s == 355.0
    assert snap.latency_lifetime["ttft"]["p50"] == pytest.approx(0.5)
    assert snap.latency_lifetime["ttft"]["p95"] == pytest.approx(0.95)


def test_llamacpp_adapter_and_rates_between_scrapes() -> None:
    first = Scrape.from_text(LLAMACPP_TEXT, 100.0)
    adapter = detect_adapter(first)
    assert adapter is not None and adapter.server == "llamacpp"
    alone = build_snapshot("http://x", adapter, first, None)
    assert (alone.kv_cache_usage, alone.running, alone.waiting) == (0.125, 2.0, 1.0)
    assert (alone.prompt_tokens_per_s, alone.generation_tokens_per_s) == (812.5, 41.25)  # its own gauges
    later = LLAMACPP_TEXT.replace("tokens_predicted_total 512", "tokens_predicted_total 612")
    snap = build_snapshot("http://x", adapter, Scrape.from_text(later, 104.0), first)
    assert snap.generation_tokens_per_s == 25.0  # (612 - 512) / 4 s from the counters
    assert snap.prompt_tokens_per_s == 0.0


def test_izh_adapter_on_izh_exporter_text() -> None:
    """The text izh's own PrometheusStatLogger writes parses with the izh adapter."""
    from izh.api.ops.metrics import PrometheusStatLogger
    from izh.engine_messages import SchedulerStats
    from izh.frontend.stats import RequestMetrics

    stat_logger = PrometheusStatLogger("tiny", max_model_len=256, cache_config={"block_size": "16"})

    def finished(request_id: str, reason: str, ttft: float) -> RequestMetrics:
        return RequestMetrics(
            request_id=request_id, arrival_time=100.0, num_prompt_tokens=20, max_tokens=16, queued_ts=100.0,
            scheduled_ts=100.0, first_token_time=100.0 + ttft, last_token_time=101.0 + ttft,
            num_generation_tokens=5, finish_reason=reason,
        )  # fmt: skip

    stats = SchedulerStats(
        num_running=4, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=64, prefix_cache_hits=16
    )
    stat_logger.on_scheduler_stats(stats)
    first = Scrape.from_text(stat_logger.render()[0].decode(), 0.0)
    for i, (reason, ttft) in enumerate((("stop", 0.03), ("stop", 0.07), ("length", 0.3))):
        stat_logger.on_request_finished(finished(f"r{i}", reason, ttft))
    stats = SchedulerStats(
        num_running=2,
        num_waiting=0,
        kv_cache_usage=0.25,
        prefix_cache_queries=96,
        prefix_cache_hits=40,
        num_preemptions=3,
    )
    stat_logger.on_scheduler_stats(stats)
    second = Scrape.from_text(stat_logger.render()[0].decode(), 2.0)

    adapter = detect_adapter(second)
    assert adapter is not None and adapter.server == "izh"
    snap = build_snapshot("http://x", adapter, second, first)
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (2.0, 0.0, 0.25)
    assert snap.prefix_cache_hit_rate == pytest.approx(24 / 32)  # this window's hits / queries
    assert snap.prefix_cache_hit_rate_lifetime == pytest.approx(40 / 96)
    assert (snap.preemptions_total, snap.preemptions_per_s) == (3.0, 1.5)
    assert snap.prompt_tokens_per_s == pytest.approx(30.0)  # 60 prompt tokens over 2 s
    assert snap.finish_reasons_window == {"stop": 2.0, "length": 1.0, "abort": 0.0, "error": 0.0}
    # TTFT buckets ... 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5: one each in (0.02,0.04], (0.06,0.08], (0.25,0.5].
    assert snap.latency_window["ttft"]["p50"] == pytest.approx(0.06 + 0.02 * 0.5)


# --- windowed quantiles --------------------------------------------------------------------------------

BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def direct_quantile(q: float, values: list[float]) -> float:
    """Prometheus's estimate computed straight from the raw observations of one window."""
    ordered = sorted(values)
    counts = [bisect.bisect_right(ordered, bound) for bound in BOUNDS] + [len(ordered)]
    rank = q * len(ordered)
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if index == len(BOUNDS):
        return BOUNDS[-1]
    lower = BOUNDS[index - 1] if index else 0.0
    below = counts[index - 1] if index else 0
    return lower + (BOUNDS[index] - lower) * (rank - below) / (counts[index] - below)


def test_window_quantiles_from_bucket_deltas_equal_a_direct_computation() -> None:
    registry = CollectorRegistry()
    histogram = Histogram(
        "izh:inter_token_latency_seconds", "ITL", ["engine"], buckets=BOUNDS, registry=registry
    )
    rng = random.Random(11)
    for _ in range(500):  # before the window: slow tokens, which must not leak into it
        histogram.labels(str(rng.randrange(2))).observe(rng.uniform(0.3, 3.0))
    before = Scrape.from_text(generate_latest(registry).decode(), 0.0)
    window = [rng.lognormvariate(math.log(0.04), 0.6) for _ in range(777)]
    for i, value in enumerate(window):
        histogram.labels(str(i % 2)).observe(value)  # two engines: their series are summed
    after = Scrape.from_text(generate_latest(registry).decode(), 5.0)

    buckets = bucket_delta(
        after.buckets("izh:inter_token_latency_seconds"), before.buckets("izh:inter_token_latency_seconds")
    )
    assert buckets[-1] == (math.inf, 777.0)
    ordered = sorted(window)
    for q in (0.5, 0.9, 0.95, 0.99):
        estimate = histogram_quantile(q, buckets)
        assert estimate == pytest.approx(direct_quantile(q, window))
        true = ordered[math.ceil(q * len(ordered)) - 1]
        upper_index = bisect.bisect_left(BOUNDS, true)
        lower = BOUNDS[upper_index - 1] if upper_index else 0.0
        assert estimate is not None
        assert lower <= estimate <= BOUNDS[min(upper_index, len(BOUNDS) - 1)], (
            "outside the true value's bucket"
        )

    snap = build_snapshot("http://x", detect_adapter(after), after, before)  # type: ignore[arg-type]
    assert snap.latency_window["itl"]["p95"] == pytest.approx(direct_quantile(0.95, window))


def test_quantile_edge_cases() -> None:
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    # A counter reset (a restarted server) keeps the new counts rather than negative ones.
    assert bucket_delta([(1.0, 2.0), (math.inf, 3.0)], [(1.0, 5.0), (math.inf, 9.0)]) == [
        (1.0, 2.0),
        (math.inf, 3.0),
    ]


# --- izh's stats endpoint and the block map ----------------------------------------------------------------


@pytest.mark.parametrize("nested", [True, False])
def test_izh_stats_fill_the_block_map_and_missing_numbers(nested: bool) -> None:
    scheduler = {"num_running": 5, "num_waiting": 6, "num_preemptions": 7, "kv_cache_usage": 0.5,
                 "prefix_cache_queries": 10, "prefix_cache_hits": 4}  # fmt: skip
    states = [2, 2, 1, 0, 0, 1, 2, 0]
    stats = (
        {"scheduler": scheduler, "kv_block_states": states}
        if nested
        else {**scheduler, "kv_block_states": states}
    )
    snap = Snapshot(url="http://x", up=True)
    apply_izh_stats(snap, {**stats, "uptime_s": 90.0})
    assert snap.kv_blocks == BlockCounts(used=3, cached=2, free=3)
    assert (snap.running, snap.waiting, snap.preemptions_total, snap.kv_cache_usage) == (5.0, 6.0, 7.0, 0.5)
    assert snap.prefix_cache_hit_rate_lifetime == 0.4 and snap.uptime_s == 90.0


def test_block_map_groups_blocks_when_they_do_not_fit() -> None:
    cells, per_cell = inspect_cmd.block_map([2] * 10 + [0] * 6, width=4, max_rows=2)
    assert per_cell == 2 and cells == [2, 2, 2, 2, 2, 0, 0, 0]
    cells, per_cell = inspect_cmd.block_map([1, 0, 2], width=4, max_rows=2)
    assert (cells, per_cell) == ([1, 0, 2], 1)
    mixed, _ = inspect_cmd.block_map([2, 1, 1, 0] * 16, width=4, max_rows=2)
    assert set(mixed) == {1}  # each cell of 8 blocks: 4 cached, 2 used, 2 free


# --- the command -----------------------------------------------------------------------------------------


def send_requests(url: str) -> None:
    with httpx.Client(base_url=f"{url}/v1") as client:
        for body in (
            {"model": "fake-model", "prompt": "a b c", "max_tokens": 4},  # cut at 4 of 8 tokens: length
            {"model": "fake-model", "prompt": "d e", "max_tokens": 20},  # its natural end: stop
            {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
        ):
            path = "/chat/completions" if "messages" in body else "/completions"
            assert client.post(path, json=body).status_code == 200


def test_once_json_snapshot_of_an_izh_server() -> None:
    with fake_server(FakeConfig(num_blocks=32)) as (url, _):
        send_requests(url)
        result = invoke(["--url", f"{url}/v1", "--once", "--json", "--interval", "0.01"])
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    assert snap["up"] is True and snap["server"] == "izh" and snap["health"] == "ok"
    assert snap["kv_blocks"] == {"used": 8, "cached": 8, "free": 16, "total": 32}
    assert snap["finish_reasons"] == {"stop": 2.0, "length": 1.0, "abort": 0.0, "error": 0.0}
    assert snap["prompt_tokens_total"] == 3 + 2 + 1
    assert snap["prefix_cache_hit_rate_lifetime"] == pytest.approx((1 + 1 + 0) / 6)
    # The fake observes a TTFT of exactly 0.02 s: all three in (0.01, 0.02], rank 1.5 of 3.
    assert snap["latency_lifetime"]["ttft"]["p50"] == pytest.approx(0.015)
    assert (snap["model"], snap["draining"], snap["in_flight"]) == ("fake-model", False, 1.0)
    assert snap["kv_cache_usage"] == 0.25
    assert snap["uptime_s"] is None and snap["seen_up_s"] > 0 and snap["window_s"] > 0


def test_once_dashboard_on_a_vllm_server_without_stats() -> None:
    with fake_server(FakeConfig(metrics_prefix="vllm:", stats_shape="none")) as (url, _):
        send_requests(url)
        result = invoke(["--url", url, "--once", "--interval", "0.01"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "server vllm" in out and "KV cache" in out and "Finished requests" in out and "TTFT" in out
    assert "used" not in out  # no block map without izh's stats


def test_once_with_metrics_off_says_so() -> None:
    with fake_server(FakeConfig(metrics=False, stats_shape="none")) as (url, _):
        result = invoke(["--url", url, "--once", "--json", "--interval", "0.01"])
    snap = json.loads(result.stdout)
    assert snap["up"] is True and "--metrics" in snap["notes"][0]


def test_down_server_is_reported_not_raised() -> None:
    with fake_server() as (url, _):
        pass
    result = invoke(["--url", url, "--once", "--json", "--interval", "0.01"])
    assert result.exit_code == 1
    snap = json.loads(result.stdout)
    assert snap["up"] is False and "ConnectError" in snap["error"]
    shown = invoke(["--url", url, "--once", "--interval", "0.01"])
    assert "DOWN" in shown.stdout and "Traceback" not in shown.output


def test_izh_stats_render_a_block_map() -> None:
    with fake_server(FakeConfig(num_blocks=16)) as (url, _):
        result = invoke(["--url", url, "--once", "--interval", "0.01"])
    assert result.exit_code == 0, result.output
    assert "████▓▓▓▓········" in result.stdout
    assert "used 4" in result.stdout and "cached 4" in result.stdout and "free 8" in result.stdout


# --- a slow endpoint ---------------------------------------------------------------------------------------


def test_once_asks_the_endpoints_at_once() -> None:
    # Each endpoint answers only once all three were asked: one after another, the first would time out.
    with fake_server(FakeConfig(rendezvous=True)) as (url, _):
        result = invoke(["--url", url, "--once", "--json", "--interval", "0.01", "--timeout", "20"])
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    assert snap["up"] and snap["health"] == "ok" and snap["timed_out"] == [] and snap["notes"] == []
    assert snap["kv_blocks"]["total"] == 32 and snap["kv_cache_usage"] == 0.25


def test_a_hanging_stats_endpoint_leaves_the_rest_and_a_note() -> None:
    with fake_server(FakeConfig(hang=("/v1/izh/stats",))) as (url, fake):
        send_requests(url)
        result = invoke(["--url", url, "--once", "--json", "--interval", "0.01", "--timeout", "0.3"])
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    assert snap["up"] is True and snap["health"] == "ok" and snap["timed_out"] == ["/v1/izh/stats"]
    assert fake.state.hung == ["/v1/izh/stats"] * 2  # asked on both scrapes: a timeout is not a 404
    assert "GET /v1/izh/stats failed: timeout" in snap["notes"][0]
    # /metrics' numbers are all there; only the block map (izh's stats) is missing.
    assert snap["finish_reasons"]["stop"] == 2.0 and snap["kv_cache_usage"] == 0.25
    assert snap["kv_blocks"] is None and snap["model"] is None


def test_a_hanging_metrics_endpoint_leaves_the_engine_stats() -> None:
    with fake_server(FakeConfig(num_blocks=16, hang=("/metrics",))) as (url, _):
        result = invoke(["--url", url, "--once", "--interval", "0.01", "--timeout", "0.3"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "up, health ok" in out and "timed out: /metrics" in out and "DOWN" not in out
    assert "used 4" in out and "GET /metrics failed: timeout" in out


def test_a_server_that_answers_nothing_is_down() -> None:
    with fake_server(FakeConfig(hang=("/health", "/metrics", "/v1/izh/stats"))) as (url, _):
        result = invoke(["--url", url, "--once", "--json", "--interval", "0.01", "--timeout", "0.3"])
    assert result.exit_code == 1
    snap = json.loads(result.stdout)
    assert snap["up"] is False and snap["error"].startswith("timeout")


def test_inspect_once_imports_no_server_stack_nor_settings() -> None:
    """`izh inspect --once` runs while a server is busy: its start-up must not pay for torch, the server
    stack or izh.settings (pydantic-settings), which it never uses."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed once the block ends: a down server
    code = (
        "import sys\n"
        "from izh_cli.main import main\n"
        f"sys.argv = ['izh', 'inspect', '--url', {url!r}, '--once', '--json']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        "heavy = ('torch', 'numpy', 'fastapi', 'uvicorn', 'pydantic_settings', 'izh.settings', 'izh.engine')\n"
        "print('heavy', sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[0])["up"] is False  # the inspect path really ran, against a closed port
    assert lines[1:] == ["exit 1", "heavy []"]


def test_izh_stats_engines_become_one_row_per_core() -> None:
    from rich.console import Console

    engines = [
        {"engine": 0, "pid": 11, "alive": True, "num_running": 3, "num_waiting": 1, "kv_cache_usage": 0.5},
        {"engine": 1, "pid": 12, "alive": False, "dead_reason": "killed by SIGKILL", "num_running": 0},
        {"engine": "bad"},
    ]
    snap = Snapshot(url="http://x", up=True)
    apply_izh_stats(snap, {"scheduler": {}, "engines": engines})
    assert [(e.engine, e.alive, e.running, e.waiting) for e in snap.engines] == [
        (0, True, 3.0, 1.0),
        (1, False, 0.0, None),
    ]
    assert snap.to_dict()["engines"][1]["dead_reason"] == "killed by SIGKILL"
    console = Console(width=120, record=True)
    console.print(inspect_cmd.render(snap, 1.0))
    text = console.export_text()
    assert "Engine cores" in text and "dead: killed by SIGKILL" in text and "50.0%" in text
