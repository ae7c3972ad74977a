"""Bad requests against a real server: every refusal is OpenAI's envelope with the right status,
and the server stays healthy. Also API keys, CORS and draining."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
MAX_MODEL_LEN = 128
KEYS = ["sekret-1", "sekret-2"]
ORIGIN = "http://dashboard.example"


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 22,
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    with api_server(_config(tiny_llama_dir), max_body_bytes=1 << 20) as started:
        yield started


@pytest.fixture(scope="module")
def secured(tiny_llama_dir: str) -> Iterator[ApiServer]:
    with api_server(
        _config(tiny_llama_dir), api_keys=KEYS, metrics_require_auth=True, allowed_origins=[ORIGIN]
    ) as started:
        yield started


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


def _assert_healthy(server: ApiServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(), timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"


# --- malformed bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens="many"), "max_tokens"),
        (_chat(max_tokens=-5), "max_tokens"),
        (_chat(max_tokens=10**30), "max_tokens"),
        (_chat(n=10**9), "n"),
        (_chat(temperature=1e308), "temperature"),
        (_chat(seed=10**40), "seed"),
        (_chat(top_k=10**30), "top_k"),
        (_chat(priority=-(10**30)), "priority"),
        (_chat(stop_token_ids=[10**6]), "stop_token_ids"),
        (_chat(logit_bias={"not-a-token": 1}), "logit_bias"),
        (_chat(top_logprobs=3), "top_logprobs"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hello"}, "messages"),
        ({"model": MODEL}, "messages"),
        (
            # A text-only model: the image part is named.
            _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages.0.content.0.image_url",
        ),
    ],
)
def test_bad_chat_fields_are_400s_naming_the_field(
    server: ApiServer, body: dict[str, Any], param: str
) -> None:
    error = _error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [1, 10**6]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": MODEL, "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": MODEL, "prompt": 5}, "prompt"),
    ],
)
def test_bad_completion_fields_are_400s(server: ApiServer, body: dict[str, Any], param: str) -> None:
    error = _error(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["param"] == param


def test_malformed_json_and_empty_body(server: ApiServer) -> None:
    for content in (b'{"model": "tiny", "messages": [', b"", b"[1, 2]", b"\xff\xfe"):
        reply = httpx.post(
            f"{server.url}/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        assert _error(reply, 400)["type"] == "invalid_request_error"
    _assert_healthy(server)


def test_a_10_mb_body_is_refused(server: ApiServer) -> None:
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    declared = httpx.post(
        f"{server.url}/v1/completions", content=huge, headers={"content-type": "application/json"}
    )
    assert _error(declared, 413)["code"] == "payload_too_large"

    def chunks() -> Iterator[bytes]:
        # No Content-Length (chunked): the server must count what arrives and stop at the limit.
        for start in range(0, len(huge), 1 << 16):
            yield huge[start : start + (1 << 16)]

    try:
        streamed = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    except httpx.HTTPError:
        pass  # the server may answer and close before the upload is over; it refused either way
    else:
        assert _error(streamed, 413)["code"] == "payload_too_large"
    _assert_healthy(server)


def test_unknown_model_and_routes(server: ApiServer) -> None:
    error = _error(httpx.post(f"{server.url}/v1/chat/completions", json=_chat(model="gpt-9")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert _error(httpx.get(f"{server.url}/v1/nothing-here"), 404)["type"] == "not_found_error"
    _error(httpx.get(f"{server.url}/v1/chat/completions"), 405)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        assert info.value.code == "model_not_found"


def test_context_overflow_says_the_numbers(server: ApiServer) -> None:
    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    error = _error(
        httpx.post(
            f"{server.url}/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": long_text}])
        ),
        400,
    )
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    assert error["param"] == "messages" and error["message"].endswith("length of the messages.")
    # A batch names the prompt that does not fit; the one admitted before it is aborted.
    batch = {"model": MODEL, "prompt": ["Hi", long_text], "max_tokens": 2}
    error = _error(httpx.post(f"{server.url}/v1/completions", json=batch), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt.1"
    assert "length of the prompt.1" in error["message"]
    error = _error(
        httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 500}),
        400,
    )
    assert error["code"] == "context_length_exceeded" and "500" in error["message"]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=long_text)
        assert info.value.code == "context_length_exceeded"
    _assert_healthy(server)


def test_draining_refuses_new_work_with_retry_after(server: ApiServer) -> None:
    assert server.app is not None
    server.call(lambda: setattr(server.app.state, "draining", True))  # type: ignore[union-attr]
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=_chat())
        assert _error(reply, 503)["code"] == "overloaded" and reply.headers["retry-after"] == "1"
        assert httpx.get(f"{server.url}/ready").status_code == 503
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.call(lambda: setattr(server.app.state, "draining", False))  # type: ignore[union-attr]
    assert httpx.get(f"{server.url}/ready").status_code == 200


# --- API keys and CORS --------------------------------------------------------------------------------


def test_protected_routes_need_a_key(secured: ApiServer) -> None:
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/izh/stats"),
        ("GET", "/metrics"),
        ("GET", "/no/such/route"),
    ):
        reply = httpx.request(method, f"{secured.url}{path}", json={})
        assert _error(reply, 401)["type"] == "authentication_error", path
        wrong = httpx.request(
            method, f"{secured.url}{path}", json={}, headers={"Authorization": "Bearer nope"}
        )
        assert _error(wrong, 401)["code"] == "invalid_api_key", path
    for path in ("/health", "/ready", "/version"):
        assert httpx.get(f"{secured.url}{path}").status_code == 200, path


def test_every_configured_key_works_in_either_header(secured: ApiServer) -> None:
    for headers in (
        {"Authorization": f"Bearer {KEYS[0]}"},
        {"Authorization": f"bearer {KEYS[1]}"},
        {"x-api-key": KEYS[1]},
    ):
        assert httpx.get(f"{secured.url}/v1/models", headers=headers).status_code == 200
    assert httpx.get(f"{secured.url}/metrics", headers={"x-api-key": KEYS[0]}).status_code == 200
    with openai.OpenAI(base_url=f"{secured.url}/v1", api_key=KEYS[0], max_retries=0) as client:
        assert client.models.list().data[0].id == MODEL
    with (
        openai.OpenAI(base_url=f"{secured.url}/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_cors_only_for_allowed_origins(secured: ApiServer, server: ApiServer) -> None:
    preflight = httpx.options(
        f"{secured.url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.get(f"{secured.url}/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{secured.url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    # Without allowed_origins there is no CORS at all.
    plain = httpx.get(f"{server.url}/health", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in plain.headers


def test_out_of_range_token_ids_are_a_400_naming_the_prompt_even_with_echo(server: ApiServer) -> None:
    """Token-id prompts are checked once, on admission, before echo decodes them."""
    vocab_size = server.llm.ready.vocab_size  # type: ignore[union-attr]
    for echo in (False, True):
        batch = {"model": MODEL, "prompt": [[1, 2], [3, vocab_size]], "max_tokens": 1, "echo": echo}
        error = _error(httpx.post(f"{server.url}/v1/completions", json=batch), 400)
        assert error["param"] == "prompt.1"
        assert f"token id {vocab_size} is out of range [0, {vocab_size})" in error["message"]
        single = {"model": MODEL, "prompt": [-1, 2], "max_tokens": 1, "echo": echo}
        error = _error(httpx.post(f"{server.url}/v1/completions", json=single), 400)
        assert error["param"] == "prompt" and "token id -1" in error["message"]
    # In range, echo returns the decoded prompt in front of the completion.
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": [[5, 6]], "max_tokens": 1, "echo": True},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    decoded = server.llm.tokenizer.decode([5, 6])  # type: ignore[union-attr]
    assert reply.json()["choices"][0]["text"].startswith(decoded)
    _assert_healthy(server)
