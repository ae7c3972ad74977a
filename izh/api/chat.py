"""POST /v1/chat/completions: messages through the chat template, then stream or collect.

Everything that can refuse the request (body, template, context length, admission of every child)
happens before the first byte, so a refusal is a real HTTP status. A streamed answer is a role
chunk per choice, content (and reasoning) deltas, a finish chunk per choice, then the usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from izh.api.parsers import REASONING_PARSERS, ThinkReasoningParser, prompt_ends_in_reasoning
from izh.api.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    DeltaMessage,
    NamedToolChoice,
    ToolParam,
    UsageInfo,
)
from izh.api.serving import (
    ApiState,
    Child,
    UsageCounter,
    admit,
    api_state,
    build_sampling_params,
    chat_logprobs,
    check_model,
    check_serving,
    check_unsupported,
    json_response,
    merge_outputs,
    prompt_logprobs_json,
    read_json,
    request_id_of,
    resolve_max_tokens,
    until_disconnected,
)
from izh.api.sse import SSEResponse, data_event, sse_stream
from izh.errors import InvalidRequest
from izh.sampling_params import MAX_LOGPROBS, SamplingParams
from izh.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Names the renderer itself passes to a template: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


# --- messages and the template -------------------------------------------------------------------


def message_text(message: ChatMessageParam, index: int) -> str | None:
    """A message's content as text: typed text parts joined with newlines (vLLM's rule)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text":
            raise InvalidRequest(
                f"messages[{index}]: content parts of type {part.type!r} are not supported (text only)",
                param=f"messages.{index}.content",
            )
        if part.text is None:
            raise InvalidRequest(
                f"messages[{index}]: a text content part needs a 'text' field",
                param=f"messages.{index}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _tool_call_dict(call: Any) -> dict[str, Any]:
    arguments = call.function.arguments
    # Templates render arguments with `| tojson`: a JSON string would come out double-encoded.
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    result: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.id is not None:
        result["id"] = call.id
    return result


def template_messages(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (HF's conventions)."""
    result = []
    for index, message in enumerate(messages):
        # Most templates know only "system"; OpenAI's "developer" means the same to an open model.
        role = "system" if message.role == "developer" else message.role
        text = message_text(message, index)
        item: dict[str, Any] = {"role": role, "content": text if text is not None else ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [_tool_call_dict(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:
            item["reasoning_content"] = reasoning
        result.append(item)
    return result


@dataclass(slots=True)
class ChatPrompt:
    text: str
    token_ids: list[int]


def _render_and_encode(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any],
    add_special_tokens: bool,
) -> ChatPrompt:
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        **chat_template_kwargs,
    )
    return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessageParam],
    *,
    tools: list[ToolParam] | None,
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    add_special_tokens: bool,
) -> ChatPrompt:
    """Render the chat through the template (sandboxed) and tokenize it, off the event loop.

    `add_generation_prompt` None means "unless continuing the final message" (asking for both is
    a 400 from the renderer).
    """
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    return await asyncio.to_thread(
        _render_and_encode,
        tokenizer,
        template_messages(messages),
        tool_dicts,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        add_special_tokens=add_special_tokens,
    )


# --- request checks ---------------------------------------------------------------------------------


def check_chat_request(body: ChatCompletionRequest) -> None:
    """Refuse what is not supported yet (by name), and inconsistent logprobs fields."""
    check_unsupported(body)
    if body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice):
        choice = "required" if body.tool_choice == "required" else "a named function"
        raise InvalidRequest(
            f"tool_choice {choice} is not supported yet; use auto or none",
            param="tool_choice",
            code="unsupported",
        )
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest(
            f"response_format type {body.response_format.type!r} is not supported yet (only 'text')",
            param="response_format",
            code="unsupported",
        )
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs"
            )
        if body.top_logprobs > 0 and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", param="top_logprobs")


# --- the route --------------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatContext:
    """What the response builders need besides the outputs."""

    id: str
    created: int
    model: str
    parser_name: str | None
    starts_in_reasoning: bool
    echo_text: str | None
    top_logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    parsers: dict[int, ThinkReasoningParser] = field(default_factory=dict)

    def parser(self, index: int) -> ThinkReasoningParser | None:
        if self.parser_name is None:
            return None
        parser = self.parsers.get(index)
        if parser is None:
            parser = REASONING_PARSERS[self.parser_name](starts_in_reasoning=self.starts_in_reasoning)
            self.parsers[index] = parser
        return parser


async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions (stream or not), with vLLM's extensions."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, ChatCompletionRequest)
    check_model(state, body.model)
    check_chat_request(body)
    llm = state.llm
    prompt = await render_chat_prompt(
        llm.tokenizer,
        body.messages,
        tools=body.tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=body.add_special_tokens,
    )
    params = _sampling_params(state, body, len(prompt.token_ids))
    request_id = request_id_of(request)
    ctx = _context(state, body, prompt.text, request_id)
    children = await admit(
        state, ctx.id, [prompt.token_ids], [params], priority=body.priority, cache_salt=body.cache_salt
    )
    state.metrics.on_api_request(body.n)
    logger.debug("[%s] chat: %d prompt tokens, %d choices", request_id, len(prompt.token_ids), len(children))
    if body.stream:
        events = sse_stream(
            _chat_events(ctx, children), keepalive_s=state.sse_keepalive_s, request_id=request_id
        )
        return SSEResponse(events, on_close=lambda: _abort_all(children))
    try:
        result = await until_disconnected(request, _collect(ctx, children))
    finally:
        _abort_all(children)
    return result if isinstance(result, Response) else json_response(result)


def _abort_all(children: list[Child]) -> None:
    for child in children:
        child.stream.abort()


def _sampling_params(state: ApiState, body: ChatCompletionRequest, num_prompt_tokens: int) -> SamplingParams:
    explicit = body.max_completion_tokens is not None or body.max_tokens is not None
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(
        requested,
        explicit=explicit,
        default=state.sampling_defaults.get("max_tokens"),
        num_prompt_tokens=num_prompt_tokens,
        max_model_len=state.max_model_len,
        param="messages",
    )
    params = build_sampling_params(
        body,
        state.sampling_defaults,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
    )
    params.validate(state.llm.ready.vocab_size)
    return params


def _context(state: ApiState, body: ChatCompletionRequest, prompt_text: str, request_id: str) -> ChatContext:
    last = body.messages[-1]
    # vLLM's chat echo: repeat the final message when it is the assistant's, being continued.
    echo_text = message_text(last, len(body.messages) - 1) if body.echo and last.role == "assistant" else None
    options = body.stream_options
    return ChatContext(
        id=f"chatcmpl-{request_id}",
        created=int(time.time()),
        model=state.model_name,
        parser_name=state.reasoning_parser,
        starts_in_reasoning=prompt_ends_in_reasoning(prompt_text),
        echo_text=echo_text or None,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
    )


def _split(ctx: ChatContext, index: int, text: str, finished: bool) -> tuple[str, str]:
    """(reasoning, content) of a text delta, through the choice's reasoning parser."""
    parser = ctx.parser(index)
    if parser is None:
        return "", text
    delta = parser.feed(text)
    if finished:
        tail = parser.finish()
        return delta.reasoning + tail.reasoning, delta.content + tail.content
    return delta.reasoning, delta.content


# --- streaming --------------------------------------------------------------------------------------


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


async def _chat_events(ctx: ChatContext, children: list[Child]) -> AsyncIterator[bytes]:
    """The chunks of a streamed chat completion (sse_stream adds keep-alives, errors and [DONE])."""
    usage = UsageCounter()
    for child in children:
        yield _chunk(
            ctx, [ChatStreamChoice(index=child.index, delta=DeltaMessage(role="assistant", content=""))]
        )
        if ctx.echo_text:
            yield _chunk(
                ctx, [ChatStreamChoice(index=child.index, delta=DeltaMessage(content=ctx.echo_text))]
            )
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        running_usage = usage.usage() if ctx.continuous_usage else None
        reasoning, content = _split(ctx, child.index, out.text, out.finished)
        logprobs = None
        if ctx.top_logprobs is not None and out.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(out.logprobs, ctx.top_logprobs))
        if reasoning or content or logprobs is not None:
            choice = ChatStreamChoice(index=child.index, delta=_delta(reasoning, content), logprobs=logprobs)
            yield _chunk(ctx, [choice], running_usage)
        if out.finished:
            finish = ChatStreamChoice(
                index=child.index,
                delta=DeltaMessage(),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            yield _chunk(ctx, [finish], running_usage)
    if ctx.include_usage:
        yield _chunk(ctx, [], usage.usage())


# --- collecting -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[ChatLogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def _collect(ctx: ChatContext, children: list[Child]) -> ChatCompletionResponse:
    """The whole answer of every choice (the non-streaming response)."""
    usage = UsageCounter()
    choices = {child.index: _Choice() for child in children}
    prompt_logprobs = None
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        choice = choices[child.index]
        choice.text.append(out.text)
        if ctx.top_logprobs is not None and out.logprobs:
            choice.logprobs.extend(chat_logprobs(out.logprobs, ctx.top_logprobs))
        if out.prompt_logprobs is not None and child.index == 0:
            prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
    return ChatCompletionResponse(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=[_chat_choice(ctx, index, choices[index]) for index in sorted(choices)],
        usage=usage.usage(),
        prompt_logprobs=prompt_logprobs,
    )


def _chat_choice(ctx: ChatContext, index: int, choice: _Choice) -> ChatChoice:
    text = "".join(choice.text)
    parser = ctx.parser(index)
    reasoning: str | None = None
    content: str | None = text
    if parser is not None:
        split = parser.parse_all(text)
        reasoning, content = split.reasoning or None, split.content
    if ctx.echo_text:
        content = ctx.echo_text + (content or "")
    return ChatChoice(
        index=index,
        message=ChatMessage(content=content, reasoning_content=reasoning, reasoning=reasoning),
        logprobs=ChatChoiceLogprobs(content=choice.logprobs) if ctx.top_logprobs is not None else None,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )
