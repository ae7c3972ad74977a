"""Tool calling over HTTP against a real server (tiny random Llama, real engine core), driven by the
official openai client: forced calls (tool_choice "required" or named) are well-formed and match
the tool's parameters, streamed as OpenAI's tool-call deltas with the arguments in pieces; a named
tool is called once; "required" stops at a repeated call; "auto" parses calls out of the output;
"none" renders and parses nothing; parallel_tool_calls false gives one call and stops there; tool
calls and tool results in the history render (the tiny model's template knows no tools: Hermes
text). With SmolLM2 (slow): forced calls of a get_local_time-like tool end with "tool_calls" and no
repeats, streamed or not, and the OpenAI SDK's parse with a pydantic function tool.

As in test_api_structured, whitespace-only tokens are banned with logit_bias to keep the random
model's JSON short; the grammar still does the work. Banning EOS instead makes the random model go
on after its call, as a small model does: what ends the message then is izh, not the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

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
    """(content, calls by index, finish reasons) of a stream, checking OpenAI's delta sequence.

    Each call has its id, name, arguments (the fragments joined) and fragments (how many).
    """
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
                calls[delta.index] = {
                    "id": delta.id,
                    "name": delta.function.name,
                    "arguments": "",
                    "fragments": 0,
                }
            else:
                assert delta.id is None and (delta.function is None or delta.function.name is None)
            if delta.function is not None and delta.function.arguments:
                calls[delta.index]["arguments"] += delta.function.arguments
                calls[delta.index]["fragments"] += 1
    return content, calls, finish


def _eos_banned(tiny_llama_dir: str, bias: dict[str, int]) -> dict[str, int]:
    """`bias`, and every EOS token banned: the random model never ends on its own."""
    eos = load_tokenizer(tiny_llama_dir).eos_token_ids
    return {**bias, **{str(token_id): -100 for token_id in eos}}


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
    # Only get_weather, whose arguments take several tokens: which tool the random model picks
    # from both depends on the CPU's rounding, and `now`'s "{}" may come in one piece.
    tools = [WEATHER]
    chunks = list(
        _create(client, no_whitespace, tool_choice="required", tools=tools, stream=True, **sampling)
    )
    content, calls, finish = _streamed_calls(chunks)
    assert finish == ["tool_calls"]
    assert content == "" and "<tool_call>" not in content
    assert sorted(calls) == list(range(len(calls))) and calls
    for call in calls.values():
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    # The arguments arrive as they are generated, not in one piece at the end.
    assert all(call["fragments"] > 1 for call in calls.values()), calls
    if sampling["temperature"] == 0.0:
        whole = _create(client, no_whitespace, tool_choice="required", tools=tools)
        whole = whole.choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in whole] == [
            (c["name"], c["arguments"]) for c in calls.values()
        ]


def test_streamed_arguments_come_in_pieces_that_add_up(
    client: openai.OpenAI, no_whitespace: dict[str, int]
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _create(client, no_whitespace, tool_choice=named).choices[0].message.tool_calls
    chunks = list(_create(client, no_whitespace, tool_choice=named, stream=True))
    content, calls, finish = _streamed_calls(chunks)
    assert content == "" and finish == ["tool_calls"] and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", whole[0].function.arguments)
    # {"city": "...", "days": n} is several tokens: one fragment per token or so, not one in all.
    assert calls[0]["fragments"] >= 4, calls
    first = next(
        c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls
    )
    assert first.function is not None and first.function.arguments == ""


def test_named_tool_choice_calls_that_tool_once(
    client: openai.OpenAI, tiny_llama_dir: str, no_whitespace: dict[str, int]
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = _create(client, no_whitespace, tool_choice=named, temperature=1.0, seed=5)
    assert reply.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls(reply.choices[0].message.tool_calls, {"get_weather"})
    now = {"type": "function", "function": {"name": "now"}}
    parameterless = _create(client, no_whitespace, tool_choice=now)
    calls = parameterless.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("now", "{}")]
    # Exactly one call even for a model that would go on: after it, only the end is allowed.
    for parallel in (True, False):
        endless = _create(
            client, _eos_banned(tiny_llama_dir, no_whitespace), tool_choice=now, parallel_tool_calls=parallel
        )
        assert endless.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in endless.choices[0].message.tool_calls] == ["now"]


def test_required_stops_at_a_repeated_call(client: openai.OpenAI, tiny_llama_dir: str) -> None:
    """With one parameterless tool and EOS banned, the grammar lets the model only call `now` again
    and again (whitespace aside, which it may vary): izh ends the message at the first repeat."""
    fields: dict[str, Any] = {
        "tools": [NOW],
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": 11,
    }
    reply = _create(client, _eos_banned(tiny_llama_dir, {}), **fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "now" and json.loads(call.function.arguments) == {}
    # Stopped at the repeat, far from max_tokens: the engine did not generate on.
    assert reply.usage.completion_tokens < MAX_TOKENS
    chunks = list(_create(client, _eos_banned(tiny_llama_dir, {}), stream=True, **fields))
    _, calls, finish = _streamed_calls(chunks)
    assert finish == ["tool_calls"] and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("now", call.function.arguments)


def test_parallel_tool_calls_false_gives_exactly_one(
    client: openai.OpenAI, tiny_llama_dir: str, no_whitespace: dict[str, int]
) -> None:
    for bias in (no_whitespace, _eos_banned(tiny_llama_dir, no_whitespace)):
        forced = _create(
            client, bias, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=3
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
    # The generation stopped after the first call rather than writing the second one.
    assert one.usage.completion_tokens < both.usage.completion_tokens
    chunks = list(
        _create(client, {}, tool_choice="auto", parallel_tool_calls=False, extra_body=two_calls, stream=True)
    )
    _, calls, finish = _streamed_calls(chunks)
    assert len(calls) == 1 and finish == ["tool_calls"]


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

LOCAL_TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "description": "An IANA timezone, e.g. Asia/Tokyo."}},
    "required": ["timezone"],
    "additionalProperties": False,
}
LOCAL_TIME_TOOLS = {
    "timezone": {
        "type": "function",
        "function": {
            "name": "get_local_time",
            "description": "The local time in a timezone.",
            "parameters": LOCAL_TIME_PARAMETERS,
        },
    },
    "parameterless": {
        "type": "function",
        "function": {"name": "get_local_time", "description": "The current local time."},
    },
}
SMOLLM2_MAX_TOKENS = 200


class User(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def smollm2_client(smollm2_gguf: str) -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        model=smollm2_gguf,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=1024,  # 64 MiB holds one such sequence in float32 too (CPUs without bf16)
        kv_cache_memory_bytes=1 << 26,
        # A cached prefix is computed in other chunks than a fresh one, which can flip a near tie
        # between two greedy tokens: without it, streamed and whole answers are the same tokens.
        enable_prefix_caching=False,
    )
    with (
        api_server(config) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="x", max_retries=0, timeout=600) as client,
    ):
        yield client


@pytest.mark.slow
@pytest.mark.parametrize("tool", list(LOCAL_TIME_TOOLS))
@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
@pytest.mark.parametrize("parallel", [None, False], ids=["parallel-default", "parallel-false"])
def test_smollm2_forced_calls_end_with_tool_calls(
    smollm2_client: openai.OpenAI, tool: str, named: bool, parallel: bool | None
) -> None:
    """SmolLM2-135M forced to call get_local_time repeats its call until max_tokens unless izh ends
    the message: the answer is one call or more, never the same call twice, and "tool_calls"."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
        "tools": [LOCAL_TIME_TOOLS[tool]],
        "tool_choice": {"type": "function", "function": {"name": "get_local_time"}} if named else "required",
        "max_tokens": SMOLLM2_MAX_TOKENS,
        "temperature": 0.0,
    }
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    reply = smollm2_client.chat.completions.create(**fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert calls and all(name == "get_local_time" for name, _ in calls)
    assert all(calls[i] not in calls[:i] for i in range(len(calls))), calls
    if named or parallel is False:
        assert len(calls) == 1
    for _, arguments in calls:
        jsonschema.validate(arguments, LOCAL_TIME_PARAMETERS if tool == "timezone" else {"maxProperties": 0})
    chunks = list(smollm2_client.chat.completions.create(**fields, stream=True))
    content, streamed, finish = _streamed_calls(chunks)
    assert content == "" and finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    if tool == "timezone":
        assert all(c["fragments"] > 2 for c in streamed.values()), streamed


@pytest.mark.slow
def test_smollm2_openai_sdk_parse_with_a_required_pydantic_tool(smollm2_client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Extract the user from this text: Jason is 25 years old."}],
        "tools": [openai.pydantic_function_tool(User)],
        "tool_choice": "required",
        "max_tokens": SMOLLM2_MAX_TOKENS,
        "temperature": 0.0,
    }
    # parse raises LengthFinishReasonError on "length": the message must end on its own.
    completion = smollm2_client.chat.completions.parse(**fields)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "User" and isinstance(call.function.parsed_arguments, User)
    # The stream helper: argument deltas as they come, parsed at the end.
    with smollm2_client.chat.completions.stream(**fields) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 2 and final.choices[0].finish_reason == "tool_calls"
    (streamed,) = final.choices[0].message.tool_calls or []
    assert streamed.function.parsed_arguments == call.function.parsed_arguments
