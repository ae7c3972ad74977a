"""The request guard: one pure-ASGI middleware that runs before any route.

RequestGuardMiddleware gives every request its id (X-Request-Id), checks the API key (constant-time,
against every key of the KeyRing) and names the key by its id, bounds the body (declared and actual
bytes, the time to send it; a client that disconnects meanwhile gets no answer), parses a JSON body
once to enforce the `[limits]` (depth, counts, sizes: izh.api.guard.limits) and hands the parsed value to
the route (izh.api.common.protocol.parse_body validates it without parsing the bytes again), reserves the
key's rate-limit tokens (izh.api.guard.ratelimit), sets the RequestScope through which the engine applies
the tenant's cache salt and collects usage, and afterwards settles the tokens and writes the request
log line. Every refusal is answered through izh.api.common.errors, as the routes' errors are.
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
)
from izh.api.common.errors import error_json_response, is_anthropic_path, to_izh_error
from izh.api.common.protocol import (
    PARSED_BODY,
    CompletionRequest,
    EmbeddingRequest,
    ParsedBody,
)
from izh.api.guard.limits import NOT_JSON, RequestLimits, parse_json
from izh.api.guard.ratelimit import (
    ANONYMOUS_KEY_ID,
    SCORING_PATHS,
    RateLimiter,
    Reservation,
    api_key_cache_salt,
    api_key_id,
    estimate_request_tokens,
)
from izh.api.messages.protocol import CountTokensRequest, MessagesRequest
from izh.api.ops.protocol import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from izh.api.ops.request_log import RequestLogger, RequestRecord
from izh.api.rerank.protocol import RerankRequest, ScoreRequest
from izh.api.responses.protocol import ResponsesRequest
from izh.errors import InvalidRequest, IzhError, PayloadTooLarge, RequestTimeout, Unauthorized
from izh.frontend.async_llm import REQUEST_SCOPE, RequestScope
from izh.settings import LimitSettings, RateLimitSettings

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
PUBLIC_PATHS = frozenset({"/health", "/ready", "/version"})
"""Open without an API key (and /metrics unless metrics_require_auth); every other path needs one."""
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings"}
    | SCORING_PATHS
)
"""The routes that run the model: rate-limited, and where a RequestScope collects usage."""
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest,
    "/rerank": RerankRequest,
    "/score": ScoreRequest,
    "/v1/score": ScoreRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
"""The POST routes with a JSON body (bounded by the middleware, described in the OpenAPI schema)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_MAX_REQUEST_ID_CHARS = 64
_REQUEST_ID_JUNK = re.compile(r"[^A-Za-z0-9._:-]")


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
    request_id_prefix: str = ""
    """Starts every made request id ("a1-" in API process 1 of several): ids stay unique across them."""


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
        prefix = self.policy.request_id_prefix
        request_id = (
            f"{client_id}-{prefix}{secrets.token_hex(4)}" if client_id else f"{prefix}{uuid.uuid4().hex}"
        )
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
                await error_json_response(refusal, anthropic=is_anthropic_path(scope["path"]))(
                    scope, receive, send_with_id
                )
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
            body, shared = parse_json(raw, policy.limits.settings.max_json_depth)
            if shared:  # the route validates this value instead of parsing the bytes again
                scope["state"][PARSED_BODY] = ParsedBody(raw, body)
            check = policy.limits.checker(path)
            if isinstance(body, dict) and check is not None:
                check(body)
        reservation = None
        key_id = record.key_id or ANONYMOUS_KEY_ID
        if path in GENERATION_PATHS and scope["method"] == "POST" and policy.rate_limiter.enabled:
            default_max_tokens = (
                COMPLETIONS_DEFAULT_MAX_TOKENS
                if path == "/v1/completions"
                else 0
                if path == "/v1/embeddings" or path in SCORING_PATHS  # no output tokens
                else policy.default_max_tokens
            )
            estimate = estimate_request_tokens(
                body,
                default_max_tokens=default_max_tokens,
                max_model_len=policy.limits.max_model_len,
                path=path,
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
            await error_json_response(
                to_izh_error(exc, record.request_id), anthropic=is_anthropic_path(scope["path"])
            )(scope, receive, send)
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


def build_rate_limiter(settings: RateLimitSettings, keys: KeyRing) -> RateLimiter:
    per_key = settings.key_limits()
    known = set(keys.key_ids) if keys else {ANONYMOUS_KEY_ID}
    for key_id in sorted(per_key.keys() - known):
        logger.warning("rate_limits.per_key names key id %s, which matches no API key", key_id)
    return RateLimiter(settings.default_limit(), per_key)
