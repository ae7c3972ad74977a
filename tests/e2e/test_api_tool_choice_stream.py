"""Streamed chat with forced tool calls over the FakeEngineCore (it echoes the prompt, one token per
step, and ignores grammars: the "model" writes exactly the calls we give it): a chat stream gets SSE
keep-alive comments while its request waits for the engine, and a repeated forced call ends the
message, the request aborted in the engine rather than run to its end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server
from tests.engine.fake_core import GATE_TOKEN, FakeEngineCore, make_fake_model

MODEL = "fake"
# The echo answers the last message as it is, then EOS (id 2, a stop for the fake core too): the
# tools prompt izh adds goes unrendered.
ECHO_TEMPLATE = "{{ messages[-1]['content'] }}<|im_end|>"
EOS_TOKEN_ID = 2
NOW = {"type": "function", "function": {"name": "now", "description": "The current time."}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer beside fake_core.json (10 ms steps, the tokenizer's EOS)."""
    return make_fake_model(
        tiny_llama_dir,
        tmp_path_factory.mktemp("fake_tool_model"),
        step_delay_s=0.01,
        max_model_len=2048,
        vocab_size=1000,
        eos_token_ids=[EOS_TOKEN_ID],
    )


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ApiServer]:
    config = EngineConfig(model=str(model_dir), served_model_name=MODEL)
    with api_server(
        config, start_kwargs={"core_factory": "tests.engine.fake_core:FakeEngineCore"}, sse_keepalive_s=0.02
    ) as started:
        yield started


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "chat_template": ECHO_TEMPLATE,
        "tools": [WEATHER, NOW],
        "tool_choice": "required",
        **fields,
    }


def _events(lines: Iterator[str]) -> list[str]:
    """The `data:` payloads of an SSE stream, up to [DONE] (comments and blank lines skipped)."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def _aborted(server: ApiServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    prefix = f'izh:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_a_waiting_chat_stream_gets_keepalive_comments(server: ApiServer, model_dir: Path) -> None:
    gate = FakeEngineCore.gates[str(model_dir)]
    gate.release.clear()
    hold = {"model": MODEL, "prompt": [GATE_TOKEN, 5], "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(httpx.post, f"{server.url}/v1/completions", json=hold, timeout=60)
        try:
            assert gate.entered.wait(30), "the gated step did not start"
            # The core is inside a step: the chat request waits for it, its stream must stay alive.
            with httpx.stream(
                "POST", f"{server.url}/v1/chat/completions", json=_chat(NOW_CALL, stream=True), timeout=30
            ) as reply:
                assert reply.status_code == 200
                lines = reply.iter_lines()
                before = []
                for line in lines:
                    before.append(line)
                    if line.startswith(":"):
                        break
                # Nothing but the comment came first: not even the role chunk.
                assert [line for line in before if line] == [": keep-alive"]
                gate.release.set()
                events = _events(lines)
        finally:
            gate.release.set()
        assert holding.result(60).status_code == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "now"
    assert "".join(call["function"].get("arguments", "") for call in calls) == "{}"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_forced_call_aborts_the_request(server: ApiServer, stream: bool) -> None:
    # The "model" calls get_weather, repeats it (other whitespace), then would go on for long.
    spaced = PARIS.replace('{"city": "Paris"}', '{ "city" :\n "Paris" }')
    content = "\n".join([PARIS, spaced, NOW_CALL, *[PARIS.replace("Paris", f"City{i}") for i in range(4)]])
    aborted = _aborted(server)
    body = _chat(content, stream=stream, stream_options={"include_usage": True} if stream else None)
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as reply:
            events = _events(reply.iter_lines())
        chunks = [json.loads(event) for event in events[:-1]]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
        assert {call["index"] for call in calls} == {0}  # nothing of the repeat went out
        arguments = "".join(call["function"].get("arguments", "") for call in calls)
        finish = [
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        usage = chunks[-1]["usage"]
    else:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        (call,) = reply["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        arguments = call["function"]["arguments"]
        finish = [reply["choices"][0]["finish_reason"]]
        usage = reply["usage"]
    assert json.loads(arguments) == {"city": "Paris"} and finish == ["tool_calls"]
    # The echo would have run to the prompt's length; it was stopped near the repeat instead.
    assert usage["completion_tokens"] < usage["prompt_tokens"] / 2, usage
    assert _aborted(server) == aborted + 1
