"""A message's content blocks, built as the engine's outputs come: thinking, text and tool_use blocks from
chat's parsers (izh.api.chat_choices), Anthropic's stream events, and the final Message with its
stop_reason and usage.

One builder serves both shapes (as izh.api.responses_stream does): a stream yields its events, a
collected message builds the same blocks without them, so the two can never disagree. The events, in
order: message_start (held until the first output, so that a queued request gets SSE keep-alive
comments, and so that its usage knows the prompt's tokens), ping; per block content_block_start, its
deltas (thinking_delta then signature_delta, text_delta, input_json_delta), content_block_stop;
message_delta (stop_reason, stop_sequence, usage); message_stop. A failure after the start is an
`error` event in Anthropic's envelope. Per token only a small delta event is serialized.

usage: `input_tokens` are the prompt's tokens the prefix cache did not serve, `cache_read_input_tokens`
those it served (Anthropic's split); nothing is ever written to a cache on request
(`cache_creation_input_tokens` 0).

stop_reason: "max_tokens" at the request's max_tokens, "model_context_window_exceeded" when the
generation stopped earlier at the end of the context (max_tokens is clamped to the room the prompt
leaves, as Anthropic's API does). Thinking with display "omitted": no thinking_delta events, the
block's `thinking` empty and its `signature` the text sealed (izh.api.responses.reasoning.ReasoningSeal).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from izh.api.chat.choices import ChatContext, ChoiceParsers
from izh.api.common.errors import anthropic_error_body, to_izh_error
from izh.api.common.fanout import Child, UsageCounter, merge_outputs
from izh.api.common.sse import with_keepalive
from izh.errors import IzhError
from izh.parsers.tool_calls import ContentDelta, Delta, ToolCallDelta

if TYPE_CHECKING:
    from izh.frontend.output_processor import RequestOutput

logger = logging.getLogger(__name__)

_SIGNATURE_KEY = secrets.token_bytes(32)
"""Signs this process's thinking blocks (their `signature`): opaque to clients, as Anthropic's are."""


def thinking_signature(text: str) -> str:
    return hmac.new(_SIGNATURE_KEY, text.encode(), hashlib.sha256).hexdigest()


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a tool call's id ("toolu_..." for chat's "call_...")."""
    return "toolu_" + call_id.removeprefix("call_")


def event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class GenerationEnded(IzhError):
    """The engine ended the generation other than by a stop, a length or tool calls (an abort)."""


@dataclass(slots=True)
class MessageContext:
    """One message being made: its id, the served model's name, the stop sequences asked for, and
    chat's parser context."""

    id: str
    model: str
    chat: ChatContext
    stop_sequences: tuple[str, ...] = ()
    max_tokens: int | None = None
    """The max_tokens asked for (a length stop below it is the end of the context)."""
    seal_thinking: Callable[[str], str] | None = None
    """Thinking display "omitted": seals a thinking block's text into its signature."""
    context_management: dict[str, Any] | None = None
    """The response's `context_management` (the edits applied), when the request asked for edits."""


@dataclass(slots=True)
class _Block:
    kind: str  # "thinking" | "text" | "tool_use"
    index: int
    parts: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""

    def body(self, seal_thinking: Callable[[str], str] | None) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "thinking":
            if seal_thinking is not None:
                return {"type": "thinking", "thinking": "", "signature": seal_thinking(text)}
            return {"type": "thinking", "thinking": text, "signature": thinking_signature(text)}
        if self.kind == "text":
            return {"type": "text", "text": text}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": _tool_input(text)}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input. Under a grammar they are always an object;
    without one (tool_choice auto) a model may break them: then the input is empty, and a warning logged."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.warning(
            "a tool call's arguments are not a JSON object; its input is empty: %r", arguments[:200]
        )
        return {}
    return value


class MessageBuilder:
    """The content blocks of one message, fed the engine's outputs; with `emit`, the events too."""

    def __init__(self, ctx: MessageContext, *, emit: bool) -> None:
        self.ctx = ctx
        self.emit = emit
        self.parsers: ChoiceParsers = ctx.chat.new_parsers()
        self.blocks: list[_Block] = []
        self.open: _Block | None = None
        self.events: list[bytes] = []
        self.ended = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def take_events(self) -> bytes:
        events, self.events = b"".join(self.events), []
        return events

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        if self.emit:
            self.events.append(event(kind, payload))

    def start(self, usage: UsageCounter) -> None:
        message = self._message([], None, None, usage, output_tokens=0)
        self._send("message_start", {"message": message})
        self._send("ping", {})

    def feed(self, out: RequestOutput) -> None:
        """Parse one output into blocks (and events); the caller aborts the request once `ended`."""
        reasoning, deltas = self.parsers.feed(out.text, out.finished)
        if reasoning:
            self._thinking(reasoning)
        for delta in deltas:
            self._delta(delta)
        if out.finished or self.parsers.stopped:
            self.ended = True
            self.finish_reason = self.parsers.finish_reason(out.finish_reason)
            self.stop_reason = out.stop_reason
            self._close()

    def _open_block(self, kind: str, **fields: Any) -> _Block:
        if self.open is not None and self.open.kind == kind and kind != "tool_use":
            return self.open
        self._close()
        block = self.open = _Block(kind, len(self.blocks), **fields)
        self.blocks.append(block)
        if self.emit:
            start: dict[str, Any] = {"type": kind}
            if kind == "thinking":
                start |= {"thinking": "", "signature": ""}
            elif kind == "text":
                start["text"] = ""
            else:
                start |= {"id": block.id, "name": block.name, "input": {}}
            self._send("content_block_start", {"index": block.index, "content_block": start})
        return block

    def _thinking(self, text: str) -> None:
        block = self._open_block("thinking")
        block.parts.append(text)
        if self.ctx.seal_thinking is not None:
            return  # display "omitted": the text travels sealed in the signature only
        self._send(
            "content_block_delta",
            {"index": block.index, "delta": {"type": "thinking_delta", "thinking": text}},
        )

    def _delta(self, delta: Delta) -> None:
        if isinstance(delta, ContentDelta):
            if not delta.text:
                return
            block = self._open_block("text")
            block.parts.append(delta.text)
            self._send(
                "content_block_delta",
                {"index": block.index, "delta": {"type": "text_delta", "text": delta.text}},
            )
            return
        assert isinstance(delta, ToolCallDelta)
        if delta.id is not None:
            block = self._open_block("tool_use", id=tool_use_id(delta.id), name=delta.name or "")
        else:
            assert self.open is not None and self.open.kind == "tool_use"
            block = self.open
        if delta.arguments:
            block.parts.append(delta.arguments)
            self._send(
                "content_block_delta",
                {
                    "index": block.index,
                    "delta": {"type": "input_json_delta", "partial_json": delta.arguments},
                },
            )

    def _close(self) -> None:
        block, self.open = self.open, None
        if block is None or not self.emit:
            return
        if block.kind == "thinking":
            signature = block.body(self.ctx.seal_thinking)["signature"]
            self._send(
                "content_block_delta",
                {"index": block.index, "delta": {"type": "signature_delta", "signature": signature}},
            )
        self._send("content_block_stop", {"index": block.index})

    def _stop(self, output_tokens: int) -> tuple[str, str | None]:
        """Anthropic's (stop_reason, stop_sequence) for how the generation ended."""
        reason = self.finish_reason
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            requested = self.ctx.max_tokens
            if requested is not None and output_tokens < requested:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        if reason == "stop":
            matched = self.stop_reason
            if isinstance(matched, str) and matched in self.ctx.stop_sequences:
                return "stop_sequence", matched
            return "end_turn", None
        raise GenerationEnded(f"the generation ended with {reason!r}")

    def _message(
        self,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        stop_sequence: str | None,
        usage: UsageCounter,
        output_tokens: int,
    ) -> dict[str, Any]:
        message = {
            "id": self.ctx.id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage_json(usage, output_tokens),
        }
        if stop_reason is not None and self.ctx.context_management is not None:
            message["context_management"] = self.ctx.context_management
        return message

    def finish(self, usage: UsageCounter) -> dict[str, Any]:
        """The final Message (and, streaming, message_delta and message_stop)."""
        output_tokens = usage.usage().completion_tokens
        stop_reason, stop_sequence = self._stop(output_tokens)
        delta: dict[str, Any] = {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage_json(usage, output_tokens),
        }
        if self.ctx.context_management is not None:
            delta["context_management"] = self.ctx.context_management
        self._send("message_delta", delta)
        self._send("message_stop", {})
        content = [block.body(self.ctx.seal_thinking) for block in self.blocks]
        return self._message(content, stop_reason, stop_sequence, usage, output_tokens)


def usage_json(usage: UsageCounter, output_tokens: int) -> dict[str, Any]:
    counts = usage.usage()
    cached = counts.prompt_tokens_details.cached_tokens if counts.prompt_tokens_details else 0
    return {
        "input_tokens": counts.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


async def message_events(ctx: MessageContext, children: list[Child]) -> AsyncIterator[bytes]:
    """The events of a streamed message (without keep-alives and error events: `anthropic_sse`)."""
    builder = MessageBuilder(ctx, emit=True)
    usage = UsageCounter()
    started = False
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        if not started:
            started = True  # only now: until the first event the stream carries keep-alives
            builder.start(usage)
        if builder.ended:
            continue  # the engine's answer to our abort of a message the tool calls ended
        builder.feed(out)
        if builder.ended and not out.finished:
            child.stream.abort()
        if builder.events:
            yield builder.take_events()
    builder.finish(usage)
    yield builder.take_events()


async def collect_message(ctx: MessageContext, children: list[Child]) -> dict[str, Any]:
    """The whole message (not streamed): the same builder, without events."""
    builder = MessageBuilder(ctx, emit=False)
    usage = UsageCounter()
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        if builder.ended:
            continue
        builder.feed(out)
        if builder.ended and not out.finished:
            child.stream.abort()
    return builder.finish(usage)


async def anthropic_sse(
    events: AsyncIterator[bytes], *, keepalive_s: float | None, request_id: str | None = None
) -> AsyncIterator[bytes]:
    """A complete Anthropic SSE body: `events` with keep-alive comments, an `error` event on failure
    (no `[DONE]`: Anthropic's streams end with message_stop)."""
    try:
        async for chunk in with_keepalive(events, keepalive_s):
            yield chunk
    except Exception as exc:
        body = anthropic_error_body(to_izh_error(exc, request_id))
        yield event("error", {"error": body["error"]})
