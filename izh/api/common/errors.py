"""THE one mapping from an exception to OpenAI's error envelope, for HTTP responses and SSE events.

Every failure a client sees goes through `to_izh_error` (any exception → the IzhError that describes
it) and `error_response` (an IzhError → `{"error": {"message", "type", "param", "code"}}`): the app's
exception handlers and the request guard answer with `error_json_response`, and a stream that fails
after it started sends the same body as an SSE event (izh.api.common.sse.error_event). The error classes
themselves, each with its status and OpenAI type, are izh.errors.

Anthropic's Messages API (`/v1/messages...`, izh.api.messages) answers the same errors in Anthropic's
envelope instead, `{"type": "error", "error": {"type", "message"}}`, its type chosen by status
(`anthropic_error_body`): `error_json_response(..., anthropic=True)`, which the guard and the exception
handler pick by path (`is_anthropic_path`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pydantic
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from izh.errors import HTTPStatusError, InvalidRequest, IzhError, NotFound, Overloaded, Unauthorized

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""The Retry-After of a 503: the openai client retries 503s and honours it; a short wait spreads the load."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


def error_response(err: IzhError) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorInfo(message=err.message, type=err.error_type, param=err.param, code=err.code)
    )


def to_izh_error(exc: BaseException, request_id: str | None = None) -> IzhError:
    """THE mapping from any exception to the IzhError that describes it to a client.

    Used by the app's exception handlers and by SSE error events, so a failure reads the same
    before and after a stream has started. Unexpected exceptions are logged with their traceback
    and become a 500 that reveals nothing of the internals.
    """
    if isinstance(exc, IzhError):
        return exc
    if isinstance(exc, RequestValidationError | pydantic.ValidationError):
        return validation_error_to_invalid_request(exc)
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            return NotFound(str(exc.detail) if exc.detail else "not found")
        return HTTPStatusError(str(exc.detail), exc.status_code)
    logger.error("[%s] unexpected error", request_id or "-", exc_info=exc)
    return IzhError("internal server error", code="internal_error")


# Pydantic names the union member it tried inside an error's location ("str", "list[ContentPart]",
# "NamedToolChoice", "function-after[...]"); field names are lowercase identifiers without these.
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|tuple|none|literal|[A-Z].*|.*[\[\-].*)$")


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and _UNION_TAG.match(part) is not None


def validation_error_to_invalid_request(exc: pydantic.ValidationError | Any) -> InvalidRequest:
    """The first pydantic error as a 400 whose param is the field path ("messages.0.role").

    Accepts pydantic's ValidationError and FastAPI's RequestValidationError (both have .errors()).
    """
    errors = exc.errors()
    if not errors:
        return InvalidRequest("invalid request body")
    first = errors[0]
    # FastAPI prefixes the location with "body"; the client knows its own body's field names.
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return InvalidRequest(f"{where}{first.get('msg', 'invalid value')}", param=param)


ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """Whether a path is one of Anthropic's routes (answered in Anthropic's error envelope)."""
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def anthropic_error_body(err: IzhError) -> dict[str, Any]:
    """Anthropic's error envelope for `err`: its type from the status (any other status: api_error)."""
    error_type = _ANTHROPIC_ERROR_TYPES.get(err.status_code, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": err.message}}


def error_json_response(
    err: IzhError, headers: dict[str, str] | None = None, *, anthropic: bool = False
) -> JSONResponse:
    """The HTTP response for an error: status from its class, OpenAI's envelope (or, `anthropic`,
    Anthropic's) as the body."""
    all_headers = dict(headers or {})
    retry_after_s = getattr(err, "retry_after_s", None)
    if isinstance(retry_after_s, int):
        all_headers.setdefault("Retry-After", str(retry_after_s))  # a rate limit knows its wait
    if isinstance(err, Overloaded):
        all_headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    if isinstance(err, Unauthorized):
        all_headers.setdefault("WWW-Authenticate", "Bearer")
    body = anthropic_error_body(err) if anthropic else error_response(err).model_dump()
    return JSONResponse(body, status_code=err.status_code, headers=all_headers)


async def handle_exception(request: Request, exc: Exception) -> Response:
    """Every exception a route raises, as OpenAI's error envelope (the app's exception handler)."""
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else None
    request_id = getattr(request.state, "request_id", None)
    return error_json_response(
        to_izh_error(exc, request_id if isinstance(request_id, str) else None),
        headers,
        anthropic=is_anthropic_path(request.url.path),
    )


HANDLED_EXCEPTIONS: tuple[type[Exception], ...] = (IzhError, RequestValidationError, HTTPException, Exception)
"""The classes `handle_exception` is registered for (Starlette picks a handler by class)."""
