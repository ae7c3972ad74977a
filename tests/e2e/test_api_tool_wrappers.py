"""Tool calls written in the wrong wrapper, over HTTP on the chat route against a real server (tiny random
Llama, real engine core), streamed and not: a regex makes the random model write what small models
write (a fenced ```json call, a bare call object, `<tools>` for `<tool_call>`), and with tools offered
and tool_choice "auto" izh returns tool calls, not text; the same text with tool_choice "none", or
naming a tool not offered, stays content. (The Responses route: test_api_responses_agents.)"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server
from tests.e2e.test_api_tools import MAX_MODEL_LEN, MODEL, _create, _streamed_calls

CALL = r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}'
WRAPPED = [
    pytest.param(f"Let me check\\.\n```json\n{CALL}\n```", "Let me check.", id="fenced"),
    pytest.param(CALL, None, id="bare"),
    pytest.param(f"On it\\.\n{CALL}", "On it.", id="bare-line"),
    pytest.param(f"<tools>\n{CALL}\n</tools>", None, id="tools-tag"),
    pytest.param(f"```json\n\\[{CALL}\\]\n```", None, id="fenced-array"),
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 23,
    )
    with api_server(config) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.mark.parametrize(("regex", "content"), WRAPPED)
def test_wrapped_call_is_a_tool_call(client: openai.OpenAI, regex: str, content: str | None) -> None:
    written: dict[str, Any] = {"guided_regex": regex}
    reply = _create(client, {}, tool_choice="auto", extra_body=written)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
    streamed_content, calls, finish = _streamed_calls(
        list(_create(client, {}, extra_body=written, stream=True))
    )
    assert (streamed_content or None) == content and finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_wrapped_text_that_is_no_call_stays_content(client: openai.OpenAI) -> None:
    # tool_choice "none" parses nothing; a call to a tool not offered is not a call.
    fenced = {"guided_regex": f"```json\n{CALL}\n```"}
    none = _create(client, {}, tool_choice="none", extra_body=fenced).choices[0]
    assert none.finish_reason == "stop" and not none.message.tool_calls
    assert none.message.content.startswith('```json\n{"name": "get_weather"')
    other = {"guided_regex": '```json\n\\{"name": "get_time", "arguments": \\{\\}\\}\n```'}
    reply = _create(client, {}, tool_choice="auto", extra_body=other).choices[0]
    assert not reply.message.tool_calls
    assert reply.message.content == '```json\n{"name": "get_time", "arguments": {}}\n```'


def test_auto_runs_under_the_call_grammar(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    # The grammar's language is tests/unit/test_tool_wrappers.py's; here: the route applies it with
    # tools and tool_choice "auto", and a request's own constraint takes its place.
    caplog.set_level(logging.DEBUG, logger="izh.api.chat.routes")
    for seed in range(3):
        reply = _create(client, {}, tool_choice="auto", max_tokens=24, temperature=1.0, seed=seed).choices[0]
        assert "<tool_call>" not in (reply.message.content or "")
        for call in reply.message.tool_calls or []:
            assert call.function.name in ("get_weather", "now")
    admitted = [r.getMessage() for r in caplog.records if "chat:" in r.getMessage()]
    assert admitted and all("constraint tools" in line for line in admitted), admitted
    caplog.clear()
    _create(client, {}, tool_choice="auto", max_tokens=4, extra_body={"guided_choice": ["Sunny."]})
    (line,) = [r.getMessage() for r in caplog.records if "chat:" in r.getMessage()]
    assert "constraint guided_choice" in line
