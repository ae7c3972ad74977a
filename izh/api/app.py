"""build_app: the FastAPI app around a started AsyncLLM.

One pure-ASGI middleware gives every request its id (X-Request-Id), checks the API key and the
declared body size; ONE handler turns every exception into OpenAI's error envelope (IzhError by its
class, FastAPI's validation errors as 400, 404/405, anything else as a logged 500). Draining is the
caller's: set `app.state.draining = True` (on SIGTERM) and new generation requests get 503 and
/ready turns red while in-flight ones finish; then `await llm.shutdown(drain_timeout_s)`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import izh
from izh.api import chat, completions, models, tokenize
from izh.api.metrics import PrometheusStatLogger
from izh.api.parsers import resolve_reasoning_parser
from izh.api.protocol import error_response, to_izh_error
from izh.api.serving import ApiState, api_state, request_id_of, sampling_defaults
from izh.errors import EngineDead, InvalidRequest, IzhError, Overloaded, PayloadTooLarge, Unauthorized

if TYPE_CHECKING:
    from izh.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PUBLIC_PATHS = frozenset({"/health", "/ready", "/version"})
RETRY_AFTER_S = 1
_MAX_REQUEST_ID_CHARS = 64
_REQUEST_ID_JUNK = re.compile(r"[^A-Za-z0-9._:-]")


# --- errors: the ONE mapping to OpenAI's envelope --------------------------------------------------


def error_json_response(err: IzhError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The HTTP response for an error: status from its class, OpenAI's envelope as the body."""
    all_headers = dict(headers or {})
    if isinstance(err, Overloaded):
        # The openai client retries 503s and honours Retry-After; a short wait spreads the load.
        all_headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    if isinstance(err, Unauthorized):
        all_headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(error_response(err).model_dump(), status_code=err.status_code, headers=all_headers)


async def handle_exception(request: Request, exc: Exception) -> Response:
    """Every exception a route raises, as OpenAI's error envelope."""
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else None
    return error_json_response(to_izh_error(exc, request_id_of(request)), headers)


# --- the middleware ------------------------------------------------------------------------------


def sanitize_request_id(value: str | None) -> str:
    """A client's X-Request-Id made safe for logs and headers ("" when nothing usable is left)."""
    if not value:
        return ""
    return _REQUEST_ID_JUNK.sub("", value)[:_MAX_REQUEST_ID_CHARS]


def _key_digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps even the key's length out of the timing.
    return hashlib.sha256(key.encode()).digest()


def presented_api_key(headers: Headers) -> str | None:
    """The key from `Authorization: Bearer KEY`, else from `x-api-key: KEY`."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    api_key = headers.get("x-api-key")
    return api_key.strip() if api_key and api_key.strip() else None


class RequestGuardMiddleware:
    """Request id, API key and declared body size, before any route runs.

    Every response carries X-Request-Id: the client's own (sanitized) or a made one. Internally
    the id is made unique (the client's, plus a random suffix) since two clients may send the same.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Sequence[str],
        public_paths: frozenset[str],
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self._key_digests = [_key_digest(key) for key in api_keys]
        self._public_paths = public_paths
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client_id = sanitize_request_id(headers.get("x-request-id"))
        request_id = f"{client_id}-{secrets.token_hex(4)}" if client_id else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        echoed = client_id or request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["X-Request-Id"] = echoed
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await error_json_response(refusal)(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            # Only what escaped every handler gets here: log it once, answer in the envelope.
            await error_json_response(to_izh_error(exc, request_id))(scope, receive, send_with_id)

    def _refusal(self, scope: Scope, headers: Headers) -> IzhError | None:
        if self._key_digests and scope["path"] not in self._public_paths:
            error = self._check_key(headers)
            if error is not None:
                return error
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return InvalidRequest("Content-Length is not a number")
            if int(declared) > self._max_body_bytes:
                return PayloadTooLarge(f"request body exceeds the limit of {self._max_body_bytes} bytes")
        return None

    def _check_key(self, headers: Headers) -> Unauthorized | None:
        key = presented_api_key(headers)
        if key is None:
            return Unauthorized(
                "Missing API key: send 'Authorization: Bearer YOUR_KEY'", code="missing_api_key"
            )
        digest = _key_digest(key)
        matched = False
        for expected in self._key_digests:
            # Compare against every key, so the time taken does not tell which one matched.
            matched |= hmac.compare_digest(digest, expected)
        return None if matched else Unauthorized("Invalid API key")


# --- service routes ------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """Liveness: 200 while the engine core lives, 503 once it died (a supervisor restarts us)."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: 200 only while serving and not draining (load balancers stop sending otherwise)."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    if getattr(request.app.state, "draining", False) or not llm.is_ready:
        raise Overloaded("server is shutting down")
    return JSONResponse({"status": "ready"})


async def version(request: Request) -> Response:
    return JSONResponse({"version": izh.__version__})


async def metrics(request: Request) -> Response:
    body, content_type = api_state(request).metrics.render()
    return Response(body, media_type=content_type)


async def izh_stats(request: Request) -> Response:
    """Scheduler stats and per-block KV states, for the dashboard."""
    state = api_state(request)
    llm = state.llm
    try:
        stats = await llm.get_stats()
        blocks = await llm.kv_block_states()
    except TimeoutError:
        raise EngineDead("the engine core did not answer the stats call in time") from None
    return JSONResponse(
        {
            "model": state.model_name,
            "max_model_len": state.max_model_len,
            "num_requests_in_flight": llm.num_in_flight,
            "draining": bool(getattr(request.app.state, "draining", False)),
            "scheduler": stats,
            "kv_block_states": blocks,
        }
    )


def _add_routes(app: FastAPI) -> None:
    routes: list[tuple[str, Any, list[str]]] = [
        ("/v1/chat/completions", chat.create_chat_completion, ["POST"]),
        ("/v1/completions", completions.create_completion, ["POST"]),
        ("/v1/models", models.list_models, ["GET"]),
        ("/v1/models/{model_id:path}", models.retrieve_model, ["GET"]),
        ("/tokenize", tokenize.tokenize, ["POST"]),
        ("/detokenize", tokenize.detokenize, ["POST"]),
        ("/health", health, ["GET"]),
        ("/ready", ready, ["GET"]),
        ("/version", version, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/v1/izh/stats", izh_stats, ["GET"]),
    ]
    for path, endpoint, methods in routes:
        app.add_api_route(path, endpoint, methods=methods, include_in_schema=False)


# --- the app ------------------------------------------------------------------------------------


def build_app(
    llm: AsyncLLM,
    *,
    api_keys: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    metrics_require_auth: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    sse_keepalive_s: float | None = 10.0,
    reasoning_parser: str = "auto",
    default_request_timeout_s: float | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over a started `llm` (the caller starts and shuts it down).

    With `api_keys`, every route except /health, /ready, /version (and /metrics unless
    `metrics_require_auth`) needs one of them. CORS is on only with `allowed_origins`. Raises
    ValueError for an unknown `reasoning_parser`.
    """
    tokenizer = llm.tokenizer
    parser = resolve_reasoning_parser(reasoning_parser, tokenizer.chat_template)
    engine_ready = llm.ready
    stat_logger = PrometheusStatLogger(
        llm.model_name,
        max_model_len=engine_ready.max_model_len,
        cache_config={
            "block_size": str(engine_ready.block_size),
            "num_gpu_blocks": str(engine_ready.num_blocks),
            "cache_dtype": engine_ready.dtype,
        },
    )
    # AsyncLLM reports to every logger in this list; the lifespan takes ours out at shutdown.
    llm.stat_loggers.loggers.append(stat_logger)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            app.state.draining = True
            if stat_logger in llm.stat_loggers.loggers:
                llm.stat_loggers.loggers.remove(stat_logger)

    app = FastAPI(
        title="izh",
        version=izh.__version__,
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.izh = ApiState(
        llm=llm,
        model_name=llm.model_name,
        max_model_len=engine_ready.max_model_len,
        max_body_bytes=max_body_bytes,
        sse_keepalive_s=sse_keepalive_s,
        reasoning_parser=parser,
        default_request_timeout_s=default_request_timeout_s,
        metrics=stat_logger,
        sampling_defaults=sampling_defaults(tokenizer.generation_config),
        created=int(time.time()),
    )
    app.state.draining = False
    for exc_class in (IzhError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(exc_class, handle_exception)
    _add_routes(app)
    public = PUBLIC_PATHS if metrics_require_auth else PUBLIC_PATHS | {"/metrics"}
    app.add_middleware(
        RequestGuardMiddleware, api_keys=list(api_keys), public_paths=public, max_body_bytes=max_body_bytes
    )
    if allowed_origins:
        # Added last, so it runs first: preflights and 401s get their CORS headers too.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    logger.info(
        "API ready for model %s (auth %s, reasoning parser %s)",
        llm.model_name,
        "on" if api_keys else "off",
        parser or "none",
    )
    return app


__all__ = ["build_app", "error_json_response", "handle_exception"]
