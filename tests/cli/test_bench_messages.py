"""`izh bench --endpoint messages` (Anthropic's streamed /v1/messages) and `--endpoint rerank` against
real izh servers (a tiny random Llama; a tiny random BERT): the same token counts as `--endpoint chat`
on the same prompts, timings from the content_block_delta events; rerank requests/s and input tokens
from the replies' usage; usage errors for flags the endpoints do not take."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from izh.config import EngineConfig
from izh_cli.bench import cli as bench_cli
from tests.e2e.api_server import ApiServer, api_server
from tests.fixtures.bert import build_tiny_bert

app = typer.Typer()
app.command("bench")(bench_cli.bench)


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(model=tiny_llama_dir, served_model_name="tiny", device="cpu", max_model_len=512)
    with api_server(config) as started:
        yield started


def _run(server: ApiServer, endpoint: str, out: Path) -> dict[str, Any]:
    result = invoke(
        [
            "--url", server.url, "--endpoint", endpoint, "--concurrency", "2", "--requests", "4",
            "--input-len", "16", "--output-len", "12", "--temperature", "0", "--json", "--out", str(out),
        ]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_messages_streams_the_same_tokens_as_chat(server: ApiServer, tmp_path: Path) -> None:
    messages = _run(server, "messages", tmp_path / "m.json")
    chat = _run(server, "chat", tmp_path / "c.json")
    assert messages["config"]["endpoint"] == "messages"
    m, c = messages["runs"][0]["metrics"], chat["runs"][0]["metrics"]
    assert m["completed"] == c["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == c["total_output_tokens"] > 0
    assert m["total_input_tokens"] == c["total_input_tokens"] > 0
    for record in messages["runs"][0]["requests"]:
        assert record["ttft_s"] > 0 and record["output_tokens"] > 0


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = build_tiny_bert(tmp_path_factory.mktemp("bert"), max_seq_length=64)
    with api_server(EngineConfig(model=folder, served_model_name="tiny-embed", device="cpu")) as started:
        yield started


def test_rerank_reports_throughput_from_the_replies_usage(bert_server: ApiServer, tmp_path: Path) -> None:
    result = invoke(
        [
            "--url", bert_server.url, "--endpoint", "rerank", "--concurrency", "2", "--requests", "6",
            "--batch-size", "4", "--input-len", "12", "--json", "--out", str(tmp_path / "r.json"),
        ]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "r.json").read_text())
    m = saved["runs"][0]["metrics"]
    assert saved["config"]["endpoint"] == "rerank" and m["completed"] == 6 and m["failed"] == 0
    records = saved["runs"][0]["requests"]
    # The query and 4 documents per request, ~12 tokens each (+ [CLS] and [SEP]).
    assert all(5 * 10 <= r["input_tokens"] <= 5 * 16 for r in records)


@pytest.mark.parametrize(
    "args",
    [
        ["--endpoint", "messages", "--ignore-eos"],
        ["--endpoint", "messages", "--batch-size", "2"],
        ["--endpoint", "rerank", "--slo", "ttft=1s"],
    ],
)
def test_flags_the_endpoint_does_not_take_are_usage_errors(args: list[str]) -> None:
    result = invoke(["--url", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2, result.output
