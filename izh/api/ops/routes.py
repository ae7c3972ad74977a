"""The operational routes and the OpenAPI document: /health, /ready, /version, /metrics, /v1/izh/stats.

/health is liveness (503 once the engine core is dead for good), /ready readiness (also red while
the core restarts, hangs or the server drains; with data parallel cores, 200 with status "degraded"
while at least one core serves and another is dead), /metrics the Prometheus text of izh.api.ops.metrics,
/v1/izh/stats the engine core's latest scheduler and KV-block snapshot for the dashboard. Their
errors, like every route's, are IzhErrors that izh.api.common.errors turns into OpenAI's envelope.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import izh
from izh.api.common.errors import ErrorResponse
from izh.api.common.state import api_state
from izh.api.guard.middleware import PUBLIC_PATHS, REQUEST_BODIES
from izh.errors import EngineDead, Overloaded


async def health(request: Request) -> Response:
    """Liveness: 200 while the process can serve (or is replacing its core), 503 once the engine
    core is dead for good (a supervisor restarts us). With data-parallel cores, 200 with status
    "degraded" (and which cores are dead) while some live, 503 once none does."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    return JSONResponse(_degraded(llm.client) or {"status": "ok"})


def _degraded(client: Any) -> dict[str, Any] | None:
    """With data parallel cores of which some (not all) are dead: what /health and /ready say."""
    dead: dict[int, str] = getattr(client, "dead_engines", {})
    if not dead:
        return None
    total = int(client.num_engines)
    return {
        "status": "degraded",
        "engines_alive": total - len(dead),
        "engines_total": total,
        "dead_engines": [{"engine": k, "reason": reason} for k, reason in sorted(dead.items())],
    }


async def ready(request: Request) -> Response:
    """Readiness: 200 only while the model is loaded, the core answered a heartbeat within the
    timeout, no core restart is under way and the server is not draining. With data-parallel cores:
    every live one answered in time; some dead and some alive is 200 with status "degraded"."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    if getattr(request.app.state, "draining", False) or llm.is_draining:
        raise Overloaded("server is shutting down")
    if llm.is_restarting:
        raise Overloaded("the engine core is restarting after a failure", code="engine_restarting")
    if not llm.is_ready:
        raise EngineDead(
            f"the engine core has not answered for {llm.client.seconds_since_alive:.1f} s (hung?)",
            code="engine_unresponsive",
        )
    return JSONResponse(_degraded(llm.client) or {"status": "ready"})


async def version(request: Request) -> Response:
    return JSONResponse({"version": izh.__version__})


async def metrics(request: Request) -> Response:
    body, content_type = api_state(request).metrics.render()
    return Response(body, media_type=content_type)


async def izh_stats(request: Request) -> Response:
    """Scheduler stats and per-block KV states, for the dashboard: the engine core's latest published
    snapshot with its age, answered at once (never waits for the core's current step)."""
    state = api_state(request)
    llm = state.llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    stats = llm.get_stats()
    blocks, blocks_age_s = llm.get_kv_block_map()
    return JSONResponse(
        {
            "model": state.model_name,
            "max_model_len": state.max_model_len,
            "kv_cache": _kv_cache_summary(llm.ready),
            "num_requests_in_flight": llm.num_in_flight,
            "draining": bool(getattr(request.app.state, "draining", False)),
            "num_core_restarts": llm.num_core_restarts,
            "stats_age_s": stats["stats_age_s"],
            "scheduler": stats,
            "kv_block_states": blocks,
            "kv_block_states_age_s": blocks_age_s,
            "engines": llm.client.engine_states(),
        }
    )


def _kv_cache_summary(ready: Any) -> dict[str, Any]:
    """The KV cache's format and size as the core announced it (Ready)."""
    return {
        "dtype": ready.kv_cache_dtype,
        "bytes_per_token": ready.kv_bytes_per_token,
        "tokens_per_gib": ready.kv_tokens_per_gib,
        "num_blocks": ready.num_blocks,
        "block_size": ready.block_size,
    }


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """izh's OpenAPI document (GET /openapi.json): every route, with the request bodies that the
    routes read themselves described by their pydantic models, and errors in OpenAI's envelope."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title="izh",
        version=izh.__version__,
        description="OpenAI-compatible inference server (see docs/operations.md for its guarantees).",
        routes=app.routes,
    )
    models: list[type[BaseModel]] = [*REQUEST_BODIES.values(), ErrorResponse]
    _, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(definitions.get("$defs", {}))
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {
        "description": "An error in OpenAI's envelope",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for path, item in schema["paths"].items():
        for operation in item.values():
            operation["responses"]["default"] = error
            if path not in PUBLIC_PATHS:
                operation["security"] = [{"bearer": []}]
            if "{model_id}" in path:
                operation["parameters"] = [
                    {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ]
    for path, model in REQUEST_BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    app.openapi_schema = schema
    return schema


OPS_ROUTES: list[tuple[str, Any, list[str]]] = [
    ("/health", health, ["GET"]),
    ("/ready", ready, ["GET"]),
    ("/version", version, ["GET"]),
    ("/metrics", metrics, ["GET"]),
    ("/v1/izh/stats", izh_stats, ["GET"]),
]
"""(path, endpoint, methods) of every route here, for build_app to register."""
