"""Real coding agents against a real `izh serve` of the default model (SmolLM2-135M-Instruct), headless,
each in a temporary home: OpenAI's Codex CLI (`codex exec`, over the Responses API) and Anthropic's
Claude Code (`claude -p`, over the Messages API). The protocol is what is checked, not the 135M model's
wits: the agent exits 0, every request izh received was answered 200 (izh's own request log), and the
agent printed the text the model generated (the log's outputs, server.log_prompts).

The CLIs come from npm: .ci/run installs pinned versions into .venv/agents (IZH_AGENTS_BIN or PATH
also serve); without one, its test skips saying so. Helpers: benchmarks/agents_cli.py, whose main
records the same task with a real Qwen2.5-Coder in bench_results/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.agents_cli import (
    Served,
    claude_env,
    claude_result,
    codex_env,
    codex_events,
    find_cli,
    request_lines,
    run_agent,
    serve,
)

MODEL = "smollm2"
MAX_MODEL_LEN = 2560  # Codex's short prompt is ~1,850 tokens
TIMEOUT_S = 1200  # a 2-core host shared with other work prefills Codex's ~2K-token prompt slowly
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 300)]


@pytest.fixture(scope="module")
def served(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # Codex sends no max_output_tokens: the context's room bounds a rambling 135M model's answer. Neither
    # agent sends a temperature: greedy (the server's default here) makes the 135M model's answers
    # repeatable (sampled at 1.0 it sometimes rambles to the end of the context, which Claude Code then
    # reports as an error after its continuation requests no longer fit: a 400, as Anthropic's).
    started = serve(
        smollm2_gguf,
        MODEL,
        tmp_path_factory.mktemp("agents-server"),
        MAX_MODEL_LEN,
        extra_args=("--override-generation-config", '{"temperature": 0}'),
    )
    try:
        yield started
    finally:
        started.stop()


def _outputs(lines: list[dict[str, object]]) -> list[str]:
    texts: list[str] = []
    for line in lines:
        outputs = line.get("outputs")
        if isinstance(outputs, list):
            texts += [text for text in outputs if isinstance(text, str)]
    return texts


def _check_protocol(served: Served, before: int, rc: int, stderr: str) -> list[dict[str, object]]:
    lines = request_lines(served.log)[before:]
    assert rc == 0, stderr[-3000:]
    assert lines, "the agent sent izh no request"
    assert [line["status"] for line in lines] == [200] * len(lines), lines
    return lines


def test_codex_exec(served: Served, tmp_path: Path) -> None:
    cli = find_cli("codex")
    if cli is None:
        pytest.skip("the Codex CLI is not installed (.ci/run: npm install @openai/codex into .venv/agents)")
    work = tmp_path / "work"
    work.mkdir()
    env = codex_env(tmp_path / "home", served.url, MODEL, short=True)
    before = len(request_lines(served.log))
    run = run_agent("codex", cli, env, MODEL, "say hi", work, TIMEOUT_S)
    lines = _check_protocol(served, before, run["rc"], run["stderr"])
    assert all(line["path"] == "/v1/responses" for line in lines)
    messages = [
        event["item"]["text"]
        for event in codex_events(run["stdout"])
        if event.get("type") == "item.completed" and event.get("item", {}).get("type") == "agent_message"
    ]
    assert messages, run["stdout"][-3000:]
    outputs = _outputs(lines)
    assert messages[-1].strip() and any(messages[-1].strip() in text for text in outputs), (messages, outputs)


def test_claude_print(served: Served, tmp_path: Path) -> None:
    cli = find_cli("claude")
    if cli is None:
        pytest.skip(
            "Claude Code is not installed (.ci/run: npm install @anthropic-ai/claude-code into .venv/agents)"
        )
    work = tmp_path / "work"
    work.mkdir()
    env = claude_env(tmp_path / "home", served.url, MODEL)
    before = len(request_lines(served.log))
    run = run_agent("claude", cli, env, MODEL, "say hi", work, TIMEOUT_S, short=True)
    lines = _check_protocol(served, before, run["rc"], run["stderr"])
    assert all(str(line["path"]).startswith("/v1/messages") for line in lines)
    result = claude_result(run["stdout"])
    assert result.get("is_error") is False, run["stdout"][-3000:]
    outputs = _outputs(lines)
    assert result["result"].strip() and any(result["result"].strip() in text for text in outputs), (
        result,
        outputs,
    )
