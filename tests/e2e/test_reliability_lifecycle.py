"""The lifecycle of a real `izh serve` (spawned engine core): SIGTERM drains (readiness red first, new
requests 503, in-flight ones finish or end with an error event at the drain timeout, exit 0), a
second signal exits at once, and no path leaves an engine core behind: SIGTERM, SIGINT, SIGKILL of
the frontend, a failed start before or after the core is up. Also the JSON request log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import isolated_cache_dir
from tests.e2e.test_serve import Served, _alive, _free_port, _wait_for

START_TIMEOUT_S = 180.0
MARK_VAR = "IZH_RELIABILITY_TEST_MARK"
"""Inherited by the server and its engine core: finds every process a test started, orphans too."""


def launch(model_dir: str, tmp_path: Path, *flags: str, mark: str | None = None) -> Served:
    """`izh serve model_dir` on a free port (8 MiB of KV cache), started and healthy."""
    port = _free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {
        **os.environ,
        "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache"),
        MARK_VAR: mark or uuid.uuid4().hex,
    }
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", model_dir, "--port", str(port)]
    cmd += ["--kv-cache-memory-bytes", "8MiB", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    served = Served(proc, f"http://127.0.0.1:{port}", log)
    _wait_for(lambda: served.health() == 200 or proc.poll() is not None, START_TIMEOUT_S, "the server")
    assert proc.poll() is None, log.read_text()
    return served


def marked_pids(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment carries `mark`."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def mark_of(served: Served) -> str:
    environ = Path(f"/proc/{served.proc.pid}/environ").read_bytes().split(b"\0")
    return next(item.split(b"=", 1)[1].decode() for item in environ if item.startswith(MARK_VAR.encode()))


def stop(served: Served) -> None:
    """Test cleanup: whatever state the server (and its core) are in, end them."""
    mark = mark_of(served) if served.proc.poll() is None else None
    if served.proc.poll() is None:
        served.proc.kill()
        served.proc.wait(30)
    for pid in marked_pids(mark) if mark else []:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)


def stats(served: Served) -> dict[str, Any]:
    reply = httpx.get(f"{served.url}/v1/izh/stats", timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def all_blocks_free(served: Served) -> bool:
    """No KV block held by a request, and nothing in flight (cached blocks are free for reuse)."""
    current = stats(served)
    return 2 not in current["kv_block_states"] and current["num_requests_in_flight"] == 0


def open_stream(client: httpx.Client, served: Served, max_tokens: int = 900) -> Generator[str, None, None]:
    """A streamed completion that runs for a while; yields its non-empty lines."""
    body = {
        "model": served.model,
        "prompt": "hello",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with client.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line:
                yield line


def error_events(lines: list[str]) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))["error"]
        for line in lines
        if line.startswith('data: {"error"')
    ]


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for served in started:
        stop(served)


# --- SIGTERM -------------------------------------------------------------------------------------------


def test_sigterm_past_the_drain_timeout_ends_streams_with_an_error_and_exits_0(
    tiny_llama_dir: str, tmp_path: Path, servers: list[Served]
) -> None:
    served = launch(
        tiny_llama_dir, tmp_path, "--drain-timeout-s", "1", "--log-json", "--engine-heartbeat-timeout-s", "60"
    )
    servers.append(served)
    core = served.core_pid
    mark = mark_of(served)
    with httpx.Client() as client:
        lines = open_stream(client, served)
        seen = [next(lines)]
        os.kill(core, signal.SIGSTOP)  # the stream cannot finish within the drain timeout now
        served.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: httpx.get(f"{served.url}/ready").status_code == 503, 30, "readiness to turn red")
        refused = httpx.post(
            f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30
        )
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        seen.extend(lines)  # ends when the drain timeout fails the request
    os.kill(core, signal.SIGCONT)
    assert seen[-1] == "data: [DONE]"
    errors = error_events(seen)
    assert len(errors) == 1 and errors[0]["code"] == "engine_dead"
    assert "shut down before the request finished" in errors[0]["message"]
    assert served.proc.wait(60) == 0
    _wait_for(lambda: not marked_pids(mark), 30, "every process of the server to exit")
    # --log-json: one JSON object per line, the request lines with their fields.
    entries = [json.loads(line) for line in served.log.read_text().splitlines() if line.startswith("{")]
    requests = [entry for entry in entries if entry["logger"] == "izh.request"]
    streamed = next(
        entry for entry in requests if entry["path"] == "/v1/completions" and entry["status"] == 200
    )
    assert streamed["finish_reason"] == "error" and streamed["key_id"] == "anonymous"
    assert {"request_id", "duration_s", "prompt_tokens", "completion_tokens", "ttft_s"} <= set(streamed)
    assert any(entry["status"] == 503 for entry in requests)


def test_a_second_signal_exits_at_once(tiny_llama_dir: str, tmp_path: Path, servers: list[Served]) -> None:
    served = launch(
        tiny_llama_dir, tmp_path, "--drain-timeout-s", "600", "--engine-heartbeat-timeout-s", "600"
    )
    servers.append(served)
    core = served.core_pid
    mark = mark_of(served)
    with httpx.Client() as client:
        lines = open_stream(client, served)
        next(lines)
        os.kill(core, signal.SIGSTOP)  # without a second signal this would drain for 10 minutes
        served.proc.send_signal(signal.SIGINT)
        _wait_for(lambda: httpx.get(f"{served.url}/ready").status_code == 503, 30, "draining")
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0
    _wait_for(lambda: not marked_pids(mark), 30, "every process of the server to exit")
    assert not _alive(core)


# --- no orphan core ------------------------------------------------------------------------------------


def test_sigkill_of_the_frontend_takes_the_core_with_it(
    tiny_llama_dir: str, tmp_path: Path, servers: list[Served]
) -> None:
    served = launch(tiny_llama_dir, tmp_path)
    servers.append(served)
    core = served.core_pid
    mark = mark_of(served)
    served.proc.kill()
    served.proc.wait(30)
    # The core watches its parent: it must not live on as an orphan.
    _wait_for(lambda: not marked_pids(mark), 30, "the orphaned engine core to exit")
    assert not _alive(core)


def test_a_core_that_fails_to_start_leaves_no_process(tiny_llama_dir: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in Path(tiny_llama_dir).iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    mark = uuid.uuid4().hex
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache"), MARK_VAR: mark}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", str(broken), "--port", str(_free_port())]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and "NoSuchModelForCausalLM" in result.stderr
    assert marked_pids(mark) == []


def test_a_failure_after_the_core_started_leaves_no_process(tiny_llama_dir: str, tmp_path: Path) -> None:
    # The core is up when the API refuses its configuration: the core must still be stopped.
    mark = uuid.uuid4().hex
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache"), MARK_VAR: mark}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", tiny_llama_dir, "--port", str(_free_port())]
    cmd += ["--kv-cache-memory-bytes", "8MiB", "--tool-call-parser", "no-such-parser"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0 and "no-such-parser" in result.stderr
    assert "started EngineCore process" in result.stderr
    _wait_for(lambda: not marked_pids(mark), 30, "the engine core to exit")


def test_serve_bounds_connections_in_uvicorn() -> None:
    from izh.settings import load_settings
    from izh_cli.server import uvicorn_config

    overrides = {
        "server.max_connections": 7,
        "server.timeout_keep_alive_s": 3,
        "server.header_timeout_s": 2.5,
    }
    config = uvicorn_config(object(), load_settings(overrides=overrides, env={}))  # type: ignore[arg-type]
    assert (config.limit_concurrency, config.timeout_keep_alive) == (7, 3)
    assert config.http.__name__ == "HeaderTimeoutProtocol"  # type: ignore[union-attr]
