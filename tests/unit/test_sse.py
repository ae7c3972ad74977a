"""SSE framing, byte for byte: events, keep-alive comments, error events and the final [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from izh.api.common.sse import (
    DONE,
    KEEPALIVE,
    SSEResponse,
    data_event,
    error_event,
    sse_stream,
    with_keepalive,
)
from izh.errors import ContextLengthExceeded, Overloaded


async def _collect(events: AsyncIterator[bytes]) -> list[bytes]:
    return [event async for event in events]


async def _items(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


def test_framing_is_byte_exact() -> None:
    assert data_event('{"a":1}') == b'data: {"a":1}\n\n'
    assert data_event(b"{}") == b"data: {}\n\n"
    assert DONE == b"data: [DONE]\n\n"
    assert KEEPALIVE == b": keep-alive\n\n"


def test_error_event_uses_the_one_mapping() -> None:
    event = error_event(ContextLengthExceeded("too long", param="messages"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") :]) == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    hidden = json.loads(error_event(RuntimeError("internal detail"))[len(b"data: ") :])
    assert hidden["error"]["type"] == "internal_error" and "internal detail" not in hidden["error"]["message"]


def test_a_stream_always_ends_with_done() -> None:
    events = asyncio.run(_collect(sse_stream(_items(b"data: 1\n\n", b"data: 2\n\n"), keepalive_s=None)))
    assert events == [b"data: 1\n\n", b"data: 2\n\n", DONE]


def test_a_failure_mid_stream_is_an_error_event_then_done() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise Overloaded("busy")

    events = asyncio.run(_collect(sse_stream(failing(), keepalive_s=None)))
    assert events[0] == b"data: 1\n\n" and events[-1] == DONE
    assert json.loads(events[1][len(b"data: ") :])["error"]["code"] == "overloaded"


def test_keepalive_comments_while_waiting_for_the_first_event() -> None:
    async def body() -> list[bytes]:
        first_token = asyncio.Event()

        async def slow() -> AsyncIterator[bytes]:
            await first_token.wait()  # set only once the consumer has seen a keep-alive
            yield b"data: late\n\n"

        stream = with_keepalive(slow(), 0.001)
        seen = [await anext(stream)]
        first_token.set()
        seen += [event async for event in stream if event != KEEPALIVE]
        return seen

    assert asyncio.run(body()) == [KEEPALIVE, b"data: late\n\n"]


def test_closing_the_stream_cancels_the_pending_read() -> None:
    async def body() -> list[str]:
        log: list[str] = []
        never = asyncio.Event()

        async def waits_forever() -> AsyncIterator[bytes]:
            try:
                await never.wait()
                yield b"data: never\n\n"
            except asyncio.CancelledError:
                log.append("cancelled")  # what aborts the request in a RequestStream
                raise

        stream = with_keepalive(waits_forever(), 0.001)
        assert await anext(stream) == KEEPALIVE
        await stream.aclose()
        return log

    assert asyncio.run(body()) == ["cancelled"]


async def _serve(response: SSEResponse, *, client_gone: bool) -> list[bytes]:
    """Run `response` as ASGI; with client_gone, the client disconnects before the first byte."""
    never = asyncio.Event()
    bodies: list[bytes] = []

    async def receive() -> dict[str, str]:
        if not client_gone:
            await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        if client_gone:
            await never.wait()  # the socket is dead: nothing goes out
        if message["type"] == "http.response.body":
            bodies.append(message["body"])  # type: ignore[arg-type]

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET", "path": "/", "headers": []}
    await response(scope, receive, send)  # type: ignore[arg-type]
    return bodies


@pytest.mark.parametrize("client_gone", [False, True])
def test_sse_response_runs_on_close_however_it_ends(client_gone: bool) -> None:
    async def body() -> tuple[list[str], list[bool], list[bytes]]:
        closed: list[str] = []
        started: list[bool] = []

        async def events() -> AsyncIterator[bytes]:
            started.append(True)
            yield b"data: 1\n\n"

        response = SSEResponse(
            sse_stream(events(), keepalive_s=None), on_close=lambda: closed.append("closed")
        )
        return closed, started, await _serve(response, client_gone=client_gone)

    closed, started, bodies = asyncio.run(body())
    # on_close is where admitted requests are aborted: it must run even if the body never started.
    assert closed == ["closed"]
    if client_gone:
        assert started == [] and bodies == []
    else:
        assert b"".join(bodies) == b"data: 1\n\n" + DONE
    assert SSEResponse(_items()).media_type == "text/event-stream"
