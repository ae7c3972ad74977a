"""The OpenAI request/response models: what the official client sends parses, bad input is a 400
that names its field, and the one exception mapping gives every error its status and envelope."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import llguidance
import openai
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from izh.api.chat.choices import ChoiceParsers
from izh.api.chat.prompt import supports_tools, template_messages, with_tools_prompt
from izh.api.chat.stream import stream_deltas
from izh.api.common.chat_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageParam,
    ChatStreamChoice,
    DeltaMessage,
    NamedToolChoice,
)
from izh.api.common.constraints import (
    Constraint,
    answer_only,
    rename_lark_rule,
    requested_constraints,
    single_constraint,
)
from izh.api.common.errors import to_izh_error
from izh.api.common.protocol import (
    CompletionRequest,
    parse_body,
)
from izh.api.common.sampling import build_sampling_params, resolve_max_tokens, sampling_defaults
from izh.errors import InvalidRequest, IzhError, ModelNotFound, PayloadTooLarge
from izh.guided_spec import compile_grammar, validate_spec
from izh.parsers.hermes import HermesToolParser
from izh.parsers.reasoning import ThinkReasoningParser
from izh.parsers.tool_calls import ContentDelta, ToolCallDelta, collect
from izh.parsers.tool_grammar import tool_call_grammar
from izh.sampling_params import StructuredOutputsParams

# --- what the official client sends -------------------------------------------------------------


def _captured_bodies(call: Any) -> list[dict[str, Any]]:
    """The JSON bodies the openai client sends for `call(client)`, answered with a canned reply."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(
            400, json={"error": {"message": "captured", "type": "x", "param": None, "code": None}}
        )

    client = openai.OpenAI(
        api_key="k",
        base_url="http://test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    with pytest.raises(openai.BadRequestError):
        call(client)
    return bodies


def test_chat_request_accepts_what_the_openai_client_sends() -> None:
    bodies = _captured_bodies(
        lambda c: c.chat.completions.create(
            model="m",
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            tool_choice="auto",
            logprobs=True,
            top_logprobs=3,
            logit_bias={"50": -100},
            max_completion_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            seed=3,
            stop=["\n"],
            store=False,
            metadata={"k": "v"},
            extra_body={"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}},
        )
    )
    body = ChatCompletionRequest.model_validate(bodies[0])
    assert [m.role for m in body.messages] == ["developer", "user", "assistant", "tool"]
    assert body.messages[2].tool_calls is not None and body.messages[2].tool_calls[0].function.name == "f"
    assert body.top_logprobs == 3 and body.logprobs and body.max_completion_tokens == 7
    assert body.stream and body.stream_options is not None and body.stream_options.include_usage
    assert body.top_k == 5 and body.chat_template_kwargs == {"enable_thinking": False}
    assert body.logit_bias == {"50": -100}


def test_completion_request_accepts_every_prompt_shape() -> None:
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        bodies = _captured_bodies(
            lambda c, p=prompt: c.completions.create(model="m", prompt=p, n=2, echo=True, logprobs=2)
        )
        body = CompletionRequest.model_validate(bodies[0])
        assert body.prompt == prompt and body.n == 2 and body.echo and body.logprobs == 2
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16


# --- bad bodies are 400s naming the field ---------------------------------------------------------


def _request(body: bytes) -> Request:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def _parse(body: bytes | dict[str, Any], model: Any = ChatCompletionRequest, limit: int = 1 << 20) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(parse_body(_request(raw), model, limit))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": [1]}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "perhaps"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": "big"}}, "logit_bias.1"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_json": 1}, "guided_json"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": 1}},
            "response_format.type",
        ),
    ],
)
def test_wrong_types_are_invalid_requests_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _parse(body)
    assert info.value.status_code == 400 and info.value.param == param


def test_malformed_json_empty_and_oversized_bodies() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        _parse(b'{"messages": [')
    with pytest.raises(InvalidRequest, match="empty"):
        _parse(b"  ")
    with pytest.raises(PayloadTooLarge) as info:
        _parse({"messages": [{"role": "user", "content": "x" * 100}]}, limit=50)
    assert info.value.status_code == 413


def test_unknown_fields_are_ignored() -> None:
    body = _parse({"messages": [{"role": "user", "content": "x", "extra": 1}], "service_tier": "auto"})
    assert body.messages[0].content == "x"


# --- the one mapping ----------------------------------------------------------------------------------


def test_to_izh_error_maps_every_kind_of_exception() -> None:
    izh = ModelNotFound("no such model", param="model")
    assert to_izh_error(izh) is izh
    validation = to_izh_error(
        RequestValidationError([{"loc": ("body", "n"), "msg": "bad", "type": "int_parsing"}])
    )
    assert (validation.status_code, validation.param) == (400, "n")
    assert to_izh_error(HTTPException(404)).status_code == 404
    method = to_izh_error(HTTPException(405, "Method Not Allowed"))
    assert (method.status_code, method.error_type) == (405, "invalid_request_error")
    unexpected = to_izh_error(RuntimeError("secret internals"))
    assert unexpected.status_code == 500 and "secret" not in unexpected.message
    assert set(unexpected.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_stream_delta_sends_only_what_it_carries() -> None:
    chunk = ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content="hi"))],
    )
    data = json.loads(chunk.model_dump_json())
    assert data["choices"][0] == {
        "index": 0,
        "delta": {"content": "hi"},
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }
    assert data["object"] == "chat.completion.chunk" and data["usage"] is None
    assert json.loads(DeltaMessage(role="assistant", content="").model_dump_json()) == {
        "role": "assistant",
        "content": "",
    }


# --- sampling params and defaults --------------------------------------------------------------------


def test_generation_config_gives_defaults_the_request_overrides() -> None:
    defaults = sampling_defaults(
        {"temperature": 0.6, "top_k": 20, "max_new_tokens": 99, "do_sample": True, "top_p": "x"}
    )
    assert defaults == {"temperature": 0.6, "top_k": 20, "max_tokens": 99}
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "top_k": 5, "logit_bias": {"7": 1.5}, "stop": "END"}
    )
    params = build_sampling_params(body, defaults, max_tokens=10, logprobs=None, prompt_logprobs=None)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 5, 10)
    assert params.logit_bias == {7: 1.5} and params.stop == ["END"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("n", 0),
        ("n", 10**9),
        ("seed", 2**70),
        ("logit_bias", {"x": 1}),
    ],
)
def test_bad_sampling_values_name_their_field(field: str, value: Any) -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], field: value}
    )
    with pytest.raises(InvalidRequest) as info:
        build_sampling_params(body, {}, max_tokens=10, logprobs=None, prompt_logprobs=None)
    assert info.value.param == field


def test_max_tokens_policy_passes_explicit_values_and_clamps_defaults() -> None:
    # The context length itself is the input processor's check (tests/engine/test_input_processor.py).
    assert resolve_max_tokens(None, explicit=False, default=None, room=10) is None  # all the room
    assert resolve_max_tokens(None, explicit=False, default=4, room=10) == 4
    assert resolve_max_tokens(16, explicit=False, default=None, room=10) == 10  # a default clamps
    assert resolve_max_tokens(11, explicit=True, default=None, room=10) == 11  # refused on admission
    # No room: None, which the input processor refuses with the numbers.
    assert resolve_max_tokens(16, explicit=False, default=4, room=0) is None
    # A count below 1 is not a context problem: it is refused by name.
    for requested in (-1, 0):
        with pytest.raises(InvalidRequest, match="max_tokens must be >= 1") as refused:
            resolve_max_tokens(requested, explicit=True, default=None, room=10)
        assert refused.value.param == "max_tokens"
    # 0 where the route scores prompts; a negative count still is not.
    assert resolve_max_tokens(0, explicit=True, default=None, room=0, allow_prompt_only=True) == 0
    with pytest.raises(InvalidRequest):
        resolve_max_tokens(-1, explicit=True, default=None, room=10, allow_prompt_only=True)


def test_izh_error_envelope_has_the_openai_shape() -> None:
    err = IzhError("boom")
    assert err.to_dict() == {
        "error": {"message": "boom", "type": "internal_error", "param": None, "code": None}
    }


# --- the request guard middleware ---------------------------------------------------------------------


def _guarded(app: Any, **kwargs: Any) -> httpx.AsyncClient:
    from izh.api.guard.middleware import RequestGuardMiddleware

    options: dict[str, Any] = {"api_keys": [], "public_paths": frozenset({"/health"}), "max_body_bytes": 100}
    guard = RequestGuardMiddleware(app, **{**options, **kwargs})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t")


async def _echo_request_id(scope: Any, receive: Any, send: Any) -> None:
    body = json.dumps({"request_id": scope["state"]["request_id"]}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


def test_guard_turns_an_escaped_exception_into_a_500_envelope() -> None:
    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("database password is hunter2")

    async def body() -> httpx.Response:
        async with _guarded(broken) as client:
            return await client.get("/x")

    reply = asyncio.run(body())
    assert reply.status_code == 500 and reply.headers["x-request-id"]
    assert reply.json()["error"]["type"] == "internal_error" and "hunter2" not in reply.text


def test_guard_request_ids_are_echoed_sanitized_and_unique_inside() -> None:
    async def body() -> list[httpx.Response]:
        async with _guarded(_echo_request_id) as client:
            return [
                await client.get("/x", headers={"X-Request-Id": "trace 42<script>"}),
                await client.get("/x", headers={"X-Request-Id": "trace 42<script>"}),
                await client.get("/x", headers={"X-Request-Id": "a" * 500}),
                await client.get("/x"),
            ]

    same1, same2, long, made = asyncio.run(body())
    assert same1.headers["x-request-id"] == same2.headers["x-request-id"] == "trace42script"
    internal1, internal2 = same1.json()["request_id"], same2.json()["request_id"]
    assert internal1.startswith("trace42script-") and internal1 != internal2
    assert long.headers["x-request-id"] == "a" * 64
    assert made.headers["x-request-id"] == made.json()["request_id"]


def test_guard_checks_keys_and_declared_body_size() -> None:
    async def body() -> dict[str, httpx.Response]:
        async with _guarded(_echo_request_id, api_keys=["k1", "k2"]) as client:
            return {
                "missing": await client.get("/x"),
                "wrong": await client.get("/x", headers={"Authorization": "Bearer k3"}),
                "basic": await client.get("/x", headers={"Authorization": "Basic k1"}),
                "bearer": await client.get("/x", headers={"Authorization": "Bearer k2"}),
                "x-api-key": await client.get("/x", headers={"x-api-key": "k1"}),
                "public": await client.get("/health"),
                "too-big": await client.post("/x", content=b"x" * 101, headers={"x-api-key": "k1"}),
            }

    replies = asyncio.run(body())
    assert (
        replies["missing"].status_code == 401 and replies["missing"].headers["www-authenticate"] == "Bearer"
    )
    assert replies["missing"].json()["error"]["code"] == "missing_api_key"
    assert replies["wrong"].json()["error"] == {
        "message": "Invalid API key",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert replies["basic"].status_code == 401
    assert (
        replies["bearer"].status_code
        == replies["x-api-key"].status_code
        == replies["public"].status_code
        == 200
    )
    assert replies["too-big"].status_code == 413


# --- structured outputs: what a request asks for ---------------------------------------------------


def _chat_body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_openai_client_response_format_and_tools_parse() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    bodies = _captured_bodies(
        lambda c: c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema, "strict": True},
            },
            tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            parallel_tool_calls=False,
        )
    )
    body = ChatCompletionRequest.model_validate(bodies[0])
    assert body.response_format is not None and body.response_format.json_schema is not None
    assert body.response_format.json_schema.schema_ == schema and body.response_format.json_schema.strict
    assert isinstance(body.tool_choice, NamedToolChoice) and body.tool_choice.function.name == "f"
    assert body.parallel_tool_calls is False
    [constraint] = requested_constraints(body)
    assert constraint.param == "response_format" and json.loads(constraint.spec.json or "") == schema


@pytest.mark.parametrize(
    ("fields", "param", "expected"),
    [
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            StructuredOutputsParams(json_object=True),
        ),
        (
            {"response_format": {"type": "json_object", "schema": {"type": "array"}}},
            "response_format",
            StructuredOutputsParams(json='{"type": "array"}'),
        ),
        (
            {"structured_outputs": {"json": {"type": "string"}}},
            "structured_outputs",
            StructuredOutputsParams(json='{"type": "string"}'),
        ),
        (
            {"structured_outputs": {"json": '{"type":"string"}'}},
            "structured_outputs",
            StructuredOutputsParams(json='{"type":"string"}'),
        ),
        (
            {"structured_outputs": {"regex": "a+", "backend": "xgrammar"}},
            "structured_outputs",
            StructuredOutputsParams(regex="a+"),
        ),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            "structured_outputs",
            StructuredOutputsParams(choice=["a", "b"]),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            "structured_outputs",
            StructuredOutputsParams(json_object=True),
        ),
        ({"guided_json": True}, "guided_json", StructuredOutputsParams(json="true")),
        ({"guided_regex": "[0-9]"}, "guided_regex", StructuredOutputsParams(regex="[0-9]")),
        ({"guided_choice": ["x"]}, "guided_choice", StructuredOutputsParams(choice=["x"])),
        ({"guided_grammar": "start: /a/"}, "guided_grammar", StructuredOutputsParams(grammar="start: /a/")),
    ],
)
def test_every_way_to_ask_for_a_constraint(
    fields: dict[str, Any], param: str, expected: StructuredOutputsParams
) -> None:
    constraint = single_constraint(requested_constraints(_chat_body(**fields)))
    assert constraint is not None and constraint.param == param and constraint.spec == expected


def test_no_constraint_and_text_format() -> None:
    assert requested_constraints(_chat_body()) == []
    assert requested_constraints(_chat_body(response_format={"type": "text"})) == []
    completion = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a"})
    assert [c.param for c in requested_constraints(completion)] == ["guided_regex"]


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        ({"response_format": {"type": "regex"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_choice": []}, "guided_choice", "guided_choice.choice"),
        ({"guided_json": "[1,"}, "guided_json", "not valid JSON"),
    ],
)
def test_bad_constraint_requests_name_their_field(fields: dict[str, Any], param: str, problem: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        requested_constraints(_chat_body(**fields))
    assert info.value.param == param and problem in info.value.message


def test_two_constraints_at_once_are_refused() -> None:
    constraints = requested_constraints(_chat_body(guided_regex="a", structured_outputs={"choice": ["a"]}))
    with pytest.raises(InvalidRequest, match="structured_outputs and guided_regex"):
        single_constraint(constraints)


# --- constraining only the answer of a reasoning model ---------------------------------------------

_EOS = 256


class _ByteTokenizer:
    """One token per byte plus EOS: a matcher over it accepts exactly the grammar's strings."""

    def __init__(self) -> None:
        self.eos_token_id = _EOS
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [_EOS]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def _accepts(tokenizer: llguidance.LLTokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    validate_spec(spec, tokenizer)
    matcher = llguidance.LLMatcher(tokenizer, compile_grammar(spec), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


_SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false}'


def test_answer_only_leaves_an_open_think_block_free(ll_tokenizer: llguidance.LLTokenizer) -> None:
    spec = answer_only(Constraint(StructuredOutputsParams(json=_SCHEMA), "p"), in_reasoning=True).spec
    assert _accepts(ll_tokenizer, spec, 'free {"text"}\n</think>\n\n{"a": 1}')
    assert _accepts(ll_tokenizer, spec, '</think>{"a":2}')
    assert not _accepts(ll_tokenizer, spec, '{"a": 1}')  # the reasoning must close first
    assert not _accepts(ll_tokenizer, spec, "thinking</think>not json")
    assert not _accepts(ll_tokenizer, spec, 'a</think>b</think>{"a": 1}')  # one think block


def test_answer_only_allows_an_optional_think_block(ll_tokenizer: llguidance.LLTokenizer) -> None:
    spec = answer_only(Constraint(StructuredOutputsParams(json=_SCHEMA), "p"), in_reasoning=False).spec
    assert _accepts(ll_tokenizer, spec, '{"a": 1}')
    assert _accepts(ll_tokenizer, spec, '\n<think>\nhmm\n</think>\n{"a": 1}')
    assert not _accepts(ll_tokenizer, spec, 'hmm</think>{"a": 1}')
    assert not _accepts(ll_tokenizer, spec, "<think>hmm</think>nope")


def test_answer_only_keeps_the_schema_strict(ll_tokenizer: llguidance.LLTokenizer) -> None:
    unenforceable = StructuredOutputsParams(json='{"type": "object", "if": {}}')
    with pytest.raises(InvalidRequest, match="if"):
        validate_spec(answer_only(Constraint(unenforceable, "p"), in_reasoning=True).spec, ll_tokenizer)


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (StructuredOutputsParams(regex="a/b[0-9]{2}"), "a/b12", "a/b1"),
        (StructuredOutputsParams(choice=["yes", 'say "hi"']), 'say "hi"', "ye"),
        (StructuredOutputsParams(json_object=True), '{"k": [1]}', "[1]"),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9]+'), "x42", "x"),
        (StructuredOutputsParams(grammar='start: item+\nitem: "start" | "s"  // start\n'), "startss", "st"),
    ],
)
def test_answer_only_wraps_every_kind_of_spec(
    ll_tokenizer: llguidance.LLTokenizer, spec: StructuredOutputsParams, good: str, bad: str
) -> None:
    wrapped = answer_only(Constraint(spec, "p"), in_reasoning=True).spec
    assert _accepts(ll_tokenizer, wrapped, f"r</think>{good}")
    assert not _accepts(ll_tokenizer, wrapped, f"r</think>{bad}")


def test_forced_tool_calls_follow_the_reasoning(ll_tokenizer: llguidance.LLTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "now"}}]
    spec = tool_call_grammar(tools, "required", False)
    assert spec is not None
    wrapped = answer_only(Constraint(spec, "tool_choice"), in_reasoning=False).spec
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert _accepts(ll_tokenizer, wrapped, f"<think>which tool?</think>\n{call}")
    assert _accepts(ll_tokenizer, wrapped, call)
    assert not _accepts(ll_tokenizer, wrapped, "<think>x</think>no call")


def test_rename_lark_rule_touches_only_names() -> None:
    grammar = (
        'start: "start" /start\\/x/ start_2 <start_of_turn>  # start\n'
        "start_2: start | item-start // start\n"
        '%json {"start": 1}\n'
    )
    assert rename_lark_rule(grammar, "start", "top") == (
        'top: "start" /start\\/x/ start_2 <start_of_turn>  # start\n'
        "start_2: top | item-start // start\n"
        '%json {"start": 1}\n'
    )


# --- tools in the prompt and in the output ----------------------------------------------------------


def _messages(*items: dict[str, Any]) -> list[ChatMessageParam]:
    return [ChatMessageParam.model_validate(item) for item in items]


def test_tool_history_as_hermes_text() -> None:
    messages = _messages(
        {"role": "developer", "content": "Be brief."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "g"}}]},
    )
    native = template_messages(messages)
    assert native[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}
    ]
    assert [m["role"] for m in native] == ["system", "assistant", "tool", "tool", "assistant"]
    hermes = template_messages(messages, hermes_tools=True)
    assert hermes == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "assistant",
            "content": 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>",
        },
        {"role": "assistant", "content": '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'},
    ]
    with_prompt = with_tools_prompt(hermes, "TOOLS")
    assert (
        with_prompt[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
        and hermes[0]["content"] == "Be brief."
    )
    assert with_tools_prompt(hermes[1:], "TOOLS")[0] == {"role": "system", "content": "TOOLS"}
    assert supports_tools("{% for tool in tools %}{% endfor %}") and not supports_tools("{{ messages }}")


def test_choice_parsers_split_reasoning_content_and_calls() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"<think>plan</think>Sure.\n{call}\n{call}"
    parsers = ChoiceParsers(reasoning=ThinkReasoningParser(), tools=HermesToolParser())
    pieces = [parsers.feed(text[i : i + 5], finished=i + 5 >= len(text)) for i in range(0, len(text), 5)]
    reasoning = "".join(piece[0] for piece in pieces)
    content, calls = collect([delta for piece in pieces for delta in piece[1]])
    assert reasoning == "plan" and content == "Sure."
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')] * 2
    assert parsers.finish_reason("stop") == "tool_calls" and parsers.finish_reason("length") == "length"
    one = ChoiceParsers(reasoning=None, tools=HermesToolParser(), forced=True, max_calls=1)
    _, deltas = one.feed(f'{call}\n{call}\n<tool_call>\n{{"na', finished=True)
    content, calls = collect(deltas)
    assert content is None and len(calls) == 1  # the cut-off block is not shown as content
    plain = ChoiceParsers(reasoning=None, tools=None)
    assert (
        plain.feed("hi", finished=True) == ("", [ContentDelta("hi")])
        and plain.finish_reason("stop") == "stop"
    )


def test_tool_call_stream_deltas_carry_only_what_they_must() -> None:
    messages = stream_deltas(
        "why",
        [
            ContentDelta("a"),
            ContentDelta("b"),
            ToolCallDelta(0, id="call_1", type="function", name="f"),
            ToolCallDelta(0, arguments='{"x": 1}'),
            ContentDelta("c"),
        ],
    )
    dumped = [json.loads(m.model_dump_json()) for m in messages]
    assert dumped == [
        {"content": "ab", "reasoning_content": "why", "reasoning": "why"},
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]},
        {"content": "c"},
    ]
    assert stream_deltas("", []) == []
