"""Real coding agents against a real `izh serve`: OpenAI's Codex CLI (`codex exec`, Responses API) and
Anthropic's Claude Code (`claude -p`, Messages API), headless, each in a temporary home, then izh's
request log read back: every request's status, prompt tokens, prefix-cache hits and duration.

    flock /tmp/izh-bench.lock python -m benchmarks.agents_cli MODEL.gguf [--agents codex claude]

The task, in a scratch folder holding hello.py: "run python3 hello.py and tell me what it prints". The
CLIs come from npm (.ci/run installs pinned versions into .venv/agents; IZH_AGENTS_BIN overrides);
the tests in tests/e2e/test_agents_cli.py use the same helpers on the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import free_port, wait_ok

REPO = Path(__file__).resolve().parents[1]
TASK = "run python3 hello.py and tell me what it prints"
HELLO = 'print("Hello from izh, 4 + 3 =", 4 + 3)\n'
SHORT_INSTRUCTIONS = (
    "You are a coding agent in a terminal. Run shell commands with the exec_command tool when the user "
    "asks for something a command can answer, then answer briefly with what it printed.\n"
)


def find_cli(name: str) -> str | None:
    """The agent CLI `name` (codex, claude): under $IZH_AGENTS_BIN, the project's .venv/agents, or PATH."""
    folders = [os.environ.get("IZH_AGENTS_BIN", ""), str(REPO / ".venv" / "agents" / "node_modules" / ".bin")]
    for folder in folders:
        if folder and (Path(folder) / name).exists():
            return str(Path(folder) / name)
    return shutil.which(name)


@dataclass
class Served:
    """A running `izh serve` with JSON logs (the request log is read from `log`)."""

    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def serve(
    gguf: str,
    model: str,
    folder: Path,
    max_model_len: int,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Served:
    """`izh serve` of `gguf` on a free port, logging JSON lines to folder/serve.log, each request's
    prompt and output included (server.log_prompts)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "izh.toml"
    # The default heartbeat (30 s): the core answers it during long prefill steps.
    config.write_text("[server]\nlog_prompts = true\n[logging]\njson = true\n")
    port = free_port()
    log = folder / "serve.log"
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", gguf, "--port", str(port), "--config", str(config)]
    cmd += ["--served-model-name", model, "--max-model-len", str(max_model_len), *extra_args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(extra_env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    wait_ok(f"{url}/health", proc, 600)
    return Served(proc, url, model, log)


def request_lines(log: Path, path_prefix: str = "/v1/") -> list[dict[str, Any]]:
    """izh's request log lines (izh.api.ops.request_log) for the API paths, in order."""
    lines = []
    for text in log.read_text(errors="replace").splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and str(line.get("path", "")).startswith(path_prefix) and "status" in line:
            lines.append(line)
    return lines


def codex_env(home: Path, base_url: str, model: str, *, short: bool) -> dict[str, str]:
    """A Codex home whose provider is izh's Responses API; `short`: our short instructions and only
    the shell tools (the default model's 8K context cannot hold Codex's ~9K-token default prompt)."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [f'model = "{model}"', 'model_provider = "izh"']
    if short:
        (home / "instructions.md").write_text(SHORT_INSTRUCTIONS)
        lines += [f'model_instructions_file = "{home / "instructions.md"}"', 'web_search = "disabled"']
        lines += [
            "include_permissions_instructions = false",
            "include_apps_instructions = false",
            "[features]",
        ]
        lines += [
            f"{feature} = false" for feature in ("multi_agent", "goals", "image_generation", "skill_search")
        ]
        lines += ["view_image = false", "apps = false"]
    lines += [
        "[model_providers.izh]",
        'name = "izh"',
        f'base_url = "{base_url}/v1"',
        'wire_api = "responses"',
    ]
    # Codex drops a stream silent for 5 minutes; a CPU prefilling its first prompt can take longer.
    lines += ['env_key = "IZH_AGENT_KEY"', "stream_idle_timeout_ms = 3600000"]
    (codex_home / "config.toml").write_text("\n".join(lines) + "\n")
    return {"HOME": str(home), "CODEX_HOME": str(codex_home), "IZH_AGENT_KEY": "unused", "NO_COLOR": "1"}


def claude_env(home: Path, base_url: str, model: str, max_output_tokens: int | None = None) -> dict[str, str]:
    """Claude Code pointed at izh's Messages API, with its telemetry and other traffic off;
    `max_output_tokens` lowers the max_tokens it sends (32,000 by default)."""
    home.mkdir(parents=True, exist_ok=True)
    bound = {} if max_output_tokens is None else {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)}
    return bound | {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": "unused",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "NO_COLOR": "1",
    }


def agent_command(agent: str, cli: str, model: str, task: str, *, short: bool) -> list[str]:
    """The headless command line; `short` (Claude Code): our short system prompt, the Bash tool only."""
    if agent == "codex":
        return [
            cli,
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--json",
            task,
        ]
    command = [
        cli,
        "-p",
        task,
        "--model",
        model,
        "--tools",
        "Bash",
        "--allowedTools",
        "Bash",
        "--output-format",
        "stream-json",
        "--verbose",
    ]
    return command + (
        ["--system-prompt", SHORT_INSTRUCTIONS.replace("exec_command", "Bash")] if short else []
    )


def run_agent(
    agent: str,
    cli: str,
    env: dict[str, str],
    model: str,
    task: str,
    cwd: Path,
    timeout_s: float,
    short: bool = False,
) -> dict[str, Any]:
    """Run one headless agent turn; its exit code, output and wall time."""
    started = time.monotonic()
    try:
        proc = subprocess.run(
            agent_command(agent, cli, model, task, short=short),
            cwd=cwd,
            env={"PATH": os.environ.get("PATH", ""), **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:  # recorded as cut, with what it had printed
        return {
            "rc": None,
            "timed_out_s": timeout_s,
            "stdout": _text(exc.stdout),
            "stderr": _text(exc.stderr),
            "wall_s": time.monotonic() - started,
        }
    return {
        "rc": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "wall_s": time.monotonic() - started,
    }


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def codex_events(stdout: str) -> list[dict[str, Any]]:
    """`codex exec --json`'s events (and `claude -p --output-format stream-json`'s), one JSON object a
    line."""
    events = []
    for text in stdout.splitlines():
        try:
            events.append(json.loads(text))
        except ValueError:
            continue
    return events


def claude_result(stdout: str) -> dict[str, Any]:
    """`claude -p --output-format stream-json`'s final `result` event ({} when it printed none)."""
    results = [event for event in codex_events(stdout) if event.get("type") == "result"]
    return results[-1] if results else {}


def tool_calls(agent: str, stdout: str) -> list[str]:
    """The shell commands the agent ran: Codex's command_execution items, Claude Code's Bash tool_use
    blocks."""
    commands = []
    for event in codex_events(stdout):
        if agent == "codex":
            item = event.get("item", {})
            if event.get("type") == "item.completed" and item.get("type") == "command_execution":
                commands.append(str(item.get("command")))
        elif event.get("type") == "assistant":
            for block in event.get("message", {}).get("content", []):
                if block.get("type") == "tool_use":
                    commands.append(json.dumps(block.get("input")))
    return commands


def final_answer(agent: str, stdout: str) -> str:
    """The agent's last message to the user."""
    if agent == "claude":
        return str(claude_result(stdout).get("result", ""))
    messages = [
        event["item"]["text"]
        for event in codex_events(stdout)
        if event.get("type") == "item.completed" and event.get("item", {}).get("type") == "agent_message"
    ]
    return messages[-1] if messages else ""


def prefix_cache_counters(url: str) -> dict[str, float]:
    """izh's /metrics prefix-cache counters (tokens queried, tokens served from the cache)."""
    import httpx

    counters = {"queries": 0.0, "hits": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for key in counters:
            if line.startswith(f"izh:prefix_cache_{key}_total"):
                counters[key] += float(line.rsplit(" ", 1)[1])
    return counters


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--agents", nargs="+", default=["codex", "claude"])
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--short", action="store_true", help="Codex with short instructions (see codex_env)")
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="serve with temperature 0 (server.override_generation_config): neither agent sends one",
    )
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", default=str(REPO / "bench_results"))
    args = parser.parse_args()
    scratch = Path(f"/tmp/izh-agents-bench-{os.getpid()}")
    greedy = ("--override-generation-config", '{"temperature": 0}') if args.greedy else ()
    served = serve(args.gguf, args.model, scratch / "server", args.max_model_len, extra_args=greedy)
    results: dict[str, Any] = {}
    try:
        for agent in args.agents:
            cli = find_cli(agent)
            if cli is None:
                results[agent] = {"skipped": f"{agent} CLI not installed"}
                continue
            work = scratch / agent / "work"
            work.mkdir(parents=True)
            (work / "hello.py").write_text(HELLO)
            home = scratch / agent / "home"
            env = (
                codex_env(home, served.url, args.model, short=args.short)
                if agent == "codex"
                else claude_env(home, served.url, args.model)
            )
            before = len(request_lines(served.log))
            cache_before = prefix_cache_counters(served.url)
            run = run_agent(agent, cli, env, args.model, TASK, work, args.timeout_s, args.short)
            time.sleep(1)  # the request log line is written once the response is out
            cache_after = prefix_cache_counters(served.url)
            run["prefix_cache_tokens"] = {k: cache_after[k] - cache_before[k] for k in cache_after}
            run["tool_calls"] = tool_calls(agent, run["stdout"])
            run["answer"] = final_answer(agent, run["stdout"])
            run["expected_output_in_answer"] = "4 + 3 = 7" in run["answer"]
            run["requests"] = [
                {
                    k: line.get(k)
                    for k in (
                        "path",
                        "status",
                        "prompt_tokens",
                        "cached_tokens",
                        "completion_tokens",
                        "ttft_s",
                        "duration_s",
                        "finish_reason",
                    )
                }
                for line in request_lines(served.log)[before:]
            ]
            results[agent] = run
            print(json.dumps({agent: {k: v for k, v in run.items() if k != "stdout"}}, indent=1)[:4000])
    finally:
        served.stop()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record = {
        "bench": "agents_cli",
        "command": " ".join(sys.argv),
        "git_sha": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "cpu": _cpu(),
        "model": args.gguf,
        "task": TASK,
        "note": "host shared with concurrent work: times are noisy",
        "load_average_1m_end": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    out = Path(args.out) / f"agents_cli-{stamp}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
