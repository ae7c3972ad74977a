"""A real `izh serve` process (spawned engine core) on a free loopback port: lifecycle and faults."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.conftest import isolated_cache_dir

START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        return []


def _is_engine_core(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def core_pid(self) -> int:
        cores = [p for p in _children(self.proc.pid) if _is_engine_core(p)]
        assert len(cores) == 1, cores
        return cores[0]

    @property
    def model(self) -> str:
        return str(httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"])

    def health(self) -> int:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return 0


@pytest.fixture
def serve(tiny_llama_dir: str, tmp_path: Path) -> Iterator[Callable[..., Served]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> Served:
        port = _free_port()
        log = tmp_path / f"serve-{port}.log"
        env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache")}
        cmd = [sys.executable, "-m", "izh_cli.main", "serve", tiny_llama_dir, "--port", str(port)]
        cmd += ["--kv-cache-memory-bytes", "8MiB", "--drain-timeout-s", "30", *flags]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        served = Served(proc, f"http://127.0.0.1:{port}", log)
        _wait_for(lambda: served.health() == 200 or proc.poll() is not None, START_TIMEOUT_S, "the server")
        assert proc.poll() is None, log.read_text()
        return served

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _stream_lines(client: httpx.Client, url: str, body: dict) -> Iterator[str]:
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                yield line


def test_serve_answers_openai_clients_and_exits_cleanly(serve: Callable[..., Served]) -> None:
    served = serve()
    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    models = client.models.list()
    assert len(models.data) == 1
    served_model = models.data[0].id
    chat = client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    usage = chat.usage
    assert usage is not None and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert chat.choices[0].finish_reason in ("stop", "length")
    core = served.core_pid
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0
    _wait_for(lambda: not _alive(core), 10, "the engine core to exit")


def test_sigterm_lets_the_request_in_flight_finish(serve: Callable[..., Served]) -> None:
    served = serve()
    core = served.core_pid
    body = {"model": served.model, "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
    texts: list[str] = []
    finish_reasons: list[str | None] = []
    with httpx.Client() as client:
        lines = _stream_lines(client, served.url, body)
        first = next(lines)
        served.proc.send_signal(signal.SIGTERM)
        # Draining: new requests are refused with 503 while the stream goes on.
        refused = client.post(f"{served.url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["type"]
        for line in [first, *lines]:
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                break
            chunk = json.loads(line.removeprefix("data: "))
            texts.append(chunk["choices"][0]["text"])
            finish_reasons.append(chunk["choices"][0]["finish_reason"])
    assert finish_reasons[-1] == "length"
    assert served.proc.wait(60) == 0
    assert not _alive(core)


def test_engine_core_killed_fails_streams_and_exits_nonzero(serve: Callable[..., Served]) -> None:
    served = serve()
    core = served.core_pid
    body = {"model": served.model, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.Client() as client:
        lines = _stream_lines(client, served.url, body)
        events.append(next(lines))
        os.kill(core, signal.SIGKILL)
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    errors = [json.loads(e.removeprefix("data: ")) for e in events[:-1] if '"error"' in e]
    assert len(errors) == 1 and errors[0]["error"]["message"]
    assert served.proc.wait(60) != 0
    assert "engine core died" in served.log.read_text()


def serve_a_model_that_cannot_load(tiny_llama_dir: str, tmp_path: Path, *flags: str) -> None:
    """`izh serve` (with `flags`) on a copy of the tiny model whose architecture does not exist: it
    exits 1 naming the architecture."""
    import shutil

    bad = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", str(bad), "--port", str(_free_port()), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 1
    assert "NoSuchModelForCausalLM" in result.stderr
    # Named with what izh serves, and a hint about support (not the network: nothing was fetched).
    assert "supported: LlamaForCausalLM" in result.stderr and "Gemma3ForCausalLM" in result.stderr
    assert "izh does not serve this model" in result.stderr
    assert "network" not in result.stderr


def test_core_that_cannot_start_makes_serve_exit_1(tiny_llama_dir: str, tmp_path: Path) -> None:
    serve_a_model_that_cannot_load(tiny_llama_dir, tmp_path)
