"""Request limits on raw JSON (izh.api.guard.limits), and property-based tests of the request models:
whatever a client sends, the answer is a 400 naming a field or the limit, never a crash."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
)
from izh.api.common.errors import to_izh_error
from izh.api.common.protocol import (
    PARSED_BODY,
    CompletionRequest,
    ParsedBody,
    parse_body,
)
from izh.api.guard.limits import NOT_JSON, RequestLimits, json_depth, load_json, parse_json
from izh.api.ops.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)
from izh.errors import InvalidRequest, IzhError, LimitExceeded
from izh.settings import LimitSettings

LIMITS = RequestLimits(
    LimitSettings(
        max_messages=3,
        max_prompts=2,
        max_output_tokens=50,
        max_n=4,
        max_stop=2,
        max_stop_chars=5,
        max_stop_token_ids=2,
        max_logit_bias=2,
        max_top_logprobs=5,
        max_tools=1,
        max_schema_bytes=200,
        max_schema_depth=4,
        max_regex_chars=10,
        max_grammar_chars=20,
        max_chat_template_chars=30,
        max_prompt_tokens=8,
    ),
    max_model_len=100,
    template_names=frozenset({"default", "tool_use"}),
)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_json_depth() -> None:
    assert json_depth(1, 10) == 0
    assert json_depth([], 10) == 1
    assert json_depth({"a": [1, {"b": []}], "c": 2}, 10) == 4
    assert json_depth(_nested(50), 10) == 11  # stops counting past the bound


def test_load_json_refuses_deep_bodies_and_passes_non_json_through() -> None:
    assert load_json(b'{"a": [1, 2]}', 2) == {"a": [1, 2]}
    with pytest.raises(LimitExceeded, match=r"limits\.max_json_depth"):
        load_json(json.dumps(_nested(3)).encode(), 2)
    # Far deeper than the interpreter's recursion limit: refused, not a crash.
    with pytest.raises(LimitExceeded, match="nested deeper than the limit of 64"):
        load_json(b"[" * 200_000 + b"]" * 200_000, 64)
    for junk in (b"", b"{", b"\xff\xfe", b"1" * 5000):
        assert load_json(junk, 64) is NOT_JSON


@pytest.mark.parametrize(
    ("body", "param", "setting"),
    [
        ({"messages": [{"role": "user", "content": "x"}] * 4}, "messages", "max_messages"),
        ({**CHAT, "n": 5}, "n", "max_n"),
        ({**CHAT, "max_tokens": 51}, "max_tokens", "max_output_tokens"),
        ({**CHAT, "max_completion_tokens": 51}, "max_completion_tokens", "max_output_tokens"),
        ({**CHAT, "stop": ["a", "b", "c"]}, "stop", "max_stop"),
        ({**CHAT, "stop": "toolong"}, "stop", "max_stop_chars"),
        ({**CHAT, "stop_token_ids": [1, 2, 3]}, "stop_token_ids", "max_stop_token_ids"),
        ({**CHAT, "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "max_logit_bias"),
        ({**CHAT, "top_logprobs": 6}, "top_logprobs", "max_top_logprobs"),
        ({**CHAT, "prompt_logprobs": 6}, "prompt_logprobs", "max_top_logprobs"),
        ({**CHAT, "tools": [{"type": "function"}] * 2}, "tools", "max_tools"),
        (
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(5)}}]},
            "tools.0.function.parameters",
            "max_schema_depth",
        ),
        ({**CHAT, "guided_json": {"description": "d" * 300}}, "guided_json", "max_schema_bytes"),
        ({**CHAT, "guided_json": json.dumps(_nested(6))}, "guided_json", "max_schema_depth"),
        ({**CHAT, "guided_json": "[" * 90 + "]" * 90}, "guided_json", "max_schema_depth"),
        ({**CHAT, "guided_regex": "a" * 11}, "guided_regex", "max_regex_chars"),
        ({**CHAT, "guided_grammar": "g" * 21}, "guided_grammar", "max_grammar_chars"),
        ({**CHAT, "guided_choice": ["c" * 100, "d" * 100]}, "guided_choice", "max_schema_bytes"),
        ({**CHAT, "structured_outputs": {"regex": "b" * 11}}, "structured_outputs", "max_regex_chars"),
        ({**CHAT, "structured_outputs": {"json": _nested(5)}}, "structured_outputs", "max_schema_depth"),
        (
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": _nested(5)}}},
            "response_format",
            "max_schema_depth",
        ),
        (
            {**CHAT, "response_format": {"type": "json_object", "schema": _nested(5)}},
            "response_format",
            "max_schema_depth",
        ),
    ],
)
def test_each_chat_limit_is_a_400_naming_it(body: dict[str, Any], param: str, setting: str) -> None:
    with pytest.raises(LimitExceeded) as info:
        LIMITS.check_chat(body)
    assert info.value.status_code == 400 and info.value.code == "limit_exceeded"
    assert info.value.param == param
    assert f"limits.{setting}" in info.value.message


def test_a_schema_text_too_deep_for_the_json_parser_is_refused() -> None:
    limits = RequestLimits(LimitSettings(max_schema_bytes=2**20), max_model_len=100)
    with pytest.raises(LimitExceeded, match="max_schema_depth"):
        limits.check_chat({**CHAT, "guided_json": "[" * 100_000 + "]" * 100_000})


def test_completion_limits() -> None:
    with pytest.raises(LimitExceeded, match="max_prompts") as info:
        LIMITS.check_completion({"prompt": ["a", "b", "c"]})
    assert info.value.param == "prompt"
    with pytest.raises(LimitExceeded, match="max_top_logprobs"):
        LIMITS.check_completion({"prompt": "a", "logprobs": 6})
    LIMITS.check_completion({"prompt": list(range(500))})  # one token-id prompt, not 500 prompts
    with pytest.raises(LimitExceeded, match="max_prompt_tokens") as info:
        LIMITS.check_detokenize({"tokens": list(range(9))})
    assert info.value.param == "tokens"


@pytest.mark.parametrize(
    ("body", "param", "setting"),
    [
        ({"input": [{"role": "user", "content": "x"}] * 4}, "input", "max_messages"),
        ({"input": "x", "max_output_tokens": 51}, "max_output_tokens", "max_output_tokens"),
        ({"input": "x", "top_logprobs": 6}, "top_logprobs", "max_top_logprobs"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}] * 2}, "tools", "max_tools"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": _nested(5)}]},
            "tools.0.parameters",
            "max_schema_depth",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"a": "b" * 300}}}},
            "text.format",
            "max_schema_bytes",
        ),
    ],
)
def test_each_responses_limit_is_a_400_naming_it(body: dict[str, Any], param: str, setting: str) -> None:
    check = LIMITS.checker("/v1/responses")
    assert check is not None
    with pytest.raises(LimitExceeded, match=setting) as info:
        check(body)
    assert info.value.param == param
    check({"input": [{"role": "user", "content": "x"}] * 3, "max_output_tokens": 50, "top_logprobs": 5})


def test_chat_templates_from_requests_need_trust() -> None:
    body = {**CHAT, "chat_template": "{{ messages }}"}
    with pytest.raises(InvalidRequest) as info:
        LIMITS.check_chat(body)
    assert info.value.code == "chat_template_not_allowed" and info.value.param == "chat_template"
    assert "limits.trust_request_chat_template" in info.value.message and "tool_use" in info.value.message
    with pytest.raises(InvalidRequest, match="trust_request_chat_template"):
        LIMITS.check_tokenize(body)
    LIMITS.check_chat({**CHAT, "chat_template": "tool_use"})  # the model's own, by name
    trusting = RequestLimits(LimitSettings(trust_request_chat_template=True, max_chat_template_chars=30), 100)
    trusting.check_chat(body)
    with pytest.raises(LimitExceeded, match="max_chat_template_chars"):
        trusting.check_chat({**CHAT, "chat_template": "x" * 31})


def test_at_the_limits_and_wrong_types_pass() -> None:
    LIMITS.check_chat(
        {
            "messages": [{"role": "user", "content": "x"}] * 3,
            "n": 4,
            "max_tokens": 50,
            "stop": ["abcde", "b"],
            "stop_token_ids": [1, 2],
            "logit_bias": {"1": 1, "2": 2},
            "top_logprobs": 5,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(4)}}],
            "guided_regex": "a" * 10,
        }
    )
    # Types are the route's business: it names the field in its own 400.
    LIMITS.check_chat({"messages": "hello", "n": "many", "max_tokens": 10**30 * 1.0, "stop": 5, "tools": {}})
    LIMITS.check_completion({"prompt": 5, "logprobs": True})


def test_no_output_limit_leaves_context_errors_to_the_route() -> None:
    RequestLimits(LimitSettings(), max_model_len=100).check_chat({**CHAT, "max_tokens": 10**6})


# --- property-based: the request models and the limits never crash -------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = [
    "messages", "prompt", "n", "max_tokens", "max_completion_tokens", "stop", "stop_token_ids",
    "logit_bias", "top_logprobs", "logprobs", "prompt_logprobs", "tools", "tool_choice", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "response_format",
    "chat_template", "chat_template_kwargs", "temperature", "seed", "stream", "tokens", "cache_salt",
]  # fmt: skip
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8)
MODELS: list[type[pydantic.BaseModel]] = [
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES)
def test_any_body_is_accepted_or_a_400_naming_the_problem(body: dict[str, Any]) -> None:
    for check in (LIMITS.check_chat, LIMITS.check_completion, LIMITS.check_tokenize, LIMITS.check_detokenize):
        try:
            check(body)
        except InvalidRequest as exc:
            assert exc.status_code == 400 and exc.message
    for model in MODELS:
        try:
            model.model_validate_json(json.dumps(body))
        except pydantic.ValidationError as exc:
            error = to_izh_error(exc)
            assert isinstance(error, InvalidRequest) and error.status_code == 400 and error.message


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_parse_or_are_refused_cleanly(raw: bytes) -> None:
    try:
        data = load_json(raw, 3)
    except LimitExceeded:
        return
    if data is not NOT_JSON:
        assert json_depth(data, 3) <= 3


@settings(max_examples=100, deadline=None)
@given(depth=st.integers(min_value=0, max_value=80))
def test_depth_limit_is_exact(depth: int) -> None:
    raw = json.dumps(_nested(depth)).encode()
    if depth <= 40:
        assert load_json(raw, 40) == _nested(depth)
    else:
        with pytest.raises(LimitExceeded):
            load_json(raw, 40)


# --- the body is parsed once: the guard's value validates as the bytes would -------------------------


def _validated(raw: bytes, model: type[pydantic.BaseModel], shared: Any = None) -> Any:
    """parse_body's model (as a dump) or its error (status, message, param), with or without the
    value the guard parsed in the request's state."""
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    state = {} if shared is None else {PARSED_BODY: ParsedBody(raw, shared)}
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "state": state}, receive)
    try:
        return asyncio.run(parse_body(request, model, 1 << 20)).model_dump_json()
    except IzhError as exc:
        return (exc.status_code, exc.message, exc.param)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES | JSON_VALUES)
def test_the_guards_parsed_value_validates_exactly_as_the_bytes_do(body: Any) -> None:
    raw = json.dumps(body).encode()
    value, shared = parse_json(raw, 64)
    assert shared and value == json.loads(raw)
    for model in MODELS:
        assert _validated(raw, model, shared=value) == _validated(raw, model)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": "\\ud800"}',
        "\ufeff{}".encode(),
        "{}".encode("utf-16"),
        b"[" * 300 + b"]" * 300,
        b" ",
        b"{",
    ],
)
def test_bodies_pydantic_reads_otherwise_are_not_shared(raw: bytes) -> None:
    try:
        value, shared = parse_json(raw, 1000)
    except LimitExceeded:
        return
    assert not shared and (value is NOT_JSON or value == load_json(raw, 1000))


def test_behind_the_guard_a_route_validates_the_parsed_body_without_reading_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import httpx

    from izh.api.common import protocol
    from izh.api.guard.middleware import RequestGuardMiddleware

    async def route(scope: Any, receive: Any, send: Any) -> None:
        try:
            body = await parse_body(Request(scope, receive), ChatCompletionRequest, 1 << 20)
            reply, status = body.messages[0].content, 200
        except InvalidRequest as exc:
            reply, status = exc.message, exc.status_code
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": str(reply).encode()})

    async def no_reading(*args: Any) -> bytes:
        raise AssertionError("the body was read again")

    async def post(content: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=RequestGuardMiddleware(route))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/chat/completions", content=content)

    monkeypatch.setattr(protocol, "read_body", no_reading)
    ok = asyncio.run(post(json.dumps(CHAT).encode()))
    assert (ok.status_code, ok.text) == (200, "hi")
    bad = asyncio.run(post(b'{"messages": {}}'))
    assert (bad.status_code, bad.text) == (400, "messages: Input should be a valid array")
    monkeypatch.undo()  # not JSON to pydantic: the route reads and parses the bytes itself
    refused = asyncio.run(post(b'{"messages": "\\ud800"}'))
    assert refused.status_code == 400 and "not valid JSON" in refused.text
