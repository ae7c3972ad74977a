"""`izh bench`: the metric math on synthetic timestamps, the arrival process, and whole runs against the
fake OpenAI-compatible server (errors by kind, JSON result, sweep, compare, Ctrl-C)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import statistics
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from izh_cli.bench import cli as bench_cli
from izh_cli.bench.datasets import DatasetSpec, Sample, ServerTokenizer, build_samples
from izh_cli.bench.metrics import (
    Distribution,
    RequestRecord,
    compute_metrics,
    error_summary,
    parse_slo,
    peak_concurrency,
    peak_output_tokens_per_s,
    percentile,
)
from izh_cli.bench.report import compare
from izh_cli.bench.runner import RunConfig, Runner, StreamRecorder, arrival_gaps
from izh_cli.http import SseDecoder, resolve_urls
from tests.cli.fake_openai_server import FakeConfig, fake_server

app = typer.Typer()
app.command("bench")(bench_cli.bench)


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args)


def run_json(url: str, tmp_path: Path, *args: str, name: str = "result.json") -> dict[str, Any]:
    result = invoke(["--url", url, "--json", "--out", str(tmp_path / name), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- the timing definitions, on synthetic timestamps -------------------------------------------------


def chat_event(content: str | None = None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_stream_recorder_ttft_itl_latency_from_known_steps() -> None:
    record = RequestRecord(index=0, prompt_tokens=99)
    recorder = StreamRecorder(record, start=100.0, chat=True)
    events = [
        (100.5, chat_event("", role="assistant")),  # the role chunk carries no text: not the first token
        (101.0, chat_event("Hello")),
        (101.1, chat_event(" big")),
        (101.3, chat_event(" wide")),
        (101.6, chat_event(" world")),
        (101.7, chat_event(finish="stop")),
        (101.8, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}}),
    ]
    carried_text = [recorder.on_event(event, now) for now, event in events]
    text = recorder.finish()
    assert carried_text == [False, True, True, True, True, False, False]
    assert text == "Hello big wide world"
    assert record.ok
    assert record.ttft_s == pytest.approx(1.0)
    assert record.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert record.latency_s == pytest.approx(1.7)  # the last chunk with a choice; usage is not a token
    assert (record.prompt_tokens, record.output_tokens, record.num_chunks) == (10, 4, 4)

    metrics = compute_metrics([record], duration_s=2.0)
    assert metrics.latencies["ttft"].mean == pytest.approx(1000.0)
    assert metrics.latencies["tpot"].mean == pytest.approx(700.0 / 3)  # (1.7 - 1.0) / (4 - 1)
    assert metrics.latencies["itl"].median == pytest.approx(200.0)
    assert metrics.latencies["e2el"].percentiles[99.0] == pytest.approx(1700.0)


def test_stream_recorder_completions_reasoning_and_errors() -> None:
    record = RequestRecord(index=0)
    recorder = StreamRecorder(record, start=0.0, chat=False)
    recorder.on_event({"choices": [{"text": "a"}]}, 0.25)
    recorder.on_event({"choices": [{"text": "b"}]}, 0.5)
    recorder.on_event({"error": {"message": "engine died", "code": 500}}, 0.75)
    recorder.finish()
    assert not record.ok and record.error == "stream error: engine died"

    reasoning = RequestRecord(index=1)
    recorder = StreamRecorder(reasoning, start=0.0, chat=True)
    recorder.on_event(chat_event(reasoning_content="hmm"), 0.5)
    recorder.finish()
    assert reasoning.ttft_s == 0.5 and reasoning.ok

    empty = RequestRecord(index=2)
    StreamRecorder(empty, start=0.0, chat=True).finish()
    assert empty.error == "no tokens received"


def test_sse_decoder_splits_across_chunks_and_skips_comments() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b': ping\n\ndata: {"a"') == []
    assert decoder.feed(b": 1}\n\ndata: [DONE]\n\n") == [b'{"a": 1}', b"[DONE]"]
    assert decoder.feed(b"data: tail") == []
    assert decoder.flush() == [b"tail"]


def synthetic(index: int, start: float, ttft: float, itl: list[float], output_tokens: int) -> RequestRecord:
    return RequestRecord(
        index=index,
        start_s=start,
        ttft_s=ttft,
        itl_s=itl,
        latency_s=ttft + sum(itl),
        prompt_tokens=10,
        output_tokens=output_tokens,
        num_chunks=len(itl) + 1,
    )


def test_compute_metrics_matches_vllm_definitions() -> None:
    records = [
        synthetic(0, 0.0, 0.2, [0.05, 0.05, 0.1], 4),  # latency 0.4, tpot 0.2/3
        synthetic(1, 0.1, 0.4, [0.1], 2),  # latency 0.5, tpot 0.1
        synthetic(2, 0.6, 0.1, [], 1),  # one token: no TPOT sample
        RequestRecord(index=3, start_s=0.2, error="HTTP 500: boom"),
    ]
    m = compute_metrics(records, duration_s=2.0, slo={"ttft": 300.0, "tpot": 80.0})
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(18.5)
    assert m.latencies["ttft"].mean == pytest.approx(np.mean([200, 400, 100]))
    assert m.latencies["tpot"].count == 2
    assert m.latencies["tpot"].mean == pytest.approx(np.mean([200 / 3, 100]))
    assert m.latencies["itl"].count == 4
    assert m.latencies["e2el"].median == pytest.approx(400.0)
    # Goodput: #0 meets both (ttft 200, tpot 66.7), #1 fails ttft, #2 meets (tpot counts as 0).
    assert m.request_goodput == pytest.approx(2 / 2.0)
    # In flight: #0 [0, 0.4), #1 [0.1, 0.5), #2 [0.6, 0.7): two at most.
    assert m.max_concurrent_requests == 2
    assert m.max_output_tokens_per_s == 7.0  # every chunk falls into the first second
    data = m.to_dict()
    for key in (
        "mean_ttft_ms",
        "median_tpot_ms",
        "p90_itl_ms",
        "p99_e2el_ms",
        "std_ttft_ms",
        "request_goodput",
    ):
        assert key in data
    assert error_summary(records) == {"HTTP 500: boom": 1}


def test_percentiles_equal_numpy_linear_interpolation() -> None:
    rng = random.Random(7)
    values = [rng.expovariate(3.0) for _ in range(501)]
    dist = Distribution.of(values, percentiles=(50.0, 90.0, 99.0, 99.9))
    ms = np.array(values) * 1000.0
    assert dist.mean == pytest.approx(float(np.mean(ms)))
    assert dist.std == pytest.approx(float(np.std(ms)))
    assert dist.median == pytest.approx(float(np.median(ms)))
    for p in (50.0, 90.0, 99.0, 99.9):
        assert dist.percentiles[p] == pytest.approx(float(np.percentile(ms, p)))
    assert percentile([], 50) == 0.0
    assert Distribution.of([]).mean == 0.0


def test_peaks_use_half_open_intervals_and_one_second_buckets() -> None:
    back_to_back = [synthetic(0, 0.0, 0.5, [0.5], 2), synthetic(1, 1.0, 0.5, [0.5], 2)]
    assert peak_concurrency(back_to_back) == 1  # one ends at 1.0 exactly when the other starts
    # Chunks every 0.25 s (exact in binary): starts 0, 0.5, 0.75; six chunks each, the first 0.25 s in.
    overlapping = [synthetic(i, start, 0.25, [0.25] * 5, 6) for i, start in enumerate((0.0, 0.5, 0.75))]
    assert peak_concurrency(overlapping) == 3
    # Second 0 holds 3 + 1 + 0 chunks, second 1 holds 3 + 4 + 4, second 2 holds 0 + 1 + 2.
    assert peak_output_tokens_per_s(overlapping) == 11.0


def test_parse_slo() -> None:
    assert parse_slo("ttft=500ms, tpot=50ms,e2e=2s") == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_slo("ttft:250") == {"ttft": 250.0}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo("latency=3s")
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo("ttft=fast")


# --- the arrival process ---------------------------------------------------------------------------


def gaps(rate: float, burstiness: float, n: int, seed: int = 0) -> list[float]:
    generator = arrival_gaps(rate, burstiness, random.Random(seed))
    return [next(generator) for _ in range(n)]


def test_poisson_arrivals_have_the_requested_rate_and_are_seeded() -> None:
    sample = gaps(rate=4.0, burstiness=1.0, n=20_000)
    assert sample == gaps(rate=4.0, burstiness=1.0, n=20_000)
    assert sample != gaps(rate=4.0, burstiness=1.0, n=20_000, seed=1)
    mean = statistics.fmean(sample)
    assert mean == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(sample) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    below_mean = sum(gap < 0.25 for gap in sample) / len(sample)
    assert below_mean == pytest.approx(1 - math.exp(-1), abs=0.015)


def test_burstiness_changes_the_spread_not_the_mean() -> None:
    for burstiness in (0.25, 4.0):
        sample = gaps(rate=2.0, burstiness=burstiness, n=20_000)
        mean = statistics.fmean(sample)
        assert mean == pytest.approx(0.5, rel=0.05)
        assert statistics.pstdev(sample) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.07)
    assert gaps(rate=math.inf, burstiness=1.0, n=3) == [0.0, 0.0, 0.0]


# --- datasets ----------------------------------------------------------------------------------------


def test_resolve_urls() -> None:
    assert resolve_urls("http://h:1/v1/") == resolve_urls("http://h:1")
    assert resolve_urls("http://h:1").api == "http://h:1/v1"
    with pytest.raises(ValueError):
        resolve_urls("localhost:8000")


@pytest.mark.parametrize("shape", ["vllm", "llama.cpp"])
def test_random_prompts_are_fitted_to_exact_lengths_with_the_server_tokenizer(shape: str) -> None:
    async def build(url: str) -> tuple[list[Sample], list[Sample]]:
        async with httpx.AsyncClient() as client:
            tokenizer = await ServerTokenizer.probe(client, resolve_urls(url), "fake-model")
            assert tokenizer is not None and tokenizer.tokens_per_word == 1.0 and tokenizer.shape == shape
            spec = DatasetSpec("random", input_len=50, output_len=7, range_ratio=0.2, prefix_len=10, seed=3)
            first = await build_samples(spec, 12, tokenizer)
            again = await build_samples(spec, 12, tokenizer)
            return first, again

    with fake_server(FakeConfig(tokenize=True if shape == "vllm" else "llama.cpp")) as (url, _):
        samples, again = asyncio.run(build(url))
    assert [s.prompt for s in samples] == [s.prompt for s in again]  # seeded
    prefixes = {" ".join(s.prompt.split()[:10]) for s in samples}
    assert len(prefixes) == 1
    for sample in samples:
        assert sample.prompt_len_exact
        assert sample.prompt_len == len(sample.prompt.split())  # the fake tokenizer: one token per word
        assert 10 + 40 <= sample.prompt_len <= 10 + 60
        assert 5 <= sample.output_len <= 8


def test_prefix_dataset_shares_a_few_prefixes(tmp_path: Path) -> None:
    with fake_server() as (url, fake):
        doc = run_json(
            url,
            tmp_path,
            "-d",
            "prefix",
            "--prefix-len",
            "6",
            "--num-prefixes",
            "3",
            "--input-len",
            "4",
            "-n",
            "12",
        )
        prompts = [b["prompt"] for b in fake.state.bodies if b["prompt"] != "Hello, who are you?"]
    assert doc["runs"][0]["metrics"]["total_input_tokens"] == 12 * 10
    assert all(len(prompt.split()) == 10 for prompt in prompts)
    prefixes = {" ".join(prompt.split()[:6]) for prompt in prompts}
    assert len(prefixes) == 3
    assert len({" ".join(prompt.split()[6:]) for prompt in prompts}) > 3


def test_duration_mode_stops_sending_at_the_deadline(tmp_path: Path) -> None:
    with fake_server(FakeConfig(token_delay_s=0.005)) as (url, _):
        doc = run_json(url, tmp_path, "--duration", "0.3", "-c", "2", "--input-len", "3", "--output-len", "3")
    (run,) = doc["runs"]
    records = json.loads(Path(doc["result_path"]).read_text())["runs"][0]["requests"]
    assert run["metrics"]["completed"] == len(records) >= 1
    assert all(record["start_s"] < 0.3 for record in records)
    assert doc["config"]["duration_s"] == 0.3 and doc["config"]["requests"] is None


def test_file_datasets(tmp_path: Path) -> None:
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        '{"prompt": "one two three", "output_tokens": 3}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    sharegpt = tmp_path / "sharegpt.json"
    conversation = {
        "conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "v w x y z"}]
    }
    short = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    sharegpt.write_text(json.dumps([short, conversation]))

    jsonl_samples = asyncio.run(build_samples(DatasetSpec(str(jsonl), output_len=9), 3, None))
    assert [s.prompt for s in jsonl_samples] == ["one two three", "hi", "one two three"]
    assert [s.output_len for s in jsonl_samples] == [3, 9, 3]
    assert jsonl_samples[1].chat_messages() == [{"role": "user", "content": "hi"}]

    shared = asyncio.run(build_samples(DatasetSpec(str(sharegpt)), 2, None))
    assert [s.prompt for s in shared] == ["a b c d e"] * 2  # the too-short conversation is filtered out
    assert shared[0].output_len == round(5 * 1.3)


# --- whole runs against the fake server -----------------------------------------------------------


def test_bench_json_result_against_the_fake_server(tmp_path: Path) -> None:
    with fake_server() as (url, fake):
        doc = run_json(
            url, tmp_path, "-c", "4", "-n", "12", "--input-len", "20", "--output-len", "5", "--ignore-eos"
        )
        bodies = [b for b in fake.state.bodies if b["prompt"] != "Hello, who are you?"]
    assert len(bodies) == 12
    assert all(
        b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in bodies
    )
    assert all(b["max_tokens"] == 5 and len(b["prompt"].split()) == 20 for b in bodies)

    assert doc["schema"] == "izh.bench/1"
    assert doc["server"] == {
        "url": url,
        "models": ["fake-model"],
        "version": "fake-1.0",
        "model": "fake-model",
    }
    assert {"command", "git_sha", "machine", "created", "config"} <= set(doc)
    assert doc["machine"]["cpu_count"] >= 1
    assert doc["config"]["prompt_lengths"] == "server /tokenize"
    (run,) = doc["runs"]
    m = run["metrics"]
    assert (run["concurrency"], m["completed"], m["failed"]) == (4, 12, 0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (12 * 20, 12 * 5)
    assert 1 <= m["max_concurrent_requests"] <= 4
    assert run["errors"] == {} and run["output_tokens_from"] == "usage"
    assert "requests" not in run  # --json leaves the raw timings to the file

    saved = json.loads(Path(doc["result_path"]).read_text())
    records = saved["runs"][0]["requests"]
    assert len(records) == 12
    for record in records:
        assert record["output_tokens"] == 5 and len(record["itl_s"]) == 4  # one chunk per token
        assert 0 <= record["ttft_s"] <= record["latency_s"]


def test_bench_counts_errors_by_kind_and_keeps_going(tmp_path: Path) -> None:
    prompts = ["fine one", "FAIL_429 please", "fine two", "FAIL_500 now", "FAIL_STREAM later", "fine three"]
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    with fake_server() as (url, _):
        doc = run_json(url, tmp_path, "--endpoint", "chat", "--dataset", str(dataset), "-n", "12", "-c", "3")
    (run,) = doc["runs"]
    assert run["errors"] == {
        "HTTP 429: fake failure 429 on demand": 2,
        "HTTP 500: fake failure 500 on demand": 2,
        "stream error: fake failure mid-stream": 2,
    }
    assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (6, 6)


def test_bench_tables_show_errors(tmp_path: Path) -> None:
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text('{"prompt": "ok"}\n{"prompt": "FAIL_429"}\n')
    with fake_server() as (url, _):
        result = invoke(["--url", url, "--dataset", str(dataset), "-n", "4", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.stdout and "Mean TTFT (ms)" in result.stdout
    assert "Errors by kind" in result.stdout and "HTTP 429: fake failure 429 on demand" in result.stdout
    assert len(list(tmp_path.glob("bench-*.json"))) == 1


@pytest.mark.parametrize(("tokenize", "source"), [(True, "tokenize"), (False, "chunks")])
def test_output_tokens_without_usage(tmp_path: Path, tokenize: bool, source: str) -> None:
    with fake_server(FakeConfig(usage=False, tokenize=tokenize)) as (url, _):
        doc = run_json(url, tmp_path, "-n", "3", "--input-len", "8", "--output-len", "6", "--ignore-eos")
    (run,) = doc["runs"]
    assert run["output_tokens_from"] == source
    assert run["metrics"]["total_output_tokens"] == 18
    expected_input = "server /tokenize" if tokenize else "estimated (no /tokenize)"
    assert doc["config"]["prompt_lengths"] == expected_input


def test_sweep_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with fake_server() as (url, _):
        doc = run_json(
            url, tmp_path, "-c", "1,2,4", "-n", "6", "--input-len", "4", "--output-len", "3", "--plot"
        )
        table = invoke(
            ["--url", url, "-c", "1,3", "-n", "3", "--input-len", "4", "--out", str(tmp_path / "t.json")]
        )
    assert [run["concurrency"] for run in doc["runs"]] == [1, 2, 4]
    assert all(run["metrics"]["completed"] == 6 for run in doc["runs"])
    assert doc["runs"][0]["metrics"]["max_concurrent_requests"] == 1
    assert Path(doc["plot_path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.exit_code == 0 and "Sweep" in table.stdout


def test_compare_prints_deltas(tmp_path: Path) -> None:
    with fake_server() as (url, _):
        old = run_json(url, tmp_path, "-c", "1,2", "-n", "4", "--input-len", "4", name="old.json")
        new = run_json(
            url,
            tmp_path,
            "-c",
            "2",
            "-n",
            "4",
            "--input-len",
            "4",
            "--compare",
            old["result_path"],
            name="new.json",
        )
    deltas = new["compare"]["deltas"]
    assert {d["concurrency"] for d in deltas} == {2}
    by_metric = {d["metric"]: d for d in deltas}
    old_level = next(run for run in old["runs"] if run["concurrency"] == 2)["metrics"]
    new_level = new["runs"][0]["metrics"]
    throughput = by_metric["request_throughput"]
    assert throughput["old"] == old_level["request_throughput"]
    assert throughput["delta"] == pytest.approx(
        new_level["request_throughput"] - old_level["request_throughput"]
    )


def test_compare_direction_of_better() -> None:
    def doc(throughput: float, ttft: float) -> dict[str, Any]:
        metrics = {"request_throughput": throughput, "median_ttft_ms": ttft, "failed": 0}
        return {"runs": [{"concurrency": 8, "request_rate": None, "metrics": metrics}]}

    deltas = {d.metric: d for d in compare(doc(10.0, 100.0), doc(12.0, 150.0))}
    assert deltas["request_throughput"].delta_pct == pytest.approx(20.0)
    assert deltas["request_throughput"].better is True
    assert deltas["median_ttft_ms"].delta == 50.0 and deltas["median_ttft_ms"].better is False
    assert deltas["failed"].better is None


def test_server_down_is_one_line_and_exit_1() -> None:
    with fake_server() as (url, _):
        pass  # the port is closed again
    result = invoke(["--url", url, "-n", "1"])
    assert result.exit_code == 1
    assert "cannot reach" in result.output and "Traceback" not in result.output


def test_wrong_model_fails_once_clearly(tmp_path: Path) -> None:
    with fake_server() as (url, fake):
        result = invoke(["--url", url, "--model", "nope", "-n", "50", "--out", str(tmp_path)])
        sent = len(fake.state.bodies)
    assert result.exit_code == 1
    assert "test request" in result.output and "HTTP 404" in result.output
    assert sent == 1


@pytest.mark.parametrize(
    "args",
    [
        ["-n", "5", "--duration", "1"],
        ["--slo", "ttft=soon"],
        ["-c", "0"],
        ["-c", "a,b"],
        ["--range-ratio", "1.5"],
        ["--dataset", "missing.jsonl"],
        ["--dataset", "prefix"],
        ["--url", "localhost:8000"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


# --- Ctrl-C ------------------------------------------------------------------------------------------


def blocking_dataset(tmp_path: Path, num_fine: int) -> Path:
    path = tmp_path / "block.jsonl"
    lines = [{"prompt": f"fine {i}"} for i in range(num_fine)] + [{"prompt": "BLOCK here"}] * 5
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_runner_stop_keeps_what_was_measured(tmp_path: Path) -> None:
    async def main(url: str, blocked: threading.Event) -> Any:
        samples = [Sample(f"fine {i}", 3, 2) for i in range(3)] + [Sample("BLOCK here", 3, 2)] * 5
        config = RunConfig(
            url=f"{url}/v1/completions",
            endpoint="completions",
            model="fake-model",
            concurrency=1,
            num_requests=8,
        )
        async with httpx.AsyncClient() as client:
            runner = Runner(client, config, samples)
            stop = asyncio.Event()
            run = asyncio.create_task(runner.run(stop))
            await asyncio.get_running_loop().run_in_executor(None, blocked.wait, 30)
            stop.set()
            return await run

    with fake_server() as (url, fake):
        outcome = asyncio.run(main(url, fake.state.blocked))
    assert outcome.interrupted
    assert [r.index for r in outcome.records] == [0, 1, 2]  # the cancelled request is not a failure
    assert all(r.ok for r in outcome.records)


def test_ctrl_c_prints_partial_results_and_exits_130(tmp_path: Path) -> None:
    dataset = blocking_dataset(tmp_path, num_fine=4)
    with fake_server() as (url, fake):
        blocked = fake.state.blocked

        def interrupt() -> None:
            if blocked.wait(30):
                os.kill(os.getpid(), signal.SIGINT)

        thread = threading.Thread(target=interrupt)
        thread.start()
        result = invoke(
            ["--url", url, "--dataset", str(dataset), "-n", "9", "--json", "--out", str(tmp_path / "r.json")]
        )
        thread.join()
    assert result.exit_code == 130, result.output
    doc = json.loads(result.stdout)
    assert doc["interrupted"] is True
    assert doc["runs"][0]["metrics"]["completed"] == 4
    assert doc["runs"][0]["metrics"]["failed"] == 0


def _one_stream_per_connection_server(
    answer: bool = True,
) -> tuple[str, socket.socket, list[int], list[int]]:
    """A raw HTTP/1.1 server that acts like llama-server after a stream: it answers the first request on a
    connection (an SSE completion, kept alive: no ``Connection: close``) and closes the connection without
    answering when a second request arrives on it (with ``answer=False``, the first one too). ``answered``
    counts the streams it sent, ``dropped`` the requests it read and left unanswered."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    answered: list[int] = []
    dropped: list[int] = []
    chunk = json.dumps({"choices": [{"index": 0, "text": "tok ", "finish_reason": None}]})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    events = f"data: {chunk}\n\ndata: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n".encode()
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(events)
    ) + events

    def read_request(conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            part = conn.recv(65536)
            if not part:
                return False
            data += part
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        while len(body) < length:
            body += conn.recv(65536)
        return True

    def handle(conn: socket.socket) -> None:
        # Counted before the send or the close: the client may finish before this thread runs again.
        with conn:
            if not read_request(conn):
                return
            if not answer:
                dropped.append(1)
                return
            answered.append(1)
            conn.sendall(response)
            if read_request(conn):  # the next request on this connection: dropped unanswered
                dropped.append(1)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    host, port = listener.getsockname()
    return f"http://{host}:{port}", listener, answered, dropped


def _run_against(url: str, concurrency: int) -> Any:
    async def main() -> Any:
        config = RunConfig(
            url=f"{url}/v1/completions",
            endpoint="completions",
            model="m",
            concurrency=concurrency,
            num_requests=8,
        )
        async with httpx.AsyncClient() as client:
            return await Runner(client, config, [Sample("hello", 3, 2)]).run()

    return asyncio.run(main())


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_kept_alive_connection_closed_unanswered_is_retried_not_failed(concurrency: int) -> None:
    url, listener, answered, dropped = _one_stream_per_connection_server()
    try:
        outcome = _run_against(url, concurrency)
    finally:
        listener.close()
    assert [r.error for r in outcome.records] == [None] * 8
    assert all(r.ok and r.output_tokens == 2 for r in outcome.records)
    assert len(answered) == 8
    # Every request the server dropped went again, once, on a new connection; the first on a kept-alive
    # one that the server then dropped, which happens at least every other request.
    assert outcome.retried == len(dropped) >= 8 // 2 - concurrency


def test_a_request_dropped_on_a_new_connection_too_fails() -> None:
    """The retry is one send on a new connection: a server that drops that too fails the request (counted
    once as retried), and the run goes on to the next."""
    url, listener, answered, dropped = _one_stream_per_connection_server(answer=False)
    try:
        outcome = _run_against(url, 2)
    finally:
        listener.close()
    assert [r.error for r in outcome.records] == [
        "RemoteProtocolError: Server disconnected without sending a response."
    ] * 8
    assert not answered
    assert outcome.retried == 8
    assert len(dropped) == 16
