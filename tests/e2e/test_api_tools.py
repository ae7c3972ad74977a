"""Tool calling over HTTP against a real server (tiny random Llama, real engine core), driven by the
official openai client: forced calls (tool_choice "required" or named) are well-formed and match
the tool's parameters, streamed as OpenAI's tool-call deltas; "auto" parses calls out of the
output; "none" renders and parses nothing; parallel_tool_calls false gives one call; tool calls and
tool results in the history render (the tiny model's template knows no tools: Hermes text).

As in test_api_structured, whitespace-only tokens are banned with logit_bias to keep the random
model's JSON short; the grammar still does the work.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from izh.config import EngineConfig
from izh.tokenizer import load_tokenizer
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 200

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The current time."}}
TOOLS: list[Any] = [WEATHER, NOW]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "now": {"type": "object", "maxProperties": 0}}
SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 99}, id="seeded"),
]
CALL_REGEX = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}\n'
    r"</tool_call>"
)
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    {"role": "user", "content": "And in Oslo?"},
]
# A template with its own tool support (Qwen's layout, shortened): tools are its to render.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for tool in tools %} {{ tool.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}CALL {{ call.function.name }} "
    "{{ call.function.arguments | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


@pytest.fixture(scope="module")
def no_whitespace(tiny_llama_dir: str) -> dict[str, int]:
    tokenizer = load_tokenizer(tiny_llama_dir)
    return {
        str(token_id): -100
        for token_id in range(tokenizer.vocab_size)
        if tokenizer.token_bytes(token_id) and not tokenizer.token_bytes(token_id).strip()
    }


def _create(client: openai.OpenAI, bias: dict[str, int], **kwargs: Any) -> Any:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": MAX_TOKENS,
        "tools": TOOLS,
        "logit_bias": bias,
        "temperature": 0.0,
    }
    return client.chat.completions.create(**{**fields, **kwargs})


def _assert_valid_calls(calls: list[Any], names: set[str] | None = None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in (names or PARAMETERS)
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


def _streamed_calls(chunks: list[Any]) -> tuple[str, dict[int, dict[str, Any]], list[str]]:
    """(content, calls by index, finish reasons) of a stream, checking OpenAI's delta sequence."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.finish_reason:
            finish.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                # The first delta of a call carries its id, type and name.
                assert delta.id and delta.id.startswith("call_") and delta.type == "function"
                assert delta.function is not None and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and (delta.function is None or delta.function.name is None)
            if delta.function is not None and delta.function.arguments:
                calls[delta.index]["arguments"] += delta.function.arguments
    return content, calls, finish


# --- forced calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_required_gives_valid_tool_calls(
    client: openai.OpenAI, no_whitespace: dict[str, int], sampling: dict[str, Any]
) -> None:
    reply = _create(client, no_whitespace, tool_choice="required", **sampling)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _assert_valid_calls(choice.message.tool_calls)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_required_streams_tool_call_deltas(
    client: openai.OpenAI, no_whitespace: dict[str, int], sampling: dict[str, Any]
) -> None:
    chunks = list(_create(client, no_whitespace, tool_choice="required", stream=True, **sampling))
    content, calls, finish = _streamed_calls(chunks)
    assert finish == ["tool_calls"]
    assert content == "" and "<tool_call>" not in content
    assert sorted(calls) == list(range(len(calls))) and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    if sampling["temperature"] == 0.0:
        whole = _create(client, no_whitespace, tool_choice="required").choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in whole] == [
            (c["name"], c["arguments"]) for c in calls.values()
        ]


def test_named_tool_choice_calls_that_tool(client: openai.OpenAI, no_whitespace: dict[str, int]) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = _create(client, no_whitespace, tool_choice=named, temperature=1.0, seed=5)
    assert reply.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls(reply.choices[0].message.tool_calls, {"get_weather"})
    parameterless = _create(
        client, no_whitespace, tool_choice={"type": "function", "function": {"name": "now"}}
    )
    calls = parameterless.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("now", "{}")]


def test_parallel_tool_calls_false_gives_exactly_one(
    client: openai.OpenAI, no_whitespace: dict[str, int]
) -> None:
    forced = _create(
        client, no_whitespace, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert len(forced.choices[0].message.tool_calls) == 1
    # Two calls in the output: both come back, unless parallel calls are off.
    two_calls = {"guided_regex": f"{CALL_REGEX}\n{CALL_REGEX}"}
    both = _create(client, {}, tool_choice="auto", extra_body=two_calls)
    assert len(both.choices[0].message.tool_calls) == 2
    one = _create(client, {}, tool_choice="auto", parallel_tool_calls=False, extra_body=two_calls)
    assert len(one.choices[0].message.tool_calls) == 1
    assert one.choices[0].message.content is None and one.choices[0].finish_reason == "tool_calls"
    chunks = list(
        _create(client, {}, tool_choice="auto", parallel_tool_calls=False, extra_body=two_calls, stream=True)
    )
    assert len(_streamed_calls(chunks)[1]) == 1


# --- auto and none ----------------------------------------------------------------------------------


def test_auto_parses_calls_out_of_the_output(client: openai.OpenAI) -> None:
    # The regex makes the random model write what a tool-calling model would: text, then a call.
    written = {"guided_regex": f"Let me check\\.\n{CALL_REGEX}"}
    reply = _create(client, {}, tool_choice="auto", extra_body=written)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    _assert_valid_calls(choice.message.tool_calls, {"get_weather"})
    content, calls, finish = _streamed_calls(list(_create(client, {}, extra_body=written, stream=True)))
    assert content == "Let me check." and finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_auto_plain_answer_has_no_tool_calls(client: openai.OpenAI) -> None:
    reply = _create(client, {}, extra_body={"guided_choice": ["It is sunny."]})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "It is sunny."
    assert not choice.message.tool_calls


def test_tool_choice_none_renders_and_parses_nothing(client: openai.OpenAI) -> None:
    written = {"guided_regex": CALL_REGEX}
    none = _create(client, {}, tool_choice="none", extra_body=written)
    auto = _create(client, {}, tool_choice="auto", extra_body=written)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == "stop"
    assert (none.choices[0].message.content or "").startswith("<tool_call>")
    assert auto.choices[0].message.tool_calls
    # The tools were not rendered into the prompt.
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens


# --- the history ------------------------------------------------------------------------------------


def _rendered(server: ApiServer, **fields: Any) -> str:
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **fields}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=60)
    prompt: str = text.json()["prompt"]
    return prompt


def test_history_with_tool_calls_renders_as_hermes_and_runs(
    server: ApiServer, client: openai.OpenAI, no_whitespace: dict[str, int]
) -> None:
    prompt = _rendered(server, messages=HISTORY, tools=TOOLS)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
        in prompt
    )
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in prompt
    # Both results in one user turn, as Hermes-trained models expect.
    assert (
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>" in prompt
    )
    assert "<|im_start|>tool" not in prompt
    # The history nearly fills the tiny model's 1024 positions: room for one short call.
    now = {"type": "function", "function": {"name": "now"}}
    reply = _create(client, no_whitespace, messages=HISTORY, tool_choice=now, max_tokens=48)
    assert reply.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls(reply.choices[0].message.tool_calls, {"now"})


def test_template_with_tool_support_renders_tools_itself(
    server: ApiServer, client: openai.OpenAI, no_whitespace: dict[str, int]
) -> None:
    prompt = _rendered(server, messages=HISTORY, tools=TOOLS, chat_template=TOOL_TEMPLATE)
    assert "TOOLS: get_weather now" in prompt and "<tools>" not in prompt
    assert 'CALL get_weather {"city": "Paris", "days": 2}' in prompt
    assert "<|im_start|>tool\nsunny, 21 C" in prompt
    reply = _create(
        client,
        no_whitespace,
        messages=HISTORY,
        tool_choice="required",
        extra_body={"chat_template": TOOL_TEMPLATE},
    )
    _assert_valid_calls(reply.choices[0].message.tool_calls)


# --- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        ({"tool_choice": "required"}, "tools", "at least one tool"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format and tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
                "tool_choice": "required",
            },
            "tools",
            "Invalid type",
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    server: ApiServer, fields: dict[str, Any], param: str, problem: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and problem in error["message"], error


# --- the real model -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_required_tool_call(smollm2_gguf: str) -> None:
    config = EngineConfig(
        model=smollm2_gguf,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 26,
    )
    with (
        api_server(config) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="x", max_retries=0, timeout=600) as client,
    ):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}],
            tools=TOOLS,
            tool_choice="required",
            # With parallel calls allowed, SmolLM2-135M repeats its call until max_tokens.
            parallel_tool_calls=False,
            max_tokens=128,
            temperature=0.0,
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls or []
    assert choice.message.content is None and len(calls) == 1
    _assert_valid_calls(calls)
