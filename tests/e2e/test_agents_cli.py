"""Real coding agents against a real `izh serve` of the default model (SmolLM2-135M-Instruct), headless,
each in a temporary home: OpenAI's Codex CLI (`codex exec`, over the Responses API) and Anthropic's
Claude Code (`claude -p`, over the Messages API). The protocol is what is checked, not the 135M model's
wits: every request izh received was answered 200 (izh's own request log), and either the agent exits 0
having printed the text the model generated (the log's outputs, server.log_prompts) or, where the model
rambled to its token bound (the prompt holds the date and paths, so this differs between hosts and days),
the agent reports its own output-limit error.

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
MAX_MODEL_LEN = 4096  # Codex's short prompt is ~1,850 tokens, Claude Code's ~1,670 (see test_claude_print)
CLAUDE_MAX_OUTPUT_TOKENS = 512
TIMEOUT_S = 1200  # a 2-core host shared with other work prefills Codex's ~2K-token prompt slowly
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 300)]


@pytest.fixture(scope="module")
def served(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # Codex sends no max_output_tokens: the context's room bounds a rambling 135M model's answer. Neither
    # agent sends a temperature: greedy (the server's default here) makes the 135M model's answers
    # repeatable on one host for one day (sampled at 1.0 most answers ramble to their bound).
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


def _answered(served: Served, before: int, path: str) -> list[dict[str, object]]:
    """izh's log lines for the agent's requests: at least one, each on `path`, each answered 200."""
    lines = request_lines(served.log)[before:]
    assert lines, "the agent sent izh no request"
    assert all(str(line["path"]).startswith(path) for line in lines), lines
    assert [line["status"] for line in lines] == [200] * len(lines), lines
    return lines


def _cut(lines: list[dict[str, object]]) -> bool:
    """The model's last answer ran to its token bound (a 135M model rambles on some prompts): the agent
    then ends with its own output-limit error, having parsed every response."""
    return lines[-1]["finish_reason"] == "length"


def test_codex_exec(served: Served, tmp_path: Path) -> None:
    cli = find_cli("codex")
    if cli is None:
        pytest.skip("the Codex CLI is not installed (.ci/run: npm install @openai/codex into .venv/agents)")
    work = tmp_path / "work"
    work.mkdir()
    env = codex_env(tmp_path / "home", served.url, MODEL, short=True)
    before = len(request_lines(served.log))
    run = run_agent("codex", cli, env, MODEL, "say hi", work, TIMEOUT_S)
    lines = _answered(served, before, "/v1/responses")
    events = codex_events(run["stdout"])
    if _cut(lines):  # Codex sends no max_output_tokens: the context's room bounded the answer
        failed = [event for event in events if event.get("type") == "turn.failed"]
        assert run["rc"] == 1 and failed, run["stdout"][-3000:]
        assert "max_output_tokens" in failed[-1]["error"]["message"], failed
        return
    assert run["rc"] == 0, (run["stderr"][-1000:], run["stdout"][-3000:])
    messages = [
        event["item"]["text"]
        for event in events
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
    # Claude Code asks for 32,000 tokens and, when an answer is cut, sends up to three continuations
    # ("Output token limit hit. Resume directly...", ~80 tokens more each). The prompt (~1,670 tokens, with
    # the date and the working directory in it) decides whether greedy SmolLM2 ends its answer (~180
    # tokens here) or rambles, which differs between hosts and days; a ramble to the context's end left
    # the continuations no room (400s, as Anthropic's; CI failed so). At 512 a request the prompt and
    # four answers fit the 4,096 tokens, and a ramble ends as Claude Code's own output-limit error after
    # izh answered every request: the protocol held either way.
    env = claude_env(tmp_path / "home", served.url, MODEL, max_output_tokens=CLAUDE_MAX_OUTPUT_TOKENS)
    before = len(request_lines(served.log))
    run = run_agent("claude", cli, env, MODEL, "say hi", work, TIMEOUT_S, short=True)
    lines = _answered(served, before, "/v1/messages")
    result = claude_result(run["stdout"])
    assert result, (run["rc"], run["stderr"][-1000:], run["stdout"][-3000:])
    if _cut(lines):  # every answer cut: Claude Code gave up after its continuations
        assert [line["finish_reason"] for line in lines] == ["length"] * len(lines) and len(lines) > 1, lines
        bounds = [line["completion_tokens"] for line in lines[:-1]]
        assert bounds == [CLAUDE_MAX_OUTPUT_TOKENS] * (len(lines) - 1), bounds
        assert run["rc"] == 1 and result.get("is_error") is True, result
        assert result.get("api_error") == "max_output_tokens", result
        return
    assert run["rc"] == 0, (run["stderr"][-1000:], run["stdout"][-3000:])
    assert result.get("is_error") is False, run["stdout"][-3000:]
    outputs = _outputs(lines)
    assert result["result"].strip() and any(result["result"].strip() in text for text in outputs), (
        result,
        outputs,
    )
