"""Security against a real server: API keys on every route (compared in constant time), per-key rate
limits and concurrency that never leak between keys, per-tenant prefix-cache isolation, request
limits, body timeouts, sandboxed or refused chat templates, and request logs without secrets."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from izh.api.guard.ratelimit import api_key_id
from izh.config import EngineConfig
from izh.settings import LimitSettings, RateLimitSettings
from tests.e2e.api_server import ApiServer, api_server
from tests.engine.fake_core import FOREVER_TOKEN, make_fake_model

MODEL = "tiny"
KEY_A, KEY_B, KEY_C = "sk-alpha-0001", "sk-bravo-0002", "sk-charlie-0003"
OPEN_PATHS = {"/health", "/ready", "/version", "/", "/dashboard"}
"""The routes docs/operations.md lists as open without a key (with metrics_require_auth): the probes and
the web UI's pages (its files under /webui/ too, each by name; `/webui/{name}` itself is no file)."""
PROMPT_40 = list(range(100, 140))
"""A token-id prompt of 40 tokens: two full KV blocks of 16 can be cached."""


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=256,
        kv_cache_memory_bytes=1 << 22,
    )


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def secured(tiny_llama_dir: str) -> Iterator[ApiServer]:
    rate_limits = RateLimitSettings(per_key=[f"{api_key_id(KEY_A)} tokens_per_minute=1 burst_tokens=60"])
    limits = LimitSettings(
        max_messages=4, max_stop=2, max_json_depth=32, max_n=4, max_output_tokens=100, max_prompt_tokens=64
    )
    with api_server(
        _config(tiny_llama_dir),
        api_keys=[KEY_A, KEY_B, KEY_C],
        metrics_require_auth=True,
        rate_limits=rate_limits,
        limits=limits,
        body_timeout_s=1.0,
    ) as started:
        yield started


@pytest.fixture(scope="module")
def fake_model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer beside a FakeEngineCore that echoes prompts, 10 ms a step, for ever."""
    return make_fake_model(
        tiny_llama_dir,
        tmp_path_factory.mktemp("fake_security"),
        step_delay_s=0.01,
        max_model_len=1 << 20,
        vocab_size=1000,
    )


@pytest.fixture(scope="module")
def fake(fake_model_dir: Path) -> Iterator[ApiServer]:
    """Keys, C limited to one request at a time, prompts logged, request templates trusted."""
    rate_limits = RateLimitSettings(per_key=[f"{api_key_id(KEY_C)} max_concurrent_requests=1"])
    config = EngineConfig(model=str(fake_model_dir), served_model_name=MODEL)
    with api_server(
        config,
        start_kwargs={"core_factory": "tests.engine.fake_core:FakeEngineCore"},
        api_keys=[KEY_A, KEY_B, KEY_C],
        rate_limits=rate_limits,
        log_prompts=True,
        sse_keepalive_s=0,
    ) as started:
        yield started


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.01)


def _limiter(server: ApiServer) -> Any:
    assert server.app is not None
    return server.app.state.guard.rate_limiter


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **fields}


# --- auth ------------------------------------------------------------------------------------------------


def test_every_route_needs_a_key_except_the_documented_open_ones(secured: ApiServer) -> None:
    assert secured.app is not None
    checked = set()
    for route in secured.app.routes:
        path = getattr(route, "path", "")
        url = secured.url + path.replace("{model_id:path}", MODEL)
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method == "HEAD":
                continue
            reply = httpx.request(method, url, json={})
            if path in OPEN_PATHS:
                assert reply.status_code == 200, path
            elif path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's envelope
                assert reply.status_code == 401, path
                assert reply.json() == {
                    "type": "error",
                    "error": {"type": "authentication_error", "message": reply.json()["error"]["message"]},
                }
            else:
                assert _error(reply, 401)["type"] == "authentication_error", path
                assert reply.headers["www-authenticate"] == "Bearer"
            checked.add(path)
    assert {"/v1/chat/completions", "/openapi.json", "/metrics", "/v1/izh/stats"} <= checked
    assert checked >= OPEN_PATHS
    assert "/health" in (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


def test_keys_are_compared_in_constant_time_against_every_key(
    secured: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert httpx.get(f"{secured.url}/v1/models", headers=_auth(KEY_B)).status_code == 200
    assert len(calls) == 3  # every key, not just until the match
    assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: the key's length never shows
    calls.clear()
    assert httpx.get(f"{secured.url}/v1/models", headers=_auth("sk-wrong")).status_code == 401
    assert len(calls) == 3


# --- rate limits ---------------------------------------------------------------------------------------


def test_a_key_over_its_bucket_gets_429_while_another_key_is_served(secured: ApiServer) -> None:
    body = _chat(max_tokens=30, ignore_eos=True)
    # A's bucket holds 60 tokens and refills 1 a minute: this request (about 33 by the estimate)
    # fits, and what it really used (its prompt + 30) leaves too little for a second.
    first = httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=_auth(KEY_A), timeout=60)
    assert first.status_code == 200, first.text
    refused = httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=_auth(KEY_A), timeout=60)
    error = _error(refused, 429)
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert api_key_id(KEY_A) in error["message"] and KEY_A not in error["message"]
    assert int(refused.headers["retry-after"]) > 60
    for _ in range(3):  # B is untouched by A's bucket
        served = httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=_auth(KEY_B), timeout=60)
        assert served.status_code == 200
    with (
        openai.OpenAI(base_url=f"{secured.url}/v1", api_key=KEY_A, max_retries=0) as client,
        pytest.raises(openai.RateLimitError),
    ):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=30
        )
    # Non-generation routes are not charged.
    assert (
        httpx.post(f"{secured.url}/tokenize", json={"prompt": "hi"}, headers=_auth(KEY_A)).status_code == 200
    )


def test_per_key_concurrency_never_takes_another_keys_slots(fake: ApiServer) -> None:
    forever = {"model": MODEL, "prompt": [FOREVER_TOKEN, 5], "max_tokens": 100_000, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{fake.url}/v1/completions", json=forever, headers=_auth(KEY_C)) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)
            short = {"model": MODEL, "prompt": [7, 8], "max_tokens": 2}
            refused = client.post(f"{fake.url}/v1/completions", json=short, headers=_auth(KEY_C))
            error = _error(refused, 429)
            assert "1 requests in flight" in error["message"] and refused.headers["retry-after"] == "1"
            assert (
                client.post(f"{fake.url}/v1/completions", json=short, headers=_auth(KEY_B)).status_code == 200
            )
        # The held stream is gone: once the server has seen that (and aborted it), C's slot is free.
        _wait_until(
            lambda: fake.call(lambda: _limiter(fake).snapshot(api_key_id(KEY_C))["num_in_flight"]) == 0
        )
        assert client.post(f"{fake.url}/v1/completions", json=short, headers=_auth(KEY_C)).status_code == 200


# --- the prefix cache is per tenant ---------------------------------------------------------------------


def _cached_tokens(server: ApiServer, key: str, **fields: Any) -> int:
    body = {"model": MODEL, "prompt": PROMPT_40, "max_tokens": 1, **fields}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(key), timeout=60)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_one_tenant_cannot_hit_another_tenants_cached_prefix(secured: ApiServer) -> None:
    _cached_tokens(secured, KEY_B)
    assert _cached_tokens(secured, KEY_B) == 32  # B's own prefix: two full blocks
    assert _cached_tokens(secured, KEY_C) == 0  # the same prompt, another tenant: no hit
    assert _cached_tokens(secured, KEY_C) == 32
    assert _cached_tokens(secured, KEY_B, cache_salt="mine") == 0  # a request's own salt adds to the key's
    assert _cached_tokens(secured, KEY_B, cache_salt="mine") == 32


def test_tenants_share_the_cache_when_per_key_salts_are_off(tiny_llama_dir: str) -> None:
    with api_server(_config(tiny_llama_dir), api_keys=[KEY_B, KEY_C], cache_salt_per_key=False) as shared:
        _cached_tokens(shared, KEY_B)
        assert _cached_tokens(shared, KEY_C) == 32


# --- request limits and hostile bodies ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "setting"),
    [
        (_chat(messages=[{"role": "user", "content": "x"}] * 5), "messages", "max_messages"),
        (_chat(stop=["a", "b", "c"]), "stop", "max_stop"),
        (_chat(n=5), "n", "max_n"),
        (_chat(max_tokens=101), "max_tokens", "max_output_tokens"),
    ],
)
def test_limit_violations_are_400s_naming_the_limit(
    secured: ApiServer, body: dict[str, Any], param: str, setting: str
) -> None:
    error = _error(httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=_auth(KEY_B)), 400)
    assert (error["param"], error["code"]) == (param, "limit_exceeded")
    assert f"limits.{setting}" in error["message"]


def test_prompts_longer_than_the_limit_are_400s(secured: ApiServer) -> None:
    body = {"model": MODEL, "prompt": list(range(100, 165)), "max_tokens": 1}
    error = _error(httpx.post(f"{secured.url}/v1/completions", json=body, headers=_auth(KEY_B)), 400)
    assert (error["param"], error["code"]) == ("prompt", "limit_exceeded")
    assert "65 tokens" in error["message"] and "limits.max_prompt_tokens" in error["message"]
    chat = _chat(messages=[{"role": "user", "content": "many words " * 40}])
    error = _error(httpx.post(f"{secured.url}/v1/chat/completions", json=chat, headers=_auth(KEY_B)), 400)
    assert "limits.max_prompt_tokens" in error["message"]
    body["prompt"] = list(range(100, 164))  # at the limit
    assert httpx.post(f"{secured.url}/v1/completions", json=body, headers=_auth(KEY_B)).status_code == 200


def test_deeply_nested_and_huge_bodies_are_refused_before_the_models(secured: ApiServer) -> None:
    url = f"{secured.url}/v1/chat/completions"
    deep = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = _error(httpx.post(url, content=deep, headers=_auth(KEY_B)), 400)
    assert "limits.max_json_depth" in error["message"]  # the middleware's bound, not pydantic's
    schema: Any = {"type": "object"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"x": schema}}
    error = _error(httpx.post(url, json=_chat(guided_json=schema), headers=_auth(KEY_B)), 400)
    assert "limits.max_json_depth" in error["message"]
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    error = _error(httpx.post(f"{secured.url}/v1/completions", content=huge, headers=_auth(KEY_B)), 413)
    assert error["code"] == "payload_too_large"
    assert httpx.post(url, json=_chat(), headers=_auth(KEY_B), timeout=60).status_code == 200


def test_a_body_sent_too_slowly_is_a_408(secured: ApiServer) -> None:
    host, port = secured.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_B}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": ')  # ... and never the rest
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"408"
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "server.body_timeout_s" in error["message"]


# --- chat templates from requests -----------------------------------------------------------------------

INJECTIONS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ self.__init__.__globals__.__builtins__.open('PWNED', 'w') }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ 'x' * 10**9 }}",
    "{{ 9 ** 999999999 }}",
]


@pytest.mark.parametrize("template", INJECTIONS)
def test_template_injection_is_refused_by_the_sandbox(
    fake: ApiServer, template: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    body = _chat(chat_template=template)
    error = _error(httpx.post(f"{fake.url}/v1/chat/completions", json=body, headers=_auth(KEY_B)), 400)
    assert error["type"] == "invalid_request_error" and "chat template" in error["message"]
    assert not (tmp_path / "PWNED").exists()
    assert httpx.get(f"{fake.url}/health").status_code == 200


def test_request_chat_templates_are_refused_unless_trusted(secured: ApiServer) -> None:
    body = _chat(chat_template="{{ messages[0]['content'] }}")
    error = _error(httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=_auth(KEY_B)), 400)
    assert error["code"] == "chat_template_not_allowed" and error["param"] == "chat_template"


# --- request logs ------------------------------------------------------------------------------------------


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "izh.request" and hasattr(r, "fields")]


def test_request_logs_carry_ids_and_counts_never_keys_or_prompts(
    secured: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="izh.request")
    secret_words = "my confidential prompt words"
    body = _chat(messages=[{"role": "user", "content": secret_words}], max_tokens=3, ignore_eos=True)
    headers = {**_auth(KEY_B), "X-Request-Id": "trace-42"}
    assert (
        httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code
        == 200
    )
    assert httpx.get(f"{secured.url}/v1/models").status_code == 401
    assert httpx.get(f"{secured.url}/health").status_code == 200  # a probe: debug level only
    _wait_until(lambda: len(_request_lines(caplog)) >= 2)  # written once each response is out
    lines = _request_lines(caplog)
    served = next(line for line in lines if line["request_id"].startswith("trace-42-"))
    assert served["key_id"] == api_key_id(KEY_B) and served["status"] == 200
    assert served["path"] == "/v1/chat/completions" and served["method"] == "POST"
    assert served["prompt_tokens"] > 0 and served["completion_tokens"] == 3
    assert served["finish_reason"] == "length" and served["num_sequences"] == 1
    assert 0 <= served["ttft_s"] <= served["duration_s"]
    assert "prompts" not in served
    refused = next(line for line in lines if line["path"] == "/v1/models")
    assert refused["status"] == 401 and refused["key_id"] is None
    assert not any(line["path"] == "/health" for line in lines)
    everything = " ".join(r.getMessage() + repr(getattr(r, "fields", "")) for r in caplog.records)
    assert secret_words not in everything
    assert all(key not in everything for key in (KEY_A, KEY_B, KEY_C))


def test_prompts_and_outputs_are_logged_only_when_asked(
    fake: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="izh.request")
    body = {"model": MODEL, "prompt": "echo me", "max_tokens": 20}
    assert (
        httpx.post(f"{fake.url}/v1/completions", json=body, headers=_auth(KEY_A), timeout=30).status_code
        == 200
    )
    # The line is written once the response is out: the client may have it a moment before.
    _wait_until(lambda: any(line["path"] == "/v1/completions" for line in _request_lines(caplog)))
    line = next(line for line in _request_lines(caplog) if line["path"] == "/v1/completions")
    assert line["key_id"] == api_key_id(KEY_A)
    assert "echo me" in line["prompts"][0] and "echo me" in line["outputs"][0]  # the fake core echoes


def test_a_client_gone_before_the_response_is_logged_as_499(
    fake: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="izh.request")
    forever = {"model": MODEL, "prompt": [FOREVER_TOKEN, 5], "max_tokens": 100_000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fake.url}/v1/completions", json=forever, headers=_auth(KEY_B), timeout=0.5)
    _wait_until(lambda: any(line["status"] == 499 for line in _request_lines(caplog)))
    line = next(line for line in _request_lines(caplog) if line["status"] == 499)
    assert line["finish_reason"] == "abort" and line["completion_tokens"] > 0
