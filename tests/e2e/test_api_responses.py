"""POST /v1/responses and the stored responses over HTTP against a real server (tiny random Llama, real
engine core), driven by the official openai SDK in strict response validation (every Response and
every stream event is validated against the SDK's own pydantic types).

Covered: the same greedy text as chat for the same request, streamed and not (the raw event sequence
checked against `ResponseStreamEvent` and its order, sequence numbers, deltas adding up to the done
events), the SDK's `responses.stream` helper, forced function calls and a tool round trip through
function_call / function_call_output items, structured output (`responses.parse` with a pydantic
model, json_object), previous_response_id (the same prompt as the explicit history, instructions not
carried over), GET / DELETE / input_items of stored responses, LRU eviction, per-key scoping, the
`[limits]` on `input`, metrics and the request log, reasoning items from a thinking template, and
400s naming every field izh cannot honour (the leniencies coding agents need: test_api_responses_agents). With SmolLM2 (slow): a tool round trip with a sensible
answer.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from izh.config import EngineConfig
from izh.settings import LimitSettings
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
KEY_A = "key-a-secret"
KEY_B = "key-b-secret"
STORE_MAX = 4
MAX_INPUT_ITEMS = 8
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast of a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
EVENTS = TypeAdapter(ResponseStreamEvent)
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)


def _config(model: str) -> EngineConfig:
    return EngineConfig(
        model=model, served_model_name=MODEL, device="cpu", max_model_len=1024, kv_cache_memory_bytes=1 << 23
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    limits = LimitSettings(max_messages=MAX_INPUT_ITEMS, trust_request_chat_template=True)
    with api_server(
        _config(tiny_llama_dir), api_keys=[KEY_A, KEY_B], responses_store_max=STORE_MAX, limits=limits
    ) as started:
        yield started


def _client(server: ApiServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with _client(server) as c:
        yield c


def _text(response: Response) -> str:
    return "".join(
        part.text
        for item in response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    )


def _raw_events(server: ApiServer, body: dict[str, Any], key: str = KEY_A) -> list[Any]:
    """The SSE events of a streamed response, each validated as the SDK's ResponseStreamEvent."""
    events = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={**body, "stream": True}, headers=headers, timeout=300
    ) as reply:
        assert reply.status_code == 200, reply.read()
        event_name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                event_name = line[len("event: ") :]
            elif line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[len("data: ") :])
                assert payload["type"] == event_name
                events.append(EVENTS.validate_python(payload))
    return events


def _error(reply: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _post(server: ApiServer, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        f"{server.url}/v1/responses", json={"model": MODEL, **body}, headers=headers, timeout=300
    )


class Trip(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    by_train: bool


def _trip_format() -> dict[str, Any]:
    """What the SDK sends for text_format=Trip."""
    from openai.lib._parsing._responses import type_to_text_format_param

    return dict(type_to_text_format_param(Trip))


# --- text, streamed and not -------------------------------------------------------------------------------


def test_a_response_is_the_chat_completion_of_the_same_request(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
    )
    choice = chat.choices[0]
    assert response.object == "response" and response.id.startswith("resp_")
    assert _text(response) == choice.message.content
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.completed_at is not None
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    assert response.temperature == 0 and response.store is True and response.metadata == {}


def test_the_prefix_cache_hits_show_as_cached_tokens(client: openai.OpenAI) -> None:
    long_input = "Tell me about the sea. " * 20
    first = client.responses.create(model=MODEL, input=long_input, max_output_tokens=2, temperature=0)
    second = client.responses.create(model=MODEL, input=long_input, max_output_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.input_tokens


def test_the_stream_is_openais_typed_event_sequence(server: ApiServer, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 12, "temperature": 0}
    events = _raw_events(server, body)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = events[-4]
    assert done.text == deltas
    final = events[-1].response
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and _text(final) == deltas
    assert final.output[0].id == done.item_id == events[2].item.id
    assert _text(client.responses.retrieve(final.id)) == deltas  # a streamed response is stored too
    collected = client.responses.create(**body)
    assert _text(collected) == deltas
    assert collected.usage is not None and final.usage is not None
    assert final.usage.output_tokens == collected.usage.output_tokens


def test_the_sdk_stream_helper_and_stream_true(client: openai.OpenAI) -> None:
    # The helper's final response needs response.completed: a structured answer ends on its own.
    fields: dict[str, Any] = {
        "model": MODEL,
        "input": "Plan a trip.",
        "max_output_tokens": 100,
        "temperature": 0,
    }
    with client.responses.stream(text_format=Trip, **fields) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and "response.output_text.delta" in types
    assert types[-1] == "response.completed" and isinstance(final.output_parsed, Trip)
    raw = list(client.responses.create(text={"format": _trip_format()}, stream=True, **fields))
    # Outputs that arrive together make one delta: compare the events around the deltas.
    assert [t for t in (event.type for event in raw) if not t.endswith(".delta")] == [
        t for t in types if not t.endswith(".delta")
    ]
    assert _text(raw[-1].response) == _text(final) == final.output_text


def test_logprobs_come_with_include(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)


def test_every_output_token_has_its_logprob_even_when_its_text_is_held_back(client: openai.OpenAI) -> None:
    """The tiny model's byte tokens often end mid UTF-8 character: such a token's text comes out with
    a later one, and its logprob must come with that text, not be lost (streamed or not)."""
    for seed in range(4):
        fields: dict[str, Any] = {
            "model": MODEL,
            "input": f"Tell me a story {seed}",
            "max_output_tokens": 48,
            "temperature": 1.0,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 1,
        }
        response = client.responses.create(**fields)
        assert response.usage is not None
        parts = [part for item in response.output if item.type == "message" for part in item.content]
        assert sum(len(part.logprobs or ()) for part in parts) == response.usage.output_tokens  # type: ignore[union-attr]
        streamed, final = 0, None
        for event in client.responses.create(**fields, stream=True):
            if event.type == "response.output_text.delta":
                streamed += len(event.logprobs or ())
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert final is not None and final.usage is not None
        assert streamed == final.usage.output_tokens
        done = [part for item in final.output if item.type == "message" for part in item.content]
        assert sum(len(part.logprobs or ()) for part in done) == final.usage.output_tokens  # type: ignore[union-attr]


# --- tools --------------------------------------------------------------------------------------------------


def test_a_forced_call_is_a_function_call_item(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert response.tools[0].type == "function" and response.tool_choice == "required"
    assert response.parallel_tool_calls is False


def test_streamed_call_arguments_add_up(server: ApiServer) -> None:
    body = {
        "model": MODEL,
        "input": "Weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    events = _raw_events(server, body)
    added = [event for event in events if event.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call" and added[0].item.arguments == ""
    deltas = "".join(
        event.delta for event in events if event.type == "response.function_call_arguments.delta"
    )
    (done,) = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and done.name == "get_weather"
    jsonschema.validate(json.loads(deltas), WEATHER_PARAMETERS)
    final = events[-1].response
    assert final.status == "completed" and final.output[0].arguments == deltas


def test_a_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    # The explicit history and the chained one render the same prompt.
    explicit = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(), output],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[output],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    assert explicit.usage is not None and chained.usage is not None and first.usage is not None
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert _text(chained) == _text(explicit)
    items = client.responses.input_items.list(chained.id, order="asc")
    assert [item.type for item in items.data] == ["function_call_output"]


# --- structured output ------------------------------------------------------------------------------------


def test_parse_with_a_pydantic_text_format(client: openai.OpenAI) -> None:
    response = client.responses.parse(
        model=MODEL, input="Plan a trip.", text_format=Trip, max_output_tokens=100, temperature=0
    )
    assert response.status == "completed", response.output
    assert isinstance(response.output_parsed, Trip)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_json_object_format(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="JSON please",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    text = _text(response)
    if response.status == "completed":
        assert isinstance(json.loads(text), dict)
    else:  # cut off by max_output_tokens: still the start of an object
        assert text.lstrip().startswith("{")


# --- stored responses ---------------------------------------------------------------------------------------


def test_previous_response_id_continues_without_its_instructions(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        input="First question",
        instructions="Answer in French.",
        max_output_tokens=5,
        temperature=0,
    )
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="Second question",
        max_output_tokens=5,
        temperature=0,
    )
    explicit = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": _text(first)},
            {"role": "user", "content": "Second question"},
        ],
        max_output_tokens=5,
        temperature=0,
    )
    assert chained.usage is not None and explicit.usage is not None
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert _text(chained) == _text(explicit)
    assert chained.previous_response_id == first.id and chained.instructions is None


def test_get_delete_and_input_items_of_a_stored_response(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Be kind."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        metadata={"ticket": "42"},
        max_output_tokens=3,
        temperature=0,
    )
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    assert fetched.metadata == {"ticket": "42"}
    items = client.responses.input_items.list(created.id)
    assert [(item.type, item.role) for item in items.data] == [("message", "user"), ("message", "developer")]  # type: ignore[union-attr]
    page = client.responses.input_items.list(created.id, order="asc", limit=1)
    assert page.has_more and page.data[0].role == "developer"  # type: ignore[union-attr]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_store_evicts_the_least_recently_used(client: openai.OpenAI) -> None:
    ids = [
        client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id for i in range(STORE_MAX)
    ]
    client.responses.retrieve(ids[0])  # now the most recently used
    client.responses.create(model=MODEL, input="one more", max_output_tokens=1)
    client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in ids[2:]:
        client.responses.retrieve(kept)


def test_a_key_never_sees_another_keys_responses(server: ApiServer, client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="private", max_output_tokens=1)
    with _client(server, KEY_B) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(
                model=MODEL, input="x", previous_response_id=created.id, max_output_tokens=1
            )
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(created.id)
    assert client.responses.retrieve(created.id).id == created.id


def test_unknown_ids_are_404s_in_openais_format(server: ApiServer) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    error = _error(httpx.get(f"{server.url}/v1/responses/resp_nope", headers=headers), 404)
    assert "resp_nope" in error["message"]
    error = _error(_post(server, {"input": "x", "previous_response_id": "resp_nope"}), 404)
    assert error["param"] == "previous_response_id"
    _error(httpx.delete(f"{server.url}/v1/responses/resp_nope", headers=headers), 404)
    _error(httpx.get(f"{server.url}/v1/responses/resp_nope/input_items", headers=headers), 404)


# --- refusals -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "namespace", "name": "ns"}]}, "tools.0"),
        (
            {"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
            "tools.0.tools.0.type",
        ),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include.0"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"service_tier": "gold"}, "service_tier"),
        (
            {"input": [{"type": "reasoning", "encrypted_content": "forged", "summary": []}]},
            "input.0.encrypted_content",
        ),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
            "text.format",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        (
            # A text-only model: the image part is named.
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.image_url",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_logprobs": 99}, "top_logprobs"),
        ({"input": "word " * 2000}, "input"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}, "input"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
    ],
)
def test_what_izh_cannot_honour_is_a_400_naming_the_field(
    server: ApiServer, fields: dict[str, Any], param: str
) -> None:
    error = _error(_post(server, {"input": "Hi", "max_output_tokens": 4, **fields}))
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_a_context_overflow_names_the_input(server: ApiServer) -> None:
    error = _error(_post(server, {"input": "word " * 2000}))
    assert error["code"] == "context_length_exceeded" and "input" in error["message"]


# --- metrics and logs ---------------------------------------------------------------------------------------


def test_metrics_and_the_request_log_cover_the_endpoint(
    server: ApiServer, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="izh.request")
    response = client.responses.create(model=MODEL, input="Count me", max_output_tokens=3, temperature=0)

    def logged() -> list[dict[str, Any]]:
        lines = [r.fields for r in caplog.records if r.name == "izh.request" and hasattr(r, "fields")]
        return [line for line in lines if line["path"] == "/v1/responses"]

    # The line is written once the response is out, so the client can see the response first.
    deadline = time.monotonic() + 30
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.01)
    (line,) = logged()
    assert response.usage is not None
    assert line["prompt_tokens"] == response.usage.input_tokens
    assert line["completion_tokens"] == response.usage.output_tokens
    metrics = httpx.get(f"{server.url}/metrics").text
    sample = f'izh:api_requests_total{{endpoint="/v1/responses",engine="0",model_name="{MODEL}"}} '
    (value,) = [line for line in metrics.splitlines() if line.startswith(sample)]
    assert float(value.split()[-1]) >= 1


# --- reasoning ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config_path = Path(folder) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))
    with api_server(_config(str(folder)), reasoning_parser="think") as started:
        yield started


def test_thinking_is_a_reasoning_item(thinking_server: ApiServer) -> None:
    # The prompt opens <think>, which the random weights do not close in 12 tokens: all reasoning.
    body = {"model": MODEL, "input": "Think", "max_output_tokens": 12, "temperature": 0}
    with _client(thinking_server) as client:
        response = client.responses.create(**body)
    (item,) = response.output
    assert item.type == "reasoning" and item.content and item.content[0].text
    assert response.status == "incomplete" and item.status == "incomplete"
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    events = _raw_events(thinking_server, body)
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    (done,) = [event for event in events if event.type == "response.reasoning_text.done"]
    assert done.text == deltas == item.content[0].text
    (part,) = [event for event in events if event.type == "response.content_part.added"]
    assert part.part.type == "reasoning_text"


# --- the real model ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tool_round_trip(smollm2_gguf: str) -> None:
    city_tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    config = EngineConfig(
        model=smollm2_gguf,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 27,
    )
    with api_server(config) as started, _client(started, "unused") as client:
        first = client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[city_tool],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=64,
            temperature=0,
        )
        (call,) = first.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
        answer = client.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
            tools=[city_tool],  # type: ignore[list-item]
            max_output_tokens=64,
            temperature=0,
        )
    # The model ends its turn on its own, with the tool's result in its answer.
    assert answer.status == "completed" and answer.output[-1].type == "message"
    assert "sunny" in answer.output_text
