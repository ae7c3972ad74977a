"""A collected (non-streaming) chat completion: every choice parsed as its outputs come, as a stream's
would be, then one response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from izh.api.chat.choices import ChatContext, ChoiceParsers
from izh.api.common.chat_protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatMessage,
    FunctionCall,
    ToolCall,
)
from izh.api.common.fanout import Child, UsageCounter, merge_outputs
from izh.api.common.logprobs import chat_logprobs, prompt_logprobs_json
from izh.parsers.tool_calls import Delta, collect


@dataclass(slots=True)
class _Choice:
    """One choice being collected: its parsers fed as the outputs come, so that a message the tool
    calls end is stopped in the engine then, as when streaming."""

    parsers: ChoiceParsers
    reasoning: list[str] = field(default_factory=list)
    deltas: list[Delta] = field(default_factory=list)
    logprobs: list[ChatLogprobEntry] = field(default_factory=list)
    ended: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def collect_chat_completion(ctx: ChatContext, children: list[Child]) -> ChatCompletionResponse:
    """The whole answer of every choice (the non-streaming response)."""
    usage = UsageCounter()
    choices = {child.index: _Choice(ctx.new_parsers()) for child in children}
    prompt_logprobs = None
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        choice = choices[child.index]
        if choice.ended:
            continue  # the engine's answer to our abort of a stopped choice
        reasoning, deltas = choice.parsers.feed(out.text, out.finished)
        choice.reasoning.append(reasoning)
        choice.deltas.extend(deltas)
        if ctx.top_logprobs is not None and out.logprobs:
            choice.logprobs.extend(chat_logprobs(out.logprobs, ctx.top_logprobs))
        if out.prompt_logprobs is not None and child.index == 0:
            prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
        if out.finished or choice.parsers.stopped:
            choice.ended = True
            if not out.finished:
                child.stream.abort()
            choice.finish_reason = choice.parsers.finish_reason(out.finish_reason)
            choice.stop_reason = out.stop_reason
    return ChatCompletionResponse(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=[_chat_choice(ctx, index, choices[index]) for index in sorted(choices)],
        usage=usage.usage(),
        prompt_logprobs=prompt_logprobs,
    )


def _chat_choice(ctx: ChatContext, index: int, choice: _Choice) -> ChatChoice:
    # The same parsers as a stream's, fed the same text: the two responses can never disagree.
    text, calls = collect(choice.deltas)
    reasoning = "".join(choice.reasoning)
    content: str | None = text
    if not ctx.tools_on:
        content = text or ""
    if ctx.echo_text:
        content = ctx.echo_text + (content or "")
    tool_calls = [
        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in calls
    ]
    return ChatChoice(
        index=index,
        message=ChatMessage(
            content=content,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=tool_calls,
        ),
        logprobs=ChatChoiceLogprobs(content=choice.logprobs) if ctx.top_logprobs is not None else None,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )
