"""build_app: the FastAPI app around a started AsyncLLM.

One pure-ASGI middleware (RequestGuardMiddleware) runs before any route: it gives every request its
id (X-Request-Id), checks the API key (constant-time, against every key) and names the key by its
id, bounds the body (declared and actual bytes, the time to send it), parses a JSON body once to
enforce the `[limits]` (depth, counts, sizes: izh.api.limits), reserves the key's rate-limit tokens
(izh.api.ratelimit), sets the RequestScope through which the engine applies the tenant's cache salt
and collects usage, and afterwards settles the tokens and writes the request log line.

ONE handler turns every exception into OpenAI's error envelope (IzhError by its class, FastAPI's
validation errors as 400, 404/405, anything else as a logged 500). Draining is the caller's: set
`app.state.draining = True` (on SIGTERM) and new generation requests get 503 and /ready turns red
while in-flight ones finish; then `await llm.shutdown(drain_timeout_s)`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import izh
from izh.api import chat, completions, models, tokenize
from izh.api.limits import NOT_JSON, RequestLimits, RequestTimeout, load_json
from izh.api.metrics import PrometheusStatLogger
from izh.api.parsers import resolve_reasoning_parser
from izh.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    error_response,
    to_izh_error,
)
from izh.api.ratelimit import (
    ANONYMOUS_KEY_ID,
    RateLimiter,
    Reservation,
    api_key_cache_salt,
    api_key_id,
    estimate_request_tokens,
)
from izh.api.request_log import RequestLogger, RequestRecord
from izh.api.serving import ApiState, api_state, request_id_of, sampling_defaults
from izh.errors import EngineDead, InvalidRequest, IzhError, Overloaded, PayloadTooLarge, Unauthorized
from izh.frontend.async_llm import REQUEST_SCOPE, RequestScope
from izh.frontend.tool_parsers import select_tool_parser
from izh.settings import LimitSettings, RateLimitSettings

if TYPE_CHECKING:
    from izh.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
PUBLIC_PATHS = frozenset({"/health", "/ready", "/version"})
"""Open without an API key (and /metrics unless metrics_require_auth); every other path needs one."""
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The routes that run the model: rate-limited, and where a RequestScope collects usage."""
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
"""The POST routes with a JSON body (bounded by the middleware, described in the OpenAPI schema)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
RETRY_AFTER_S = 1
_MAX_REQUEST_ID_CHARS = 64
_REQUEST_ID_JUNK = re.compile(r"[^A-Za-z0-9._:-]")


# --- errors: the ONE mapping to OpenAI's envelope --------------------------------------------------


def error_json_response(err: IzhError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The HTTP response for an error: status from its class, OpenAI's envelope as the body."""
    all_headers = dict(headers or {})
    retry_after_s = getattr(err, "retry_after_s", None)
    if isinstance(retry_after_s, int):
        all_headers.setdefault("Retry-After", str(retry_after_s))  # a rate limit knows its wait
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


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key, as the server keeps it: its digest, its public id and its cache salt."""

    key_id: str
    digest: bytes
    cache_salt: str


class KeyRing:
    """The accepted API keys; `match` compares in constant time against every one of them."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = [ApiKey(api_key_id(key), _key_digest(key), api_key_cache_salt(key)) for key in keys]
        ids = [key.key_id for key in self.keys]
        if len(set(ids)) != len(ids):
            raise ValueError("two API keys share a key id (the first 8 hex digits of their SHA-256)")

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def key_ids(self) -> list[str]:
        return [key.key_id for key in self.keys]

    def match(self, presented: str) -> ApiKey | None:
        digest = _key_digest(presented)
        found = None
        for key in self.keys:
            # Compare against every key, so the time taken does not tell which one matched.
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


class ClientDisconnected(Exception):
    """The client went away while sending its body."""


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    """What the middleware enforces; built once by build_app."""

    keys: KeyRing
    public_paths: frozenset[str]
    max_body_bytes: int
    body_timeout_s: float
    limits: RequestLimits
    rate_limiter: RateLimiter
    cache_salt_per_key: bool
    request_log: RequestLogger
    default_max_tokens: int
    """The chat max_tokens a request gets when it sets none (for the rate-limit estimate)."""


class RequestGuardMiddleware:
    """Request id, API key, body bounds and limits, rate limit and request scope, before any route.

    Every response carries X-Request-Id: the client's own (sanitized) or a made one. Internally
    the id is made unique (the client's, plus a random suffix) since two clients may send the same.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        policy: GuardPolicy | None = None,
        api_keys: Sequence[str] = (),
        public_paths: frozenset[str] = PUBLIC_PATHS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        """Enforce `policy` (build_app's); without one, only keys and body size, other limits at
        their defaults and no rate limits (for an app of your own)."""
        self.app = app
        self.policy = policy or GuardPolicy(
            keys=KeyRing(api_keys),
            public_paths=public_paths,
            max_body_bytes=max_body_bytes,
            body_timeout_s=DEFAULT_BODY_TIMEOUT_S,
            limits=RequestLimits(LimitSettings(trust_request_chat_template=True), max_model_len=2**31 - 1),
            rate_limiter=RateLimiter(),
            cache_salt_per_key=True,
            request_log=RequestLogger(),
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client_id = sanitize_request_id(headers.get("x-request-id"))
        request_id = f"{client_id}-{secrets.token_hex(4)}" if client_id else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        record = RequestRecord(request_id, scope["method"], scope["path"], time.monotonic())
        echoed = client_id or request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = echoed
            await send(message)

        request_scope: RequestScope | None = None
        try:
            try:
                request_scope, receive, reservation = await self._admit(scope, headers, receive, record)
            except IzhError as refusal:
                await error_json_response(refusal)(scope, receive, send_with_id)
                return
            except ClientDisconnected:
                return
            await self._run(scope, receive, send_with_id, record, request_scope, reservation)
        finally:
            self.policy.request_log.log(record, request_scope)

    async def _admit(
        self, scope: Scope, headers: Headers, receive: Receive, record: RequestRecord
    ) -> tuple[RequestScope, Receive, Reservation | None]:
        """Authenticate, bound and check the body, reserve rate-limit tokens; raise IzhError to refuse."""
        policy = self.policy
        path = scope["path"]
        key = self._authenticate(path, headers)
        record.key_id = key.key_id if key is not None else (None if policy.keys else ANONYMOUS_KEY_ID)
        _check_declared_size(headers, policy.max_body_bytes)
        body: Any = NOT_JSON
        if scope["method"] == "POST" and path in REQUEST_BODIES:
            raw = await _read_body(receive, policy.max_body_bytes, policy.body_timeout_s)
            receive = _replay(raw, receive)
            body = load_json(raw, policy.limits.settings.max_json_depth)
            check = policy.limits.checker(path)
            if isinstance(body, dict) and check is not None:
                check(body)
        reservation = None
        key_id = record.key_id or ANONYMOUS_KEY_ID
        if path in GENERATION_PATHS and scope["method"] == "POST" and policy.rate_limiter.enabled:
            default_max_tokens = (
                COMPLETIONS_DEFAULT_MAX_TOKENS if path == "/v1/completions" else policy.default_max_tokens
            )
            estimate = estimate_request_tokens(
                body, default_max_tokens=default_max_tokens, max_model_len=policy.limits.max_model_len
            )
            reservation = policy.rate_limiter.reserve(key_id, estimate)
        request_scope = RequestScope(
            key_id=record.key_id,
            cache_salt=key.cache_salt if key is not None and policy.cache_salt_per_key else None,
            max_prompt_tokens=policy.limits.settings.max_prompt_tokens,
            capture_text=policy.request_log.enabled and policy.request_log.log_prompts,
        )
        return request_scope, receive, reservation

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        record: RequestRecord,
        request_scope: RequestScope,
        reservation: Reservation | None,
    ) -> None:
        token = REQUEST_SCOPE.set(request_scope)
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            if record.status:
                raise
            # Only what escaped every handler gets here: log it once, answer in the envelope.
            await error_json_response(to_izh_error(exc, record.request_id))(scope, receive, send)
        finally:
            REQUEST_SCOPE.reset(token)
            if reservation is not None:
                self.policy.rate_limiter.settle(reservation, request_scope.num_tokens)

    def _authenticate(self, path: str, headers: Headers) -> ApiKey | None:
        """The caller's key (None when auth is off or the path is public); Unauthorized otherwise."""
        keys = self.policy.keys
        presented = presented_api_key(headers)
        if not keys:
            return None
        if path in self.policy.public_paths:
            return keys.match(presented) if presented is not None else None
        if presented is None:
            raise Unauthorized(
                "Missing API key: send 'Authorization: Bearer YOUR_KEY'", code="missing_api_key"
            )
        key = keys.match(presented)
        if key is None:
            raise Unauthorized("Invalid API key")
        return key


def _check_declared_size(headers: Headers, max_body_bytes: int) -> None:
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        if int(declared) > max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")


async def _read_body(receive: Receive, max_body_bytes: int, timeout_s: float) -> bytes:
    """The whole body: 413 as soon as it outgrows the limit, 408 if it takes longer than `timeout_s`."""
    chunks: list[bytes] = []
    received = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > max_body_bytes:
                    raise PayloadTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s (server.body_timeout_s)"
        ) from None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the route the body read already, then passes through (disconnects)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# --- service routes ------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    """Liveness: 200 while the process can serve (or is replacing its core), 503 once the engine
    core is dead for good (a supervisor restarts us)."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: 200 only while the model is loaded, the core answered a heartbeat within the
    timeout, no core restart is under way and the server is not draining."""
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
            "num_core_restarts": llm.num_core_restarts,
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
        app.add_api_route(path, endpoint, methods=methods)


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
    tool_call_parser: str = "auto",
    limits: LimitSettings | None = None,
    rate_limits: RateLimitSettings | None = None,
    cache_salt_per_key: bool = True,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    log_requests: bool = True,
    log_prompts: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app over a started `llm` (the caller starts and shuts it down).

    With `api_keys`, every route except /health, /ready, /version (and /metrics unless
    `metrics_require_auth`) needs one of them; with `cache_salt_per_key` each key also gets its
    own prefix-cache namespace. `limits` bound each request (default: the `[limits]` defaults, but
    trusting request chat templates, as a library caller vouches for its clients; `izh serve`
    passes the settings). `rate_limits` are per key id (see izh.api.ratelimit). CORS is on only
    with `allowed_origins`. Raises ValueError for an unknown `reasoning_parser` or
    `tool_call_parser`, or two keys with the same id.
    """
    tokenizer = llm.tokenizer
    parser = resolve_reasoning_parser(reasoning_parser, tokenizer.chat_template)
    select_tool_parser(tool_call_parser, tokenizer.chat_template)  # fail fast on an unknown name
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
        openapi_url="/openapi.json",
        docs_url=None,
        redoc_url=None,
    )
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
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
        tool_call_parser=tool_call_parser,
    )
    app.state.draining = False
    for exc_class in (IzhError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(exc_class, handle_exception)
    _add_routes(app)
    keys = KeyRing(list(api_keys))
    rate_limiter = _rate_limiter(rate_limits or RateLimitSettings(), keys)
    policy = GuardPolicy(
        keys=keys,
        public_paths=PUBLIC_PATHS if metrics_require_auth else PUBLIC_PATHS | {"/metrics"},
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        limits=RequestLimits(
            limits if limits is not None else LimitSettings(trust_request_chat_template=True),
            max_model_len=engine_ready.max_model_len,
            template_names=frozenset(tokenizer.chat_templates),
        ),
        rate_limiter=rate_limiter,
        cache_salt_per_key=cache_salt_per_key,
        request_log=RequestLogger(enabled=log_requests, log_prompts=log_prompts),
        default_max_tokens=app.state.izh.sampling_defaults.get("max_tokens", engine_ready.max_model_len),
    )
    app.state.guard = policy
    app.add_middleware(RequestGuardMiddleware, policy=policy)
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
        "API ready for model %s (auth %s, rate limits %s, reasoning parser %s)",
        llm.model_name,
        f"on, key ids {', '.join(keys.key_ids)}" if keys else "off",
        "on" if rate_limiter.enabled else "off",
        parser or "none",
    )
    return app


def _rate_limiter(settings: RateLimitSettings, keys: KeyRing) -> RateLimiter:
    per_key = settings.key_limits()
    known = set(keys.key_ids) if keys else {ANONYMOUS_KEY_ID}
    for key_id in sorted(per_key.keys() - known):
        logger.warning("rate_limits.per_key names key id %s, which matches no API key", key_id)
    return RateLimiter(settings.default_limit(), per_key)


__all__ = ["build_app", "error_json_response", "handle_exception"]
