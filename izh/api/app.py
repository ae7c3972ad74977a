"""build_app: the FastAPI app around a started AsyncLLM, and the registration of its routes.

The jobs live beside it: izh.api.guard.middleware (the request guard middleware: keys, body bounds and limits,
rate limits, request ids), izh.api.common.errors (THE exception → OpenAI error mapping, registered here as
the app's exception handler), izh.api.ops.routes (health, readiness, version, metrics, stats, the OpenAPI
document) and the OpenAI routes (izh.api.chat.routes, completions, models, tokenize). Draining is the
caller's: set `app.state.draining = True` (on SIGTERM) and new generation requests get 503 and /ready
turns red while in-flight ones finish; then `await llm.shutdown(drain_timeout_s)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

import izh
from izh.api.chat import routes as chat
from izh.api.common.errors import HANDLED_EXCEPTIONS, handle_exception
from izh.api.common.sampling import sampling_defaults
from izh.api.common.state import ApiState
from izh.api.completions import routes as completions
from izh.api.embeddings import routes as embeddings
from izh.api.guard.limits import RequestLimits
from izh.api.guard.middleware import (
    PUBLIC_PATHS,
    GuardPolicy,
    KeyRing,
    RequestGuardMiddleware,
    build_rate_limiter,
)
from izh.api.messages import routes as messages
from izh.api.ops import lora, models, tokenize
from izh.api.ops.metrics import PrometheusStatLogger
from izh.api.ops.request_log import RequestLogger
from izh.api.ops.routes import OPS_ROUTES, openapi_schema
from izh.api.rerank import routes as rerank
from izh.api.responses import routes as responses
from izh.api.responses.store import ResponseStore
from izh.api.webui.routes import register_web_ui
from izh.parsers.reasoning_parsers import resolve_reasoning_parser
from izh.parsers.tools import select_tool_parser
from izh.settings import LimitSettings, RateLimitSettings, ServerSettings, generation_config_override

if TYPE_CHECKING:
    from izh.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

ROUTES: list[tuple[str, Any, list[str]]] = [
    ("/v1/chat/completions", chat.create_chat_completion, ["POST"]),
    ("/v1/completions", completions.create_completion, ["POST"]),
    ("/v1/responses", responses.create_response, ["POST"]),
    ("/v1/responses/{response_id}", responses.retrieve_response, ["GET"]),
    ("/v1/responses/{response_id}", responses.delete_response, ["DELETE"]),
    ("/v1/responses/{response_id}/input_items", responses.list_input_items, ["GET"]),
    ("/v1/messages", messages.create_message, ["POST"]),
    ("/v1/messages/count_tokens", messages.count_tokens, ["POST"]),
    ("/v1/embeddings", embeddings.create_embedding, ["POST"]),
    ("/v1/rerank", rerank.rerank, ["POST"]),
    ("/rerank", rerank.rerank, ["POST"]),
    ("/score", rerank.score, ["POST"]),
    ("/v1/score", rerank.score, ["POST"]),
    ("/v1/models", models.list_models, ["GET"]),
    ("/v1/models/{model_id:path}", models.retrieve_model, ["GET"]),
    ("/tokenize", tokenize.tokenize, ["POST"]),
    ("/detokenize", tokenize.detokenize, ["POST"]),
    ("/tokenizer_info", tokenize.tokenizer_info, ["GET"]),
    ("/v1/load_lora_adapter", lora.load_lora_adapter, ["POST"]),
    ("/v1/unload_lora_adapter", lora.unload_lora_adapter, ["POST"]),
    *OPS_ROUTES,
]
"""(path, endpoint, methods) of every route, in the order they are registered."""


def read_chat_template(value: str) -> str:
    """A chat template file's source (server.chat_template); ValueError naming the file otherwise.

    As vLLM's --chat-template, the value may be the template itself in one line (it holds `{{` or
    `{%` and names no file)."""
    path = Path(value).expanduser()
    if ("{{" in value or "{%" in value) and not _is_file(path):
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"server.chat_template: cannot read {path}: {exc}") from None


def _is_file(path: Path) -> bool:
    """Path.is_file, False for a name the OS refuses (a one-line template longer than a file name)."""
    try:
        return path.is_file()
    except OSError:
        return False


def build_app(
    llm: AsyncLLM,
    server: ServerSettings | None = None,
    *,
    limits: LimitSettings | None = None,
    rate_limits: RateLimitSettings | None = None,
    api_index: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over a started `llm` (the caller starts and shuts it down), as the
    `[server]`, `[limits]` and `[rate_limits]` settings sections say (each defaults to its section's
    defaults).

    With `server.api_keys`, every route except /health, /ready, /version (and /metrics unless
    `metrics_require_auth`) needs one of them; with `cache_salt_per_key` each key also gets its own
    prefix-cache namespace. `limits` bound each request (default: the `[limits]` defaults, but
    trusting request chat templates, as a library caller vouches for its clients; `izh serve`
    passes the settings). `rate_limits` are per key id (see izh.api.guard.ratelimit). CORS is on only
    with `allowed_origins`. `server.responses_store_max` bounds the stored responses of /v1/responses
    (least recently used evicted). With `server.web_ui`, the chat page (/) and the dashboard
    (/dashboard) are served, public, from izh.api.webui.routes. Raises ValueError for an unknown
    `reasoning_parser` or `tool_call_parser`, or two keys with the same id.

    `api_index`: this app is API process `api_index` of several (`izh serve --api-server-count`):
    its request ids start with "a<index>-", /metrics merges every process's values (prometheus-client
    multiprocess mode) and only process 0 records the engine-side metrics.
    """
    s = server if server is not None else ServerSettings()
    # Without a [limits] section (tests, embedding apps) a request's own chat template is trusted.
    limits = limits if limits is not None else LimitSettings(trust_request_chat_template=True)
    tokenizer = llm.tokenizer
    if s.chat_template is not None:
        tokenizer.override_chat_template(read_chat_template(s.chat_template))
    parser = resolve_reasoning_parser(s.reasoning_parser, tokenizer.chat_template)
    select_tool_parser(s.tool_call_parser, tokenizer.chat_template)  # fail fast on an unknown name
    engine_ready = llm.ready
    stat_logger = PrometheusStatLogger(
        llm.model_name,
        max_model_len=engine_ready.max_model_len,
        cache_config={
            "block_size": str(engine_ready.block_size),
            "num_gpu_blocks": str(engine_ready.num_blocks),
            "cache_dtype": engine_ready.dtype,
        },
        multiprocess=api_index is not None,
        engine_metrics=api_index is None or api_index == 0,
        max_loras=engine_ready.max_loras,
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
        max_body_bytes=s.max_body_bytes,
        sse_keepalive_s=s.sse_keepalive_s or None,
        reasoning_parser=parser,
        default_request_timeout_s=s.request_timeout_s,
        metrics=stat_logger,
        sampling_defaults=sampling_defaults(
            {
                **tokenizer.generation_config,
                **generation_config_override(s.override_generation_config or "{}"),
            }
        ),
        created=int(time.time()),
        tool_call_parser=s.tool_call_parser,
        responses_store=ResponseStore(s.responses_store_max),
        limits=limits,
        allow_lora_updating=s.allow_runtime_lora_updating,
    )
    app.state.draining = False
    for exc_class in HANDLED_EXCEPTIONS:
        app.add_exception_handler(exc_class, handle_exception)
    for path, endpoint, methods in ROUTES:
        app.add_api_route(path, endpoint, methods=methods)
    public_paths = PUBLIC_PATHS if s.metrics_require_auth else PUBLIC_PATHS | {"/metrics"}
    if s.web_ui:
        public_paths |= register_web_ui(app)
    keys = KeyRing(sorted(s.api_key_values()))
    rate_limiter = build_rate_limiter(rate_limits or RateLimitSettings(), keys)
    policy = GuardPolicy(
        keys=keys,
        public_paths=public_paths,
        max_body_bytes=s.max_body_bytes,
        body_timeout_s=s.body_timeout_s,
        limits=RequestLimits(
            limits,
            max_model_len=engine_ready.max_model_len,
            template_names=frozenset(tokenizer.chat_templates),
        ),
        rate_limiter=rate_limiter,
        cache_salt_per_key=s.cache_salt_per_key,
        request_log=RequestLogger(enabled=s.log_requests, log_prompts=s.log_prompts),
        default_max_tokens=app.state.izh.sampling_defaults.get("max_tokens", engine_ready.max_model_len),
        request_id_prefix=f"a{api_index}-" if api_index is not None else "",
    )
    app.state.guard = policy
    app.add_middleware(RequestGuardMiddleware, policy=policy)
    if s.allowed_origins:
        # Added last, so it runs first: preflights and 401s get their CORS headers too.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(s.allowed_origins),
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


__all__ = ["build_app"]
