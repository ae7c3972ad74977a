"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) against a real `izh serve` of
the default model, driven by the official `anthropic` SDK: the same greedy text as chat for the same
request, streamed (the SDK's `messages.stream` helper, and the raw event sequence) and not; a forced
tool call and the tool round trip through tool_use / tool_result blocks; stop_sequences; count_tokens
equal to the message's own input tokens; x-api-key and bearer auth; errors in Anthropic's envelope
with the SDK's exception classes. With a tiny model behind a thinking template: thinking blocks.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server
from tests.e2e.real_server import API_KEY, RealServer, serve_default_model

pytestmark = pytest.mark.slow

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": WEATHER_SCHEMA,
}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from serve_default_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: RealServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


def _text(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _raw_events(server: RealServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json={**body, "stream": True}, headers=headers, timeout=300
    ) as reply:
        assert reply.status_code == 200, reply.read()
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                payload = json.loads(line[len("data: ") :])
                assert payload["type"] == name
                events.append((name, payload))
    return events


# --- text, streamed and not -------------------------------------------------------------------------------


def test_a_message_is_the_chat_completion_of_the_same_request(
    server: RealServer, client: anthropic.Anthropic
) -> None:
    message = client.messages.create(
        model=server.model,
        system="Be brief.",
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as oai:
        chat = oai.chat.completions.create(
            model=server.model,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a color."},
            ],
            max_tokens=12,
            temperature=0,
        )
    choice = chat.choices[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == server.model
    assert _text(message) == choice.message.content
    assert chat.usage is not None
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    expected = "max_tokens" if choice.finish_reason == "length" else "end_turn"
    assert message.stop_reason == expected and message.stop_sequence is None


def test_the_stream_helper_gives_the_same_message(server: RealServer, client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 24,
        "extra_body": {"temperature": 0},
    }
    collected = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) == _text(collected)
    assert final.stop_reason == collected.stop_reason == "max_tokens"
    assert final.usage.output_tokens == collected.usage.output_tokens == 24


def test_the_raw_event_sequence(server: RealServer) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 10,
    }
    events = _raw_events(server, {**body, "temperature": 0})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(
        payload["delta"]["type"] == "text_delta" for name, payload in events if name == "content_block_delta"
    )
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10


def test_stop_sequences(server: RealServer, client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Write a sentence about cats."}],
        "max_tokens": 24,
        "extra_body": {"temperature": 0},
    }
    text = _text(client.messages.create(**body))
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    message = client.messages.create(**body, stop_sequences=[stop, "never-written-stop"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == text[: text.index(stop)]


def test_output_config_format_is_enforced(server: RealServer, client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model=server.model,
        messages=[{"role": "user", "content": "Pick a color and a count."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        max_tokens=64,
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


# --- tools ---------------------------------------------------------------------------------------------------


def test_a_tool_use_round_trip(server: RealServer, client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model=server.model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=64,
        extra_body={"temperature": 0},
    )
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert call.input == {"city": "Paris"}
    answer = client.messages.create(
        model=server.model,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
            },
        ],
        tools=[WEATHER_TOOL],
        max_tokens=64,
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason == "end_turn" and answer.content[-1].type == "text"
    assert "sunny" in _text(answer)


def test_a_streamed_tool_use(server: RealServer, client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "any"},
        "max_tokens": 64,
        "extra_body": {"temperature": 0},
    }
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    collected = client.messages.create(**body)
    assert final.stop_reason == collected.stop_reason == "tool_use"
    assert [b.type for b in final.content] == [b.type for b in collected.content]
    calls = [b for b in final.content if b.type == "tool_use"]
    assert calls and calls[0].input == {"city": "Paris"}
    raw = {key: value for key, value in body.items() if key != "extra_body"}
    events = _raw_events(server, {**raw, "temperature": 0})
    partial = "".join(
        payload["delta"]["partial_json"]
        for name, payload in events
        if name == "content_block_delta" and payload["delta"]["type"] == "input_json_delta"
    )
    starts = [payload["content_block"] for name, payload in events if name == "content_block_start"]
    assert starts[0]["type"] == "tool_use" and starts[0]["input"] == {} and starts[0]["name"] == "get_weather"
    assert json.loads(partial.split("}")[0] + "}") == {"city": "Paris"}


# --- count_tokens -----------------------------------------------------------------------------------------------


def test_count_tokens_is_the_messages_input(server: RealServer, client: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(
        model=server.model,
        system=[{"type": "text", "text": "Be brief."}],
        messages=messages,
        tools=[WEATHER_TOOL],
    )
    message = client.messages.create(
        model=server.model, system="Be brief.", messages=messages, tools=[WEATHER_TOOL], max_tokens=1
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    without_tools = client.messages.count_tokens(model=server.model, system="Be brief.", messages=messages)
    assert 0 < without_tools.input_tokens < counted.input_tokens


# --- Claude Code's requests ------------------------------------------------------------------------------------

# The Bash tool's schema as Claude Code 2.1.332 sends it (draft 2020-12, bounds, no extra properties).
BASH_TOOL: dict[str, Any] = {
    "name": "Bash",
    "description": "Executes a given bash command and returns its output.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "command": {"description": "The command to execute", "type": "string"},
            "timeout": {
                "description": "Optional timeout in milliseconds",
                "type": "number",
                "maximum": 600000,
            },
            "description": {"type": "string", "maxLength": 200},
            "run_in_background": {"type": "boolean"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}


def _claude_code_body(model: str) -> dict[str, Any]:
    """A first request of Claude Code 2.1.332 (`claude -p`, the Bash tool), its texts shortened."""
    session = {
        "device_id": "5a3d" * 16,
        "account_uuid": "",
        "session_id": "2fbcc3da-d4bb-4ac9-b67c-8ed9e8811477",
    }
    return {
        "model": model,
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.332.551; cc_entrypoint=sdk-cli;",
            },
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>\nBe careful.\n</system-reminder>\n"},
                    {"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "# Environment\n - Platform: linux"}]},
        ],
        "tools": [
            {
                "name": "DeferredToolPlaceholder",
                "description": "Deferred tools are loaded with ToolSearch.",
                "input_schema": {"type": "object", "properties": {}},
                "defer_loading": True,
            },
            BASH_TOOL,
        ],
        "metadata": {"user_id": json.dumps(session, separators=(",", ":"))},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def test_claude_codes_first_request_is_served(server: RealServer) -> None:
    """Everything Claude Code's first request carries (found by capturing it): the beta query and
    headers, system blocks with cache_control, a system turn inside `messages`, a deferred tool,
    metadata, adaptive thinking with display "omitted", context_management, output_config.effort and a
    max_tokens beyond the context (clamped: here 16 keeps the test short; the clamp has its own test)."""
    headers = {
        "authorization": f"Bearer {API_KEY}",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
        "effort-2025-11-24,advanced-tool-use-2025-11-20",
        "x-app": "cli",
    }
    body = {**_claude_code_body(server.model), "max_tokens": 16, "temperature": 0}
    url = f"{server.url}/v1/messages?beta=true"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    assert [event["type"] for event in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2]["context_management"] == {"applied_edits": []}
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    prompted = ("model", "system", "messages", "tools", "thinking", "context_management", "output_config")
    count_body = {key: value for key, value in body.items() if key in prompted}
    counted = httpx.post(
        f"{server.url}/v1/messages/count_tokens?beta=true", json=count_body, headers=headers, timeout=60
    )
    assert counted.status_code == 200, counted.text
    start = events[0]["message"]["usage"]
    assert counted.json()["input_tokens"] == start["input_tokens"] + start["cache_read_input_tokens"]
    # The deferred tool is not rendered: the prompt is the one with the Bash tool alone.
    alone = {**count_body, "tools": [BASH_TOOL]}
    recount = httpx.post(f"{server.url}/v1/messages/count_tokens", json=alone, headers=headers, timeout=60)
    assert recount.json() == counted.json()


# --- auth and errors ---------------------------------------------------------------------------------------------


def test_a_bearer_key_works_too(server: RealServer) -> None:
    with anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0) as bearer:
        message = bearer.messages.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert message.usage.output_tokens == 2


def test_errors_are_in_anthropics_envelope(server: RealServer, client: anthropic.Anthropic) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert auth.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API key"},
    }
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="claude-unknown", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert isinstance(missing.value.body, dict) and missing.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"container": "c"}, "container"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management"),
        ({"temperature": 1.5}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096}, "thinking"),
        ({"system": [{"type": "image", "source": {}}]}, "system.0.type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]},
            "messages.0.content.0.citations",
        ),
    ],
)
def test_what_izh_cannot_honour_is_a_400_naming_it(
    server: RealServer, fields: dict[str, Any], named: str
) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    body = {key: value for key, value in body.items() if value is not None}
    reply = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert reply.status_code == 400, reply.text
    payload = reply.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert named in payload["error"]["message"]


# --- thinking (a tiny model behind a thinking template) -------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config_path = Path(folder) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))
    config = EngineConfig(
        model=str(folder),
        served_model_name="tiny",
        device="cpu",
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 23,
    )
    with api_server(config, reasoning_parser="think") as started:
        yield started


def test_thinking_blocks(thinking_server: ApiServer) -> None:
    # The prompt opens <think>, which the random weights do not close in 12 tokens: all thinking.
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Think"}],
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0) as client:
        message = client.messages.create(**{**body, "max_tokens": 12, "thinking": None})
        (block,) = message.content
        assert block.type == "thinking" and block.thinking and block.signature
        assert message.stop_reason == "max_tokens"
        with client.messages.stream(**{**body, "max_tokens": 12, "thinking": None}) as stream:
            final = stream.get_final_message()
        assert final.content == message.content
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            client.messages.create(**{**body, "thinking": {"type": "enabled", "budget_tokens": 100}})


def test_max_tokens_beyond_the_context_is_clamped_to_the_room_left(thinking_server: ApiServer) -> None:
    """Agents send their model's output limit (Claude Code: 32000) whatever the context: izh clamps it to
    the room the prompt leaves, as vLLM and llama.cpp do, and a message that reaches the end of the
    context ends with Anthropic's "model_context_window_exceeded"."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello " * 970}],
        "max_tokens": 32000,
        "temperature": 0,
        "thinking": {"type": "disabled"},
    }
    counted = httpx.post(
        f"{thinking_server.url}/v1/messages/count_tokens",
        json={key: value for key, value in body.items() if key in ("model", "messages", "thinking")},
        timeout=60,
    )
    room = 1024 - counted.json()["input_tokens"]
    assert 0 < room < 64
    reply = httpx.post(f"{thinking_server.url}/v1/messages", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert message["usage"]["output_tokens"] == room
    small = httpx.post(
        f"{thinking_server.url}/v1/messages", json={**body, "max_tokens": 3}, timeout=300
    ).json()
    assert small["stop_reason"] == "max_tokens" and small["usage"]["output_tokens"] == 3
    too_long = {**body, "messages": [{"role": "user", "content": "hello " * 2000}]}
    refused = httpx.post(f"{thinking_server.url}/v1/messages", json=too_long, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


def test_omitted_thinking_travels_sealed_in_the_signature(thinking_server: ApiServer) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Think"}],
        "max_tokens": 12,
        "temperature": 0,
        "thinking": {"type": "adaptive", "display": "omitted"},
    }
    url = f"{thinking_server.url}/v1/messages"
    message = httpx.post(url, json=body, timeout=300).json()
    (block,) = message["content"]
    assert block["type"] == "thinking" and block["thinking"] == "" and block["signature"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    deltas = [event["delta"]["type"] for event in events if event["type"] == "content_block_delta"]
    assert deltas == ["signature_delta"]
    # Sent back, the block is read from its signature; a signature izh did not seal is a 400.
    turns = [
        *body["messages"],
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": "Go on"},
    ]
    again = httpx.post(url, json={**body, "messages": turns, "max_tokens": 2}, timeout=300)
    assert again.status_code == 200, again.text
    forged = [
        *body["messages"],
        {"role": "assistant", "content": [{**block, "signature": "AAAA"}]},
        turns[-1],
    ]
    refused = httpx.post(url, json={**body, "messages": forged}, timeout=60)
    assert refused.status_code == 400
    assert "messages.1.content.0.signature" in refused.json()["error"]["message"]


def test_clear_thinking_reports_the_turns_it_cleared(thinking_server: ApiServer) -> None:
    def turn(thought: str) -> dict[str, Any]:
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": "s"}]}

    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "a"},
            turn("First thoughts about a."),
            {"role": "user", "content": "b"},
            turn("Second."),
            {"role": "user", "content": "c"},
        ],
        "max_tokens": 2,
        "context_management": {
            "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]
        },
    }
    message = httpx.post(f"{thinking_server.url}/v1/messages", json=body, timeout=300).json()
    (edit,) = message["context_management"]["applied_edits"]
    assert edit["type"] == "clear_thinking_20251015" and edit["cleared_thinking_turns"] == 1
    assert edit["cleared_input_tokens"] > 0
