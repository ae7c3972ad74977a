"""Faults against a real `izh serve` with `--restart-dead-core`: clients that disconnect mid-stream,
never read, or read a byte at a time; the engine core killed mid-stream; the core hung (SIGSTOP).
Each must end with the server healthy, nothing in flight and every KV block free. And without
restarts, a hung core makes the server exit 1 without leaving the stopped core behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_reliability_lifecycle import (
    all_blocks_free,
    error_events,
    launch,
    mark_of,
    marked_pids,
    open_stream,
    stats,
    stop,
)
from tests.e2e.test_serve import Served, _alive, _wait_for

HEARTBEAT_TIMEOUT_S = "3"


@pytest.fixture(scope="module")
def served(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    started = launch(
        tiny_llama_dir,
        tmp_path_factory.mktemp("faults"),
        "--restart-dead-core",
        "--engine-heartbeat-timeout-s",
        HEARTBEAT_TIMEOUT_S,
        "--header-timeout-s",
        "1",
    )
    yield started
    stop(started)


def _assert_healthy_and_idle(served: Served) -> None:
    _wait_for(lambda: httpx.get(f"{served.url}/ready").status_code == 200, 60, "readiness")
    # Generous: on a busy machine a few hundred steps of the tiny model can take a while.
    _wait_for(lambda: all_blocks_free(served), 120, "every KV block to be free")
    body = {"model": served.model, "prompt": "are you there", "max_tokens": 4}
    reply = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{served.url}/health").status_code == 200


def _raw_stream_request(served: Served, max_tokens: int, rcvbuf: int | None = None) -> socket.socket:
    """A socket (with a small receive buffer) that has sent a streamed completion request and read
    nothing."""
    host, port = served.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    # Logprobs make each event ~0.5 KB, so the unread response soon outgrows a small receive buffer.
    body = json.dumps(
        {"prompt": "slow reader", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "logprobs": 5}
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body.encode())
    return sock


# --- clients --------------------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream(served: Served) -> None:
    with httpx.Client() as client:
        lines = open_stream(client, served)
        for _ in range(3):
            next(lines)
        lines.close()  # leaves the stream (and closes the connection) mid-generation
    _assert_healthy_and_idle(served)


def test_a_client_that_never_reads(served: Served) -> None:
    with _raw_stream_request(served, max_tokens=150, rcvbuf=4096):
        # The request runs to its end in the engine whatever the socket does; others are served.
        _assert_healthy_and_idle(served)
    _wait_for(lambda: stats(served)["num_requests_in_flight"] == 0, 30, "the request to be gone")


def test_a_client_that_reads_a_byte_at_a_time(served: Served) -> None:
    with _raw_stream_request(served, max_tokens=150, rcvbuf=4096) as sock:
        received = b""
        for _ in range(12):
            received += sock.recv(1)
            time.sleep(0.25)  # the client's pace, not a synchronization
        assert received.startswith(b"HTTP/1.1 200")
        _assert_healthy_and_idle(served)


def test_connections_that_never_finish_a_request_head_are_closed(served: Served) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as silent:
        assert silent.recv(1) == b""  # closed by the server: the read returns end-of-file
    with socket.create_connection((host, int(port)), timeout=30) as trickling:
        trickling.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
        assert trickling.recv(1) == b""
    _assert_healthy_and_idle(served)


# --- the engine core ------------------------------------------------------------------------------------


def test_core_killed_mid_stream_fails_the_stream_and_is_replaced(served: Served) -> None:
    old_core = served.core_pid
    restarts = stats(served)["num_core_restarts"]
    with httpx.Client() as client:
        lines = open_stream(client, served)
        seen = [next(lines)]
        os.kill(old_core, signal.SIGKILL)
        seen.extend(lines)
    assert seen[-1] == "data: [DONE]"
    errors = error_events(seen)
    assert len(errors) == 1 and errors[0]["code"] == "engine_dead" and "SIGKILL" in errors[0]["message"]
    # While the new core starts: alive (/health), not ready, new requests refused with Retry-After.
    assert httpx.get(f"{served.url}/health").status_code == 200
    body = {"model": served.model, "prompt": "during the restart", "max_tokens": 2}
    early = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    if early.status_code != 200:  # the new core may already be up
        assert early.status_code == 503 and early.headers["retry-after"] == "1"
        assert early.json()["error"]["code"] == "engine_restarting"
    _assert_healthy_and_idle(served)
    assert stats(served)["num_core_restarts"] == restarts + 1
    assert served.core_pid != old_core and not _alive(old_core)
    assert served.proc.poll() is None


def test_a_hung_core_turns_readiness_red_fails_requests_and_is_replaced(served: Served) -> None:
    old_core = served.core_pid
    restarts = stats(served)["num_core_restarts"]
    try:
        with httpx.Client() as client:
            lines = open_stream(client, served)
            seen = [next(lines)]
            os.kill(old_core, signal.SIGSTOP)
            # No heartbeat answer: /ready goes red (unresponsive, then restarting) ...
            _wait_for(
                lambda: httpx.get(f"{served.url}/ready").status_code == 503, 30, "readiness to turn red"
            )
            seen.extend(lines)  # ... and the stream ends with an error, not a hang.
    finally:
        if _alive(old_core):
            os.kill(old_core, signal.SIGCONT)
    assert seen[-1] == "data: [DONE]"
    errors = error_events(seen)
    assert len(errors) == 1 and errors[0]["code"] == "engine_dead"
    assert "heartbeat" in errors[0]["message"]
    _assert_healthy_and_idle(served)
    assert stats(served)["num_core_restarts"] == restarts + 1
    assert not _alive(old_core)  # the hung core was killed, not left stopped


def test_a_core_that_cannot_be_restarted_makes_the_server_exit_1(tiny_llama_dir: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    served = launch(str(model_dir), tmp_path, "--restart-dead-core")
    mark = mark_of(served)
    try:
        (model_dir / "config.json").write_text("{ not json")  # the replacement cannot load it
        os.kill(served.core_pid, signal.SIGKILL)
        assert served.proc.wait(60) == 1
        assert "could not be restarted" in served.log.read_text()
        _wait_for(lambda: not marked_pids(mark), 30, "every process of the server to exit")
    finally:
        stop(served)


def test_without_restarts_a_hung_core_makes_the_server_exit_1(tiny_llama_dir: str, tmp_path: Path) -> None:
    served = launch(tiny_llama_dir, tmp_path, "--engine-heartbeat-timeout-s", HEARTBEAT_TIMEOUT_S)
    mark = mark_of(served)
    core = served.core_pid
    try:
        os.kill(core, signal.SIGSTOP)
        assert served.proc.wait(60) == 1
        assert "did not answer a heartbeat" in served.log.read_text()
        _wait_for(lambda: not marked_pids(mark), 30, "the stopped core to be killed")
    finally:
        if _alive(core):
            os.kill(core, signal.SIGCONT)
        stop(served)
