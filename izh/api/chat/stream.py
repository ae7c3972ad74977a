"""A streamed chat completion: a role chunk per choice (once the first output is there), reasoning,
content and tool-call deltas, a finish chunk per choice, then the usage chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from izh.api.chat.choices import ChatContext
from izh.api.common.chat_protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from izh.api.common.fanout import Child, UsageCounter, merge_outputs
from izh.api.common.logprobs import chat_logprobs
from izh.api.common.protocol import (
    UsageInfo,
)
from izh.api.common.sse import data_event
from izh.parsers.tool_calls import ContentDelta, Delta, ToolCallDelta


def _chunk(
    ctx: ChatContext,
    choices: list[ChatStreamChoice],
    usage: UsageInfo | None = None,
) -> bytes:
    chunk = ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage)
    return data_event(chunk.model_dump_json())


def _delta(reasoning: str, content: str) -> DeltaMessage:
    return DeltaMessage(
        content=content or None, reasoning_content=reasoning or None, reasoning=reasoning or None
    )


def _tool_call_delta(delta: ToolCallDelta) -> DeltaMessage:
    if delta.id is not None:
        call = DeltaToolCall(
            index=delta.index,
            id=delta.id,
            type="function",
            function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments),
        )
    else:
        call = DeltaToolCall(index=delta.index, function=DeltaFunctionCall(arguments=delta.arguments))
    return DeltaMessage(tool_calls=[call])


def stream_deltas(reasoning: str, deltas: list[Delta]) -> list[DeltaMessage]:
    """The delta messages of one output, in order: reasoning and content runs, one per tool-call piece."""
    messages: list[DeltaMessage] = []
    content: list[str] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
            continue
        if reasoning or content:
            messages.append(_delta(reasoning, "".join(content)))
            reasoning, content = "", []
        messages.append(_tool_call_delta(delta))
    if reasoning or content:
        messages.append(_delta(reasoning, "".join(content)))
    return messages


async def chat_events(ctx: ChatContext, children: list[Child]) -> AsyncIterator[bytes]:
    """The chunks of a streamed chat completion (sse_stream adds keep-alives, errors and [DONE])."""
    usage = UsageCounter()
    started = False
    ended: set[int] = set()  # choices whose finish chunk has gone out
    async for child, out in merge_outputs(children):
        if not started:
            # Only now: until the first event the stream carries keep-alives (sse.with_keepalive).
            started = True
            for each in children:
                yield _chunk(
                    ctx,
                    [ChatStreamChoice(index=each.index, delta=DeltaMessage(role="assistant", content=""))],
                )
                if ctx.echo_text:
                    yield _chunk(
                        ctx, [ChatStreamChoice(index=each.index, delta=DeltaMessage(content=ctx.echo_text))]
                    )
        usage.add(child, out)
        if child.index in ended:
            continue  # the engine's answer to our abort of a stopped choice
        running_usage = usage.usage() if ctx.continuous_usage else None
        parsers = ctx.parser(child.index)
        messages = stream_deltas(*parsers.feed(out.text, out.finished))
        logprobs = None
        if ctx.top_logprobs is not None and out.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(out.logprobs, ctx.top_logprobs))
        if logprobs is not None and not messages:
            messages = [DeltaMessage()]
        for position, message in enumerate(messages):
            choice = ChatStreamChoice(
                index=child.index, delta=message, logprobs=logprobs if position == 0 else None
            )
            yield _chunk(ctx, [choice], running_usage)
        if out.finished or parsers.stopped:
            ended.add(child.index)
            if not out.finished:
                child.stream.abort()
            finish = ChatStreamChoice(
                index=child.index,
                delta=DeltaMessage(),
                finish_reason=parsers.finish_reason(out.finish_reason),
                stop_reason=out.stop_reason,
            )
            yield _chunk(ctx, [finish], running_usage)
    if ctx.include_usage:
        yield _chunk(ctx, [], usage.usage())
