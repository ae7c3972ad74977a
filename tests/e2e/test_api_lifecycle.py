"""Request lifecycles over the FakeEngineCore (echoes prompts; magic tokens run forever or crash):
client disconnects abort, admission refusals are 503s with Retry-After, a failure after a stream
started is an SSE error event before [DONE], a dead core turns /health red, and the operator's
endpoints answer while the core is inside a long step."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from izh.config import EngineConfig
from izh.engine_messages import SchedulerStats
from tests.e2e.api_server import ApiServer, api_server
from tests.engine.fake_core import CRASH_TOKEN, FOREVER_TOKEN, GATE_TOKEN, FakeEngineCore, make_fake_model

MODEL = "fake"
FAKE_CORE = "tests.engine.fake_core:FakeEngineCore"


@pytest.fixture(scope="module")
def fake_model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer beside fake_core.json: steps take 10 ms, so FOREVER requests pace."""
    return make_fake_model(
        tiny_llama_dir,
        tmp_path_factory.mktemp("fake_model"),
        step_delay_s=0.01,
        max_model_len=256,
        vocab_size=1000,
    )


def _server(model_dir: Path, **start_kwargs: Any) -> Any:
    config = EngineConfig(model=str(model_dir), served_model_name=MODEL)
    return api_server(
        config,
        start_kwargs={"core_factory": FAKE_CORE, **start_kwargs},
        sse_keepalive_s=0.05,
        reasoning_parser="think",
    )


@pytest.fixture(scope="module")
def server(fake_model_dir: Path) -> Iterator[ApiServer]:
    with _server(fake_model_dir, max_requests_in_flight=2) as started:
        yield started


def _forever(stream: bool, max_tokens: int = 200, n: int = 1) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [FOREVER_TOKEN, 5], "max_tokens": max_tokens, "stream": stream, "n": n}


def _wait_idle(server: ApiServer) -> None:
    """Block until the server has no request in flight (the AsyncLLM's own idle event)."""
    assert server.llm is not None
    llm = server.llm
    server.call(lambda: asyncio.wait_for(llm._idle.wait(), 30))


def _finished(server: ApiServer, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    prefix = f'izh:request_success_total{{engine="0",finished_reason="{reason}",model_name="{MODEL}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :])


def test_stream_disconnect_aborts_the_request(server: ApiServer) -> None:
    aborted = _finished(server, "abort")
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=_forever(stream=True)) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["object"] == "text_completion"
    # Leaving the block closed the connection mid-stream: the request must be aborted, not run on.
    _wait_idle(server)
    assert _finished(server, "abort") == aborted + 1
    assert server.call(lambda: server.llm.num_in_flight) == 0  # type: ignore[union-attr]


def test_non_stream_disconnect_aborts_every_child(server: ApiServer) -> None:
    aborted = _finished(server, "abort")
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up long before 200 paced steps; its going away must abort both children.
        httpx.post(f"{server.url}/v1/completions", json=_forever(stream=False, n=2), timeout=0.5)
    _wait_idle(server)
    assert _finished(server, "abort") == aborted + 2


def test_overload_is_503_with_retry_after_and_admits_nothing(server: ApiServer) -> None:
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=_forever(stream=True)) as holding,
    ):
        assert holding.status_code == 200
        # One slot left of 2: n=2 admits one child, is refused the second, and must abort the first.
        refused = client.post(f"{server.url}/v1/completions", json=_forever(stream=True, n=2))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert server.call(lambda: server.llm.num_in_flight) == 1  # type: ignore[union-attr]
    _wait_idle(server)


def test_keepalive_comments_and_done_on_a_finished_stream(server: ApiServer) -> None:
    body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as reply:
        raw = b"".join(reply.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    data = [json.loads(e[len(b"data: ") :]) for e in events[:-1] if e.startswith(b"data: ")]
    assert [c["choices"][0]["finish_reason"] for c in data][-1] == "length"
    assert all(e.startswith((b"data: ", b": keep-alive")) for e in events)


def test_chat_splits_reasoning_streamed_and_not(server: ApiServer) -> None:
    # The fake core echoes the prompt, and this template renders just the user's text: the
    # "model" answers exactly what we wrote, so the split is known.
    text = "<think>First, add.\nThen check.</think>\n\nThe answer is 4."
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "chat_template": "{{ messages[0]['content'] }}",
        "n": 2,
    }
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
    for choice in whole["choices"]:
        message = choice["message"]
        assert message["reasoning_content"] == message["reasoning"] == "First, add.\nThen check."
        assert message["content"] == "The answer is 4."
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as reply:
        events = [line[len("data: ") :] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for index in (0, 1):
        deltas = [
            c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "First, add.\nThen check."
        assert "".join(d.get("reasoning", "") for d in deltas) == "First, add.\nThen check."
        assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
        assert not any("<think>" in d.get("content", "") + d.get("reasoning", "") for d in deltas)


def test_a_core_crash_mid_stream_is_an_error_event_then_done(fake_model_dir: Path) -> None:
    with _server(fake_model_dir) as server:
        body = {"model": MODEL, "prompt": [CRASH_TOKEN, 5], "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as reply:
            assert reply.status_code == 200  # admitted: the stream had started when the core died
            events = [line for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [5]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_stats_answer_while_the_core_is_in_a_long_step(fake_model_dir: Path, tmp_path: Path) -> None:
    """/v1/izh/stats serves the core's published snapshot: it does not wait for the step in progress."""
    model_dir = tmp_path / "gated"
    shutil.copytree(fake_model_dir, model_dir)
    with _server(model_dir) as server, ThreadPoolExecutor(1) as pool:
        gate = FakeEngineCore.gates[str(model_dir)]
        body = {"model": MODEL, "prompt": [GATE_TOKEN, 5], "max_tokens": 2}
        completion = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
        assert gate.entered.wait(30), "the gated step did not start"
        paths = ("/v1/izh/stats", "/health", "/metrics")
        replies = {path: httpx.get(f"{server.url}{path}", timeout=30) for path in paths}
        # Only this test releases the gate: every answer above came while the step still ran.
        assert not gate.release.is_set() and not completion.done()
        assert {path: reply.status_code for path, reply in replies.items()} == dict.fromkeys(replies, 200)
        stats = replies["/v1/izh/stats"].json()
        assert stats["num_requests_in_flight"] == 1 and stats["stats_age_s"] >= 0
        published = set(SchedulerStats.__struct_fields__) - {"iteration_tokens", "kv_block_states"}
        assert published <= set(stats["scheduler"]), published - set(stats["scheduler"])
        # The snapshot taken as the request arrived, before its step began, already shows it.
        assert stats["scheduler"]["num_running"] == 1 and stats["scheduler"]["num_blocks"] == 64
        assert stats["kv_block_states"] == [1] + [0] * 63 and stats["kv_block_states_age_s"] >= 0
        gate.release.set()
        assert completion.result(60).json()["choices"][0]["finish_reason"] == "length"
        _wait_idle(server)
        after = httpx.get(f"{server.url}/v1/izh/stats", timeout=30).json()
        assert after["scheduler"]["num_running"] == 0 and after["kv_block_states"] == [0] * 64


def test_steps_longer_than_the_heartbeat_timeout_are_served(fake_model_dir: Path, tmp_path: Path) -> None:
    """A step of 1 s against a 0.3 s heartbeat timeout (a long prefill on a slow CPU, scaled down): the
    core answers heartbeats during its steps, so the request is served and the server stays ready."""
    (tmp_path / "slow").mkdir()
    model_dir = make_fake_model(fake_model_dir, tmp_path / "slow", step_delay_s=1.0, max_model_len=256)
    with _server(model_dir, heartbeat_timeout_s=0.3, heartbeat_interval_s=0.05) as server:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200
