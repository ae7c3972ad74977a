"""A response's output, built as the engine's outputs come: reasoning, message and function_call items
from chat's parsers (izh.api.chat.choices), the typed stream events OpenAI's SDK parses, the final
Response with its status and usage.

One machine serves both shapes: a stream yields its events, a collected response builds the same
items without them, so the two can never disagree. The events, in order: response.created and
response.in_progress (held until the first output, so that a queued request gets SSE keep-alives);
per item output_item.added, then for a message content_part.added, output_text.delta...,
output_text.done, content_part.done; for reasoning the same with reasoning_text; for a function call
function_call_arguments.delta..., .done; then output_item.done; last response.completed,
response.incomplete (max_output_tokens reached) or response.failed (the engine failed). Every event
carries its sequence_number. Per token only a small delta event is serialized; the whole Response
only at the start and the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from izh.api.chat.choices import ChatContext, ChoiceParsers
from izh.api.common.errors import to_izh_error
from izh.api.common.fanout import Child, UsageCounter, merge_outputs
from izh.api.common.logprobs import chat_logprobs
from izh.api.responses.items import new_item_id
from izh.api.responses.protocol import (
    CustomToolCallItem,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    LogprobTop,
    OutputItem,
    OutputLogprob,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseErrorInfo,
    ResponseObject,
    ResponseUsage,
)
from izh.parsers.tool_calls import ContentDelta, Delta, ToolCallDelta

if TYPE_CHECKING:
    from izh.frontend.output_processor import RequestOutput


@dataclass(slots=True)
class ResponseContext:
    """One response being made: its echo of the request (`base`, status in_progress), chat's parser
    context, the logprobs asked for, and what to do with the final Response (store it)."""

    base: ResponseObject
    chat: ChatContext
    top_logprobs: int | None
    request_id: str
    on_final: Callable[[ResponseObject], None] | None = None
    summary: bool = False
    """reasoning.summary asked for: the reasoning text is also the item's summary (and its events)."""
    seal: Callable[[str], str] | None = None
    """include reasoning.encrypted_content: seals a reasoning item's text."""
    namespaces: dict[str, str] = field(default_factory=dict)
    custom_tools: frozenset[str] = frozenset()


def _event(payload: dict[str, Any]) -> bytes:
    """One typed SSE event: `event: <type>` (as OpenAI sends) and the JSON."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


@dataclass(slots=True)
class _OpenItem:
    """The output item being streamed (only one is open at a time)."""

    kind: str  # "message" | "reasoning" | "function_call"
    index: int
    id: str
    parts: list[str] = field(default_factory=list)
    logprobs: list[OutputLogprob] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class OutputBuilder:
    """The output items of one response, fed the engine's outputs; with `emit`, the stream events too."""

    def __init__(self, ctx: ResponseContext, *, emit: bool) -> None:
        self.ctx = ctx
        self.emit = emit
        self.parsers: ChoiceParsers = ctx.chat.new_parsers()
        self.items: list[OutputItem] = []
        self.events: list[bytes] = []
        self.sequence_number = 0
        self.open: _OpenItem | None = None
        self.num_reasoning_tokens = 0
        self.ended = False
        self.finish_reason: str | None = None
        self.pending_logprobs: list[OutputLogprob] = []
        """Logprobs of tokens whose text is not out yet (held back: part of a UTF-8 character or a
        tag); they go with the next piece of text, or into the open message when the output ends."""

    # --- events --------------------------------------------------------------------------------------

    def _send(self, payload: dict[str, Any]) -> None:
        if self.emit:
            payload["sequence_number"] = self.sequence_number
            self.sequence_number += 1
            self.events.append(_event(payload))

    def take_events(self) -> bytes:
        events, self.events = b"".join(self.events), []
        return events

    def start(self) -> None:
        if self.emit:
            response = self.ctx.base.model_dump()
            self._send({"type": "response.created", "response": response})
            self._send({"type": "response.in_progress", "response": response})

    # --- feeding -------------------------------------------------------------------------------------

    def feed(self, out: RequestOutput) -> None:
        """Parse one output into items (and events); the caller aborts the request once `ended`."""
        reasoning_parser = self.parsers.reasoning
        thinking = reasoning_parser is not None and reasoning_parser.thinking
        reasoning, deltas = self.parsers.feed(out.text, out.finished)
        if reasoning or thinking:
            self.num_reasoning_tokens += len(out.token_ids)
        if self.ctx.top_logprobs is not None and out.logprobs:
            self.pending_logprobs += [
                OutputLogprob(
                    token=entry.token,
                    bytes=entry.bytes or [],
                    logprob=entry.logprob,
                    top_logprobs=[
                        LogprobTop(token=top.token, bytes=top.bytes or [], logprob=top.logprob)
                        for top in entry.top_logprobs
                    ],
                )
                for entry in chat_logprobs(out.logprobs, self.ctx.top_logprobs)
            ]
        if reasoning:
            self._reasoning(reasoning)
        if (reasoning or thinking) and not any(isinstance(delta, ContentDelta) for delta in deltas):
            self.pending_logprobs = []  # a thought's tokens: output_text logprobs cover the answer only
        for delta in deltas:
            logprobs = None
            if isinstance(delta, ContentDelta):
                logprobs, self.pending_logprobs = self.pending_logprobs, []
            self._delta(delta, logprobs)
        if out.finished or self.parsers.stopped:
            self.ended = True
            self.finish_reason = self.parsers.finish_reason(out.finish_reason)
            if self.pending_logprobs and self.open is not None and self.open.kind == "message":
                self._delta(ContentDelta(""), self.pending_logprobs)  # their text never came out
            self.pending_logprobs = []

    def _open_item(self, kind: str, **fields: Any) -> _OpenItem:
        if self.open is not None and self.open.kind == kind and kind != "function_call":
            return self.open
        self._close("completed")
        item = self.open = _OpenItem(kind, len(self.items), new_item_id(kind), **fields)
        self.items.append(self._item(item, "in_progress"))  # a placeholder until it is closed
        if self.emit:
            added = self._item(item, "in_progress")
            if kind != "function_call":
                added.content = []  # type: ignore[union-attr]
            self._send(
                {"type": "response.output_item.added", "output_index": item.index, "item": added.model_dump()}
            )
            if kind == "reasoning" and self.ctx.summary:
                added.summary = []  # type: ignore[union-attr]
                self._summary_event(item, "added", "")
            if kind != "function_call":
                self._send(
                    {
                        "type": "response.content_part.added",
                        "item_id": item.id,
                        "output_index": item.index,
                        "content_index": 0,
                        "part": self._part(item).model_dump(),
                    }
                )
        return item

    def _reasoning(self, text: str) -> None:
        item = self._open_item("reasoning")
        item.parts.append(text)
        where = {"item_id": item.id, "output_index": item.index}
        self._send({"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text})
        if self.ctx.summary:
            self._send(
                {"type": "response.reasoning_summary_text.delta", **where, "summary_index": 0, "delta": text}
            )

    def _summary_event(self, item: _OpenItem, kind: str, text: str) -> None:
        """response.reasoning_summary_part.added/.done and response.reasoning_summary_text.done."""
        where = {"item_id": item.id, "output_index": item.index, "summary_index": 0}
        part = {"type": "summary_text", "text": text}
        if kind == "text.done":
            self._send({"type": "response.reasoning_summary_text.done", **where, "text": text})
        else:
            self._send({"type": f"response.reasoning_summary_part.{kind}", **where, "part": part})

    def _delta(self, delta: Delta, logprobs: list[OutputLogprob] | None) -> None:
        if isinstance(delta, ContentDelta):
            item = self._open_item("message")
            item.parts.append(delta.text)
            if logprobs:
                item.logprobs.extend(logprobs)
            self._send(
                {
                    "type": "response.output_text.delta",
                    "item_id": item.id,
                    "output_index": item.index,
                    "content_index": 0,
                    "delta": delta.text,
                    "logprobs": [entry.model_dump() for entry in logprobs or ()],
                }
            )
            return
        assert isinstance(delta, ToolCallDelta)
        if delta.id is not None:
            item = self._open_item("function_call", call_id=delta.id, name=delta.name or "")
        else:
            item = self.open  # type: ignore[assignment]
            assert item is not None and item.kind == "function_call"
        if delta.arguments:
            item.parts.append(delta.arguments)
            if item.name in self.ctx.custom_tools:
                return  # a custom tool's input is sent whole, in its item
            self._send(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item.id,
                    "output_index": item.index,
                    "delta": delta.arguments,
                }
            )

    # --- items ---------------------------------------------------------------------------------------

    def _part(self, item: _OpenItem) -> OutputText | ReasoningText:
        text = "".join(item.parts)
        if item.kind == "reasoning":
            return ReasoningText(text=text)
        logprobs = item.logprobs if self.ctx.top_logprobs is not None else None
        return OutputText(text=text, logprobs=logprobs)

    def _item(self, item: _OpenItem, status: ItemStatus) -> OutputItem:
        if item.kind == "function_call":
            arguments = "".join(item.parts)
            if item.name in self.ctx.custom_tools:
                return CustomToolCallItem(
                    id=item.id,
                    call_id=item.call_id,
                    name=item.name,
                    input=custom_input(arguments),
                    status=status,
                )
            namespace = self.ctx.namespaces.get(item.name)
            return FunctionCallItem(
                id=item.id,
                call_id=item.call_id,
                name=item.name,
                arguments=arguments,
                status=status,
                namespace=namespace,
            )
        part = self._part(item)
        if isinstance(part, ReasoningText):
            summary = [{"type": "summary_text", "text": part.text}] if self.ctx.summary else []
            sealed = (
                self.ctx.seal(part.text) if self.ctx.seal is not None and status != "in_progress" else None
            )
            return ReasoningItem(
                id=item.id, content=[part], summary=summary, encrypted_content=sealed, status=status
            )
        return OutputMessage(id=item.id, content=[part], status=status)

    def _close(self, status: ItemStatus) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        done = self.items[item.index] = self._item(item, status)
        if not self.emit:
            return
        where = {"item_id": item.id, "output_index": item.index}
        if isinstance(done, CustomToolCallItem):
            pass  # sent whole in output_item.done
        elif isinstance(done, FunctionCallItem):
            self._send(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": done.name,
                    "arguments": done.arguments,
                }
            )
        else:
            part = done.content[0]
            if isinstance(part, ReasoningText):
                self._send(
                    {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part.text}
                )
                if self.ctx.summary:
                    self._summary_event(item, "text.done", part.text)
                    self._summary_event(item, "done", part.text)
            else:
                logprobs = [entry.model_dump() for entry in part.logprobs or ()]
                self._send(
                    {
                        "type": "response.output_text.done",
                        **where,
                        "content_index": 0,
                        "text": part.text,
                        "logprobs": logprobs,
                    }
                )
            self._send(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part.model_dump()}
            )
        self._send(
            {"type": "response.output_item.done", "output_index": item.index, "item": done.model_dump()}
        )

    # --- the end -------------------------------------------------------------------------------------

    def finish(self, usage: UsageCounter, error: BaseException | None = None) -> ResponseObject:
        """The final Response (and its closing events): completed, incomplete or failed."""
        reason = self.finish_reason
        if error is not None:
            status, event = "failed", "response.failed"
            info = to_izh_error(error, self.ctx.request_id)
            failure: ResponseErrorInfo | None = ResponseErrorInfo(code="server_error", message=info.message)
        elif reason == "length":
            status, event, failure = "incomplete", "response.incomplete", None
        elif reason in ("stop", "tool_calls"):
            status, event, failure = "completed", "response.completed", None
        else:  # "abort" by the engine (a deadline, a shutdown) or "error"
            status, event = "failed", "response.failed"
            failure = ResponseErrorInfo(code="server_error", message=f"the generation ended with {reason!r}")
        self._close("incomplete" if status != "completed" else "completed")
        counts = usage.usage()
        details = counts.prompt_tokens_details
        response = self.ctx.base.model_copy(
            update={
                "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": failure,
                "incomplete_details": IncompleteDetails(reason="max_output_tokens")
                if status == "incomplete"
                else None,
                "output": list(self.items),
                "usage": ResponseUsage(
                    input_tokens=counts.prompt_tokens,
                    input_tokens_details=InputTokensDetails(
                        cached_tokens=details.cached_tokens if details else 0
                    ),
                    output_tokens=counts.completion_tokens,
                    output_tokens_details=OutputTokensDetails(reasoning_tokens=self.num_reasoning_tokens),
                    total_tokens=counts.total_tokens,
                ),
            }
        )
        if self.ctx.on_final is not None:
            self.ctx.on_final(response)
        self._send({"type": event, "response": response.model_dump()})
        return response


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments of the function it runs as ({"input": "..."})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments  # cut off (max_output_tokens): the text as written
    text = value.get("input") if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


async def response_events(ctx: ResponseContext, children: list[Child]) -> AsyncIterator[bytes]:
    """The events of a streamed response (sse_stream adds keep-alives before the first, and [DONE]).

    A failure after the request was admitted ends the stream with response.failed (that failed
    Response is stored like any other).
    """
    builder = OutputBuilder(ctx, emit=True)
    usage = UsageCounter()
    started = False
    try:
        async for child, out in merge_outputs(children):
            if not started:
                started = True  # only now: until the first event the stream carries keep-alives
                builder.start()
            usage.add(child, out)
            if builder.ended:
                continue  # the engine's answer to our abort of a message the tool calls ended
            builder.feed(out)
            if builder.ended and not out.finished:
                child.stream.abort()
            if builder.events:
                yield builder.take_events()
    except Exception as exc:
        if not started:
            builder.start()
        builder.finish(usage, exc)
        yield builder.take_events()
        return
    builder.finish(usage)
    yield builder.take_events()


async def collect_response(ctx: ResponseContext, children: list[Child]) -> ResponseObject:
    """The whole response (not streamed): the same builder, without events."""
    builder = OutputBuilder(ctx, emit=False)
    usage = UsageCounter()
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        if builder.ended:
            continue
        builder.feed(out)
        if builder.ended and not out.finished:
            child.stream.abort()
    return builder.finish(usage)
