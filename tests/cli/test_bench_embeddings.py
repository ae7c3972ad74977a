"""`izh bench --endpoint embeddings` against a real izh server (a tiny random BERT): requests/s,
inputs/s and input tokens/s per concurrency level, tokens from the replies' usage; usage errors for
generation-only flags; a clear failure against a server that serves no embeddings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from izh.config import EngineConfig
from izh_cli.bench import cli as bench_cli
from tests.cli.fake_openai_server import fake_server
from tests.e2e.api_server import ApiServer, api_server
from tests.fixtures.bert import build_tiny_bert

app = typer.Typer()
app.command("bench")(bench_cli.bench)


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = build_tiny_bert(tmp_path_factory.mktemp("bert"), max_seq_length=64)
    with api_server(EngineConfig(model=folder, served_model_name="tiny-embed", device="cpu")) as started:
        yield started


def test_a_sweep_reports_throughput_from_the_replies_usage(server: ApiServer, tmp_path: Path) -> None:
    result = invoke(
        [
            "--url", server.url, "--endpoint", "embeddings", "--concurrency", "1,4", "--requests", "8",
            "--batch-size", "3", "--input-len", "12", "--json", "--out", str(tmp_path / "r.json"),
        ]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["config"]["endpoint"] == "embeddings" and summary["config"]["batch_size"] == 3
    assert [run["concurrency"] for run in summary["runs"]] == [1, 4]
    saved = json.loads((tmp_path / "r.json").read_text())
    for run, full in zip(summary["runs"], saved["runs"], strict=True):
        m = run["metrics"]
        assert m["completed"] == 8 and m["failed"] == 0 and not run["errors"]
        assert m["request_throughput"] > 0
        assert m["input_throughput"] == pytest.approx(3 * m["request_throughput"], rel=1e-2)
        # Tokens are the server's usage: every input is ~12 tokens (+ [CLS] and [SEP]).
        records = full["requests"]
        assert len(records) == 8 and all(r["num_inputs"] == 3 for r in records)
        assert m["total_input_tokens"] == sum(r["input_tokens"] for r in records)
        assert all(3 * 10 <= r["input_tokens"] <= 3 * 16 for r in records)
    assert "machine" in saved and saved["command"]


def test_the_table_is_printed_without_json(server: ApiServer, tmp_path: Path) -> None:
    result = invoke(["--url", server.url, "--endpoint", "embeddings", "--requests", "2", "--input-len", "8",
                     "--out", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Embeddings Benchmark Result" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--endpoint", "completions", "--batch-size", "2"],
        ["--endpoint", "embeddings", "--duration", "1"],
        ["--endpoint", "embeddings", "--slo", "ttft=1s"],
    ],
)
def test_generation_only_flags_are_usage_errors(args: list[str]) -> None:
    result = invoke(["--url", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2, result.output


def test_a_server_without_embeddings_fails_once_clearly(tmp_path: Path) -> None:
    with fake_server() as (url, _state):
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}).status_code == 404
        result = invoke(["--url", url, "--endpoint", "embeddings", "--requests", "2", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "test request" in result.output and "embeddings" in result.output
