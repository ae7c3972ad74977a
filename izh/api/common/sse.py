"""Server-sent events: framing, keep-alive comments, error events and the final `data: [DONE]`.

OpenAI's clients read `data: <json>\\n\\n` events until `data: [DONE]`; an event whose JSON has an
"error" key raises in the client, and comment lines (": ...") are ignored by every SSE parser, so
they keep proxies from closing a stream that waits for a long prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from izh.api.common.errors import error_response, to_izh_error

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # nginx buffers responses by default, which would hold the tokens back.
    "X-Accel-Buffering": "no",
}


def data_event(payload: str | bytes) -> bytes:
    """One event carrying a JSON payload (which never contains a raw newline)."""
    if isinstance(payload, str):
        payload = payload.encode()
    return b"data: " + payload + b"\n\n"


def error_event(exc: BaseException, request_id: str | None = None) -> bytes:
    """The event for a failure after the stream started, mapped exactly as an HTTP error would be."""
    return data_event(error_response(to_izh_error(exc, request_id)).model_dump_json())


async def with_keepalive(events: AsyncIterator[bytes], interval_s: float | None) -> AsyncIterator[bytes]:
    """Yield `events`, and a keep-alive comment whenever none came for `interval_s` seconds before
    the first one (a long queue or prefill is when proxies cut idle streams).

    The first event is awaited in a task that survives the timeout (cancelling it would cancel the
    underlying request); after it, events pass straight through: a task and a wait per token would
    cost more than the rest of the per-token path. So a route's first event must wait for the
    engine's first output (chat holds its role chunks until then), or the wait goes uncovered.
    Closing this generator closes `events`.
    """
    if interval_s is None or interval_s <= 0:
        async for event in events:
            yield event
        return
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
            break
        async for event in events:
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({pending})
        await _aclose(events)


async def sse_stream(
    events: AsyncIterator[bytes], *, keepalive_s: float | None, request_id: str | None = None
) -> AsyncIterator[bytes]:
    """A complete SSE body: `events` with keep-alives, an error event on failure, `[DONE]` last.

    A client that went away (cancellation) gets nothing more: there is no one left to read it.
    """
    try:
        async for event in with_keepalive(events, keepalive_s):
            yield event
    except Exception as exc:
        yield error_event(exc, request_id)
    yield DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its body iterator.

    Starlette leaves an interrupted iterator to the garbage collector; closing it here makes the
    abort of the underlying requests happen as soon as the client is gone.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        headers: Mapping[str, str] | None = None,
        *,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """`on_close` runs once the response is over however it ended, even if the body never
        started (a client gone before the first byte): the place to abort admitted requests."""
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        self._events = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self._events)
            if self._on_close is not None:
                self._on_close()


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
