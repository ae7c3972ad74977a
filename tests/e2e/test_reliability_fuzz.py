"""Hostile input: schemathesis fuzzes every operation of izh's own OpenAPI schema (valid and invalid
bodies, a bounded number of cases) against a real server; nothing may answer 5xx or hang."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.core.result import Ok

from izh.api.webui.routes import WEBUI_ROUTES
from izh.config import EngineConfig
from izh.settings import LimitSettings
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
CASES_PER_OPERATION = {"POST": 15, "GET": 3, "DELETE": 3}
CALL_TIMEOUT_S = 30.0  # far above any answer on the tiny model: a hang fails the call


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=64,
        kv_cache_memory_bytes=1 << 22,
    )
    # Small limits keep every generated request cheap (and exercise the limits on the way).
    limits = LimitSettings(max_output_tokens=4, max_n=2, max_messages=4, max_prompts=2, max_tools=2)
    with api_server(config, limits=limits, sse_keepalive_s=0) as started:
        yield started


@pytest.fixture(scope="module")
def openapi(server: ApiServer) -> dict[str, Any]:
    reply = httpx.get(f"{server.url}/openapi.json")
    assert reply.status_code == 200
    return reply.json()  # type: ignore[no-any-return]


def test_the_schema_describes_every_route_and_its_body(server: ApiServer, openapi: dict[str, Any]) -> None:
    assert server.app is not None
    routes = {getattr(route, "path", "").replace(":path", "") for route in server.app.routes}
    web_ui = {path for path, _, _ in WEBUI_ROUTES}  # HTML pages and their files, not API operations
    assert set(openapi["paths"]) == routes - {"/openapi.json"} - web_ui
    body = openapi["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    chat = openapi["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "max_tokens", "tools", "response_format"} <= set(chat["properties"])


def _operations(openapi: dict[str, Any]) -> list[Any]:
    results = list(schemathesis.openapi.from_dict(openapi).get_all_operations())
    assert all(isinstance(result, Ok) for result in results), results  # the schema itself is valid
    return [result.ok() for result in results if isinstance(result, Ok)]


def _fuzz(
    operation: Any, mode: schemathesis.GenerationMode, url: str, session: requests.Session
) -> list[int]:
    """Run a bounded number of generated cases of one operation; returns the statuses seen."""
    label = f"{operation.method.upper()} {operation.path}"
    statuses: list[int] = []

    @settings(
        max_examples=CASES_PER_OPERATION[operation.method.upper()],
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=url, session=session, timeout=CALL_TIMEOUT_S)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"

    run()
    return statuses


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_server_error(
    server: ApiServer, openapi: dict[str, Any], mode: schemathesis.GenerationMode
) -> None:
    operations = _operations(openapi)
    if mode is schemathesis.GenerationMode.NEGATIVE:
        # Only a body or a parameter can be made invalid; GET /health has neither.
        operations = [op for op in operations if op.method.upper() == "POST"]
    with requests.Session() as session:
        seen = {op.label: _fuzz(op, mode, server.url, session) for op in operations}
    assert all(seen.values()), seen  # every operation was exercised
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.call(lambda: server.llm.num_in_flight) == 0  # type: ignore[union-attr]
