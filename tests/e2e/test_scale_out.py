"""`izh serve --api-server-count N --data-parallel-size M`: real processes, real HTTP, the tiny model.

The supervisor (izh_cli/serve_multi.py) starts M engine cores and N API processes on one listening
socket. Checked here: the same greedy outputs as one process; request ids unique across the API
processes; /metrics summed over them (engine-side series once per core); a killed data-parallel core
fails only its own requests and /ready says degraded; a killed API process stops the server with
exit 1; SIGTERM drains every API process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.conftest import isolated_cache_dir
from tests.e2e.test_serve import (
    START_TIMEOUT_S,
    _alive,
    _children,
    _free_port,
    _wait_for,
    serve_a_model_that_cannot_load,
)

PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen",
    "a b c d e f g",
    "word0 word1 word2 word3 word4 word5 word6 word7 word8 word9 word10 word11 word12 word13 word14",
    "x",
]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10)

    def health(self) -> int:
        try:
            return self.get("/health").status_code
        except httpx.HTTPError:
            return 0

    def core_pids(self) -> list[int]:
        return [int(e["pid"]) for e in self.get("/v1/izh/stats").json()["engines"]]

    def api_pids(self) -> list[int]:
        """The supervisor's children that are neither a core nor multiprocessing's resource tracker."""
        cores = set(self.core_pids())
        pids = []
        for pid in _children(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and pid not in cores:
                pids.append(pid)
        return pids


def _start(model: str, folder: Path, *flags: str) -> Server:
    port = _free_port()
    log = folder / f"serve-{port}.log"
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(folder / "cache")}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", model, "--port", str(port)]
    cmd += [
        "--kv-cache-memory-bytes",
        "8MiB",
        "--drain-timeout-s",
        "30",
        "--served-model-name",
        "tiny",
        *flags,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    _wait_for(lambda: server.health() == 200 or proc.poll() is not None, START_TIMEOUT_S, "the server")
    assert proc.poll() is None, log.read_text()
    return server


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)


@pytest.fixture
def start(tiny_llama_dir: str, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*flags: str) -> Server:
        servers.append(_start(tiny_llama_dir, tmp_path, *flags))
        return servers[-1]

    yield start
    for server in servers:
        _stop(server)


@pytest.fixture(scope="module")
def scaled(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two API processes over two data-parallel cores."""
    server = _start(
        tiny_llama_dir,
        tmp_path_factory.mktemp("scaled"),
        "--api-server-count",
        "2",
        "--data-parallel-size",
        "2",
    )
    yield server
    _stop(server)


def _greedy(url: str) -> list[tuple[str, str]]:
    """Per prompt: the non-streamed completion and the streamed one, greedy, 16 tokens."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    results = []
    for prompt in PROMPTS:
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        results.append((whole.choices[0].text, streamed))
    return results


def _completion(url: str, prompt: str, max_tokens: int = 4) -> dict:
    # A fresh connection each: the kernel hands it to whichever API process accepts first.
    with httpx.Client() as client:
        response = client.post(
            f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60
        )
    assert response.status_code == 200, response.text
    return response.json()


def _api_index(response_id: str) -> str:
    match = re.fullmatch(r"cmpl-(a\d+)-[0-9a-f]{32}", response_id)
    assert match, response_id
    return match.group(1)


def _metric(text: str, name: str, **labels: str) -> list[float]:
    """Every sample of `name` whose labels include `labels`."""
    values = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{key}="{val}"' in series for key, val in labels.items()):
            values.append(float(value))
    return values


def test_two_api_processes_and_two_cores_answer_like_one_process(
    scaled: Server, start: Callable[..., Server]
) -> None:
    single = start()
    expected = _greedy(single.url)
    _stop(single)
    assert _greedy(scaled.url) == expected
    assert all(whole == streamed for whole, streamed in expected)
    # Both cores served some of them (routing by load spreads a quiet server's requests).
    engines = scaled.get("/v1/izh/stats").json()["engines"]
    assert [e["engine"] for e in engines] == [0, 1]
    assert all(e["alive"] and e["prefix_cache_queries"] > 0 for e in engines)


def test_request_ids_are_unique_and_metrics_sum_over_api_processes(scaled: Server) -> None:
    before = scaled.get("/metrics").text
    requests0 = sum(_metric(before, "izh:api_requests_total", endpoint="/v1/completions"))
    tokens0 = sum(_metric(before, "izh:generation_tokens_total"))
    bodies: list[dict] = []
    with ThreadPoolExecutor(16) as pool:
        for batch in range(20):  # until both API processes answered some (the kernel picks)
            prompts = [f"prompt {batch} {i}" for i in range(16)]
            bodies += pool.map(lambda prompt: _completion(scaled.url, prompt), prompts)
            if len({_api_index(b["id"]) for b in bodies}) == 2:
                break
    ids = [b["id"] for b in bodies]
    assert len(set(ids)) == len(ids)
    assert {_api_index(i) for i in ids} == {"a0", "a1"}
    # Whichever process answers /metrics, it counts every process's requests and tokens.
    for _ in range(4):
        text = scaled.get("/metrics").text
        requests = sum(_metric(text, "izh:api_requests_total", endpoint="/v1/completions"))
        tokens = sum(_metric(text, "izh:generation_tokens_total"))
        assert requests - requests0 == len(bodies)
        assert tokens - tokens0 == sum(b["usage"]["completion_tokens"] for b in bodies)
        assert "pid=" not in text
        # Engine-side gauges: one series per core, not one per API process.
        assert len(_metric(text, "izh:num_requests_running")) == 2
        assert len(_metric(text, "izh:kv_cache_usage_perc", engine="1")) == 1
        routed = sum(_metric(text, "izh:dp_routed_requests_total"))
        assert routed >= len(bodies)


def _open_streams(
    url: str, prompts: list[str], max_tokens: int
) -> list[tuple[httpx.Client, Iterator[str], str]]:
    """Streams with their first data line read (so they run): (client, remaining lines, first line)."""
    streams: list[tuple[httpx.Client, Iterator[str], str]] = []
    for prompt in prompts:
        client = httpx.Client(timeout=120)
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        response = client.send(client.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line)
        streams.append((client, lines, next(lines)))
    return streams


def _finish(stream: tuple[httpx.Client, Iterator[str], str]) -> list[dict]:
    client, lines, first = stream
    events = []
    try:
        for line in [first, *lines]:
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                break
            events.append(json.loads(line.removeprefix("data: ")))
    finally:
        client.close()
    return events


def test_a_killed_core_fails_only_its_requests_and_ready_says_degraded(start: Callable[..., Server]) -> None:
    server = start("--api-server-count", "2", "--data-parallel-size", "2")
    cores = server.core_pids()
    # Short prompts have no prefix key: each API process alternates them between the cores.
    streams = _open_streams(server.url, ["hi", "yo", "ok", "no"], max_tokens=1000)
    in_flight = [e["num_requests_in_flight"] for e in server.get("/v1/izh/stats").json()["engines"]]
    os.kill(cores[1], signal.SIGKILL)
    outcomes = [_finish(s) for s in streams]
    failed = [events[-1]["error"] for events in outcomes if "error" in events[-1]]
    finished = [events[-1]["choices"][0]["finish_reason"] for events in outcomes if "error" not in events[-1]]
    assert failed and finished, (outcomes, in_flight)
    assert set(finished) == {"length"}
    for error in failed:
        assert error["type"] == "service_unavailable_error" and error["code"] == "engine_dead"
        assert "engine core 1 died" in error["message"]
    _wait_for(lambda: server.get("/ready").json().get("status") == "degraded", 30, "/ready to say degraded")
    ready = server.get("/ready")
    assert ready.status_code == 200
    body = ready.json()
    assert body["engines_alive"] == 1 and body["engines_total"] == 2
    assert [d["engine"] for d in body["dead_engines"]] == [1]
    assert server.health() == 200
    # New requests, through both API processes, go to the live core.
    for i in range(8):
        assert _completion(server.url, f"after {i}")["choices"][0]["finish_reason"] == "length"
    engines = server.get("/v1/izh/stats").json()["engines"]
    assert [e["alive"] for e in engines] == [True, False]
    # `izh inspect` shows every core, the dead one as such.
    inspect = [
        sys.executable,
        "-m",
        "izh_cli.main",
        "inspect",
        "--url",
        server.url,
        "--once",
        "--interval",
        "0.01",
    ]
    snap = json.loads(subprocess.run([*inspect, "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert [(e["engine"], e["alive"], e["pid"]) for e in snap["engines"]] == [
        (0, True, cores[0]),
        (1, False, cores[1]),
    ]
    shown = subprocess.run(
        inspect, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "160"}
    )
    assert "Engine cores" in shown.stdout and "dead:" in shown.stdout
    assert server.proc.poll() is None
    assert "engine core 1" in server.log.read_text()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert not _alive(cores[0])


def test_a_killed_api_process_stops_the_server_with_exit_1(start: Callable[..., Server]) -> None:
    server = start("--api-server-count", "2")
    apis, cores = server.api_pids(), server.core_pids()
    assert len(apis) == 2 and len(cores) == 1
    os.kill(apis[1], signal.SIGKILL)
    assert server.proc.wait(60) == 1
    log = server.log.read_text()
    assert re.search(r"API process \d \(pid \d+\) exited unexpectedly \(killed by SIGKILL\)", log), log
    _wait_for(lambda: not any(_alive(p) for p in [*apis, *cores]), 10, "every process to exit")


def test_sigterm_drains_every_api_process(start: Callable[..., Server]) -> None:
    server = start("--api-server-count", "2")
    apis, cores = server.api_pids(), server.core_pids()
    streams = []
    for _ in range(10):  # until streams run in both API processes (the kernel picks)
        streams += _open_streams(server.url, ["hello"] * 4, max_tokens=300)
        served_by = {_api_index(json.loads(first.removeprefix("data: "))["id"]) for _, _, first in streams}
        if served_by == {"a0", "a1"}:
            break
    assert served_by == {"a0", "a1"}
    server.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: server.health() in (0, 503) or _not_ready(server), 30, "draining")
    outcomes = [_finish(s) for s in streams]
    assert all(events[-1]["choices"][0]["finish_reason"] == "length" for events in outcomes)
    assert server.proc.wait(60) == 0
    log = server.log.read_text()
    assert "draining 2 API processes" in log
    _wait_for(lambda: not any(_alive(p) for p in [*apis, *cores]), 10, "every process to exit")


def _not_ready(server: Server) -> bool:
    try:
        return server.get("/ready").status_code == 503
    except httpx.HTTPError:
        return True


def test_a_model_that_cannot_load_makes_the_supervisor_exit_1(tiny_llama_dir: str, tmp_path: Path) -> None:
    serve_a_model_that_cannot_load(
        tiny_llama_dir, tmp_path, "--api-server-count", "2", "--data-parallel-size", "2"
    )


@pytest.mark.parametrize(
    "flags", [["--restart-dead-core"], ["--core-mode", "thread"]], ids=["restart_dead_core", "thread"]
)
def test_settings_the_supervisor_cannot_honour_are_usage_errors(
    tiny_llama_dir: str, tmp_path: Path, flags: list[str]
) -> None:
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", tiny_llama_dir, "--port", str(_free_port())]
    result = subprocess.run(
        [*cmd, "--data-parallel-size", "2", *flags], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2
    assert "cannot be combined with --api-server-count > 1 or --data-parallel-size > 1" in result.stderr


def test_the_last_core_dying_fails_streams_and_stops_the_server_with_exit_1(
    start: Callable[..., Server],
) -> None:
    server = start("--api-server-count", "2")
    apis, cores = server.api_pids(), server.core_pids()
    streams = _open_streams(server.url, ["hello"], max_tokens=1000)
    os.kill(cores[0], signal.SIGKILL)
    (events,) = [_finish(s) for s in streams]
    assert events[-1]["error"]["code"] == "engine_dead"
    assert server.proc.wait(60) == 1
    assert "the engine core died" in server.log.read_text()
    _wait_for(lambda: not any(_alive(p) for p in apis), 10, "the API processes to exit")


def test_lora_adapters_serve_through_every_api_process_and_core(
    tiny_llama_dir: str, tmp_path: Path, start: Callable[..., Server]
) -> None:
    """--lora-modules under the supervisor: every core loads the adapter, every API process lists it,
    and its greedy text is the single-process one, whichever process and core answer."""
    from tests.fixtures.lora import build_peft_adapter

    adapter = build_peft_adapter(tiny_llama_dir, tmp_path / "adapter", r=8, alpha=16, seed=5)
    single = start("--lora-modules", f"ad={adapter}")
    client = OpenAI(base_url=f"{single.url}/v1", api_key="unused", max_retries=0)
    expected = {
        model: [
            client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS[:3]
        ]
        for model in ("tiny", "ad")
    }
    _stop(single)
    assert expected["tiny"] != expected["ad"]
    scaled = start("--lora-modules", f"ad={adapter}", "--api-server-count", "2", "--data-parallel-size", "2")
    seen_ids: set[str] = set()
    rounds = 0
    # fresh connections: the kernel spreads them over both API processes, at random, so go on past 6 rounds
    # until both have answered (6 rounds all on one process happen 1 time in 32)
    while rounds < 6 or (seen_ids != {"a0", "a1"} and rounds < 40):
        rounds += 1
        with httpx.Client() as http:
            models = http.get(f"{scaled.url}/v1/models", timeout=30).json()["data"]
            assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("ad", "tiny")]
            for model in ("tiny", "ad"):
                for prompt, text in zip(PROMPTS[:3], expected[model], strict=True):
                    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
                    response = http.post(f"{scaled.url}/v1/completions", json=body, timeout=60).json()
                    assert response["choices"][0]["text"] == text
                    assert response["model"] == model
                    seen_ids.add(_api_index(response["id"]))
    assert seen_ids == {"a0", "a1"}
    metrics = scaled.get("/metrics").text
    assert sum(_metric(metrics, "izh:lora_requests_total", lora_name="ad")) == rounds * 3
    # Both cores served the adapter's requests (routing spreads a quiet server's load).
    engines = scaled.get("/v1/izh/stats").json()["engines"]
    assert all(e["prefix_cache_queries"] > 0 for e in engines)


def test_runtime_lora_updating_is_a_usage_error_under_the_supervisor(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", tiny_llama_dir, "--port", str(_free_port())]
    cmd += ["--api-server-count", "2", "--allow-runtime-lora-updating"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "allow_runtime_lora_updating cannot be combined" in result.stderr
    assert "--lora-modules" in result.stderr
