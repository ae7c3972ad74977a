"""POST /v1/chat/completions: messages through the chat template, then stream or collect.

Everything that can refuse the request (body, template, constraints, context length, admission of
every child) happens before the first byte, so a refusal is a real HTTP status. A streamed answer
is a role chunk per choice, reasoning, content and tool-call deltas, a finish chunk per choice,
then the usage chunk.

Tools: with tool_choice "auto" the tools are rendered and the model's output parsed for calls;
"none" renders and parses nothing; "required" or a named tool also constrains generation to
well-formed Hermes `<tool_call>` blocks whose arguments match the tool's parameters. A chat
template that never mentions `tools` gets them as a Hermes system prompt instead, and the tool
calls and tool results of the history as Hermes text. Output constraints (response_format,
structured_outputs, guided_*, forced tool calls) apply to the answer only when a reasoning parser
is active: the think block before it stays free (see serving.answer_only).
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

from izh.api.parsers import REASONING_PARSERS, THINK_END, ThinkReasoningParser, prompt_ends_in_reasoning
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolCallParam,
    ToolParam,
    UsageInfo,
)
from izh.api.serving import (
    ApiState,
    Child,
    Constraint,
    UsageCounter,
    admit,
    answer_only,
    api_state,
    build_sampling_params,
    chat_logprobs,
    check_constraint,
    check_model,
    check_serving,
    merge_outputs,
    prompt_logprobs_json,
    read_json,
    request_id_of,
    requested_constraints,
    resolve_max_tokens,
    respond,
    single_constraint,
)
from izh.api.sse import data_event
from izh.errors import InvalidRequest
from izh.frontend.tool_parsers import (
    HERMES_END,
    HERMES_START,
    ContentDelta,
    Delta,
    HermesToolParser,
    ToolCallDelta,
    ToolParser,
    collect,
    render_tools_system_prompt,
    select_tool_parser,
    tool_call_grammar,
)
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


def _arguments_value(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments as an object when they are a JSON object's text.

    Templates render arguments with `| tojson`: a JSON string would come out double-encoded.
    """
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        if isinstance(parsed, dict):
            return parsed
    return arguments


def _tool_call_dict(call: ToolCallParam) -> dict[str, Any]:
    result: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)},
    }
    if call.id is not None:
        result["id"] = call.id
    return result


def _hermes_call_text(call: ToolCallParam) -> str:
    body = {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)}
    return f"{HERMES_START}\n{json.dumps(body, ensure_ascii=False)}\n{HERMES_END}"


def template_messages(
    messages: list[ChatMessageParam], *, hermes_tools: bool = False
) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (HF's conventions).

    `hermes_tools` (a template without tool support): an assistant's tool calls become Hermes
    `<tool_call>` blocks in its content, and tool results `<tool_response>` blocks in a user
    message (consecutive results share one), as Hermes-trained models expect.
    """
    result: list[dict[str, Any]] = []
    after_tool_result = False
    for index, message in enumerate(messages):
        # Most templates know only "system"; OpenAI's "developer" means the same to an open model.
        role = "system" if message.role == "developer" else message.role
        text = message_text(message, index)
        if hermes_tools and role == "tool":
            response = f"<tool_response>\n{text or ''}\n</tool_response>"
            if after_tool_result:
                result[-1]["content"] += "\n" + response
            else:
                result.append({"role": "user", "content": response})
            after_tool_result = True
            continue
        after_tool_result = False
        item: dict[str, Any] = {"role": role, "content": text if text is not None else ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls and hermes_tools:
            blocks = "\n".join(_hermes_call_text(call) for call in message.tool_calls)
            item["content"] = f"{text}\n{blocks}" if text else blocks
        elif message.tool_calls:
            item["tool_calls"] = [_tool_call_dict(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:
            item["reasoning_content"] = reasoning
        result.append(item)
    return result


def with_tools_prompt(messages: list[dict[str, Any]], tools_prompt: str) -> list[dict[str, Any]]:
    """`messages` with the tools section after the first system message's text (or as a new one)."""
    if messages and messages[0]["role"] == "system":
        system = messages[0]["content"]
        first = {**messages[0], "content": f"{system}\n\n{tools_prompt}" if system else tools_prompt}
        return [first, *messages[1:]]
    return [{"role": "system", "content": tools_prompt}, *messages]


def template_source(tokenizer: Tokenizer, chat_template: str | None, *, with_tools: bool) -> str | None:
    """The template the renderer will use (its selection rule), or None when there is none."""
    templates = tokenizer.chat_templates
    if chat_template is not None:
        return templates.get(chat_template, chat_template)
    if with_tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (SmolLM2's, for one, never mentions them)."""
    return template is not None and "tools" in template


@dataclass(slots=True)
class ChatPrompt:
    text: str
    token_ids: list[int]
    template: str | None = None
    hermes_tools: bool = False
    """The tools (and tool history) were written as Hermes text: the template has no tool support."""


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
) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        **chat_template_kwargs,
    )
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


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
    a 400 from the renderer). `tools` go to the template when it supports them, else into the
    system message in the Hermes format (`render_tools_system_prompt`). `chat_template_kwargs`
    (e.g. enable_thinking) become template variables.
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
    template = template_source(tokenizer, chat_template, with_tools=tool_dicts is not None)
    hermes_tools = not supports_tools(template)
    chat = template_messages(messages, hermes_tools=hermes_tools)
    if tool_dicts is not None and hermes_tools:
        chat = with_tools_prompt(chat, render_tools_system_prompt(tool_dicts))
        tool_dicts = None
    text, token_ids = await asyncio.to_thread(
        _render_and_encode,
        tokenizer,
        chat,
        tool_dicts,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        add_special_tokens=add_special_tokens,
    )
    return ChatPrompt(text, token_ids, template, hermes_tools=hermes_tools and bool(tools))


# --- request checks, tools and constraints -------------------------------------------------------


def check_chat_request(body: ChatCompletionRequest) -> None:
    """Refuse inconsistent logprobs fields."""
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs"
            )
        if body.top_logprobs > 0 and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", param="top_logprobs")


def effective_tool_choice(body: ChatCompletionRequest) -> str | NamedToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if body.tool_choice is not None:
        return body.tool_choice
    return "auto" if body.tools else "none"


def tool_call_constraint(
    body: ChatCompletionRequest, tool_choice: str | NamedToolChoice
) -> Constraint | None:
    """The grammar forcing tool calls for "required" or a named tool (None for auto and none)."""
    if tool_choice in ("auto", "none"):
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
    spec = tool_call_grammar(tools, choice, body.parallel_tool_calls)
    return None if spec is None else Constraint(spec, "tool_choice")


def chat_tool_parser(
    state: ApiState, tool_choice: str | NamedToolChoice, tools_on: bool, prompt: ChatPrompt
) -> type[ToolParser] | None:
    """The parser for this request's output, or None when tool calls are not looked for.

    Forced calls and the Hermes tools prompt mean Hermes text, whatever the template; otherwise
    the configured parser ("auto": the one the template's tool format calls for).
    """
    if not tools_on:
        return None
    if tool_choice != "auto":
        return HermesToolParser
    if state.tool_call_parser == "none":
        return None
    if prompt.hermes_tools:
        return HermesToolParser
    return select_tool_parser(state.tool_call_parser, prompt.template)


# --- per-choice parsing ---------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceParsers:
    """One choice's output parsers: reasoning first, then tool calls in what is left (the content).

    With `forced` calls, content can only be a block cut short (max_tokens): it is dropped, never
    shown as markup. With `max_calls` (parallel_tool_calls false), later calls are dropped.
    """

    reasoning: ThinkReasoningParser | None
    tools: ToolParser | None
    forced: bool = False
    max_calls: int | None = None
    num_calls: int = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[Delta]]:
        """(reasoning, content and tool-call deltas) of the next piece of output."""
        reasoning, content = "", text
        if self.reasoning is not None:
            delta = self.reasoning.feed(text)
            reasoning, content = delta.reasoning, delta.content
            if finished:
                tail = self.reasoning.finish()
                reasoning, content = reasoning + tail.reasoning, content + tail.content
        if self.tools is None:
            return reasoning, [ContentDelta(content)] if content else []
        deltas = self.tools.feed(content) if content else []
        if finished:
            deltas += self.tools.finish()
        return reasoning, self._kept(deltas)

    def _kept(self, deltas: list[Delta]) -> list[Delta]:
        kept: list[Delta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                if not self.forced:
                    kept.append(delta)
            elif self.max_calls is None or delta.index < self.max_calls:
                kept.append(delta)
                self.num_calls = max(self.num_calls, delta.index + 1)
        return kept

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason


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
    tool_parser: type[ToolParser] | None = None
    forced_tool_calls: bool = False
    max_tool_calls: int | None = None
    parsers: dict[int, ChoiceParsers] = field(default_factory=dict)

    @property
    def tools_on(self) -> bool:
        return self.tool_parser is not None

    def new_parsers(self) -> ChoiceParsers:
        reasoning = None
        if self.parser_name is not None:
            reasoning = REASONING_PARSERS[self.parser_name](starts_in_reasoning=self.starts_in_reasoning)
        return ChoiceParsers(
            reasoning=reasoning,
            tools=self.tool_parser() if self.tool_parser is not None else None,
            forced=self.forced_tool_calls,
            max_calls=self.max_tool_calls,
        )

    def parser(self, index: int) -> ChoiceParsers:
        """The streaming parsers of choice `index`."""
        parsers = self.parsers.get(index)
        if parsers is None:
            parsers = self.parsers[index] = self.new_parsers()
        return parsers


async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions (stream or not), with vLLM's extensions."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, ChatCompletionRequest)
    check_model(state, body.model)
    check_chat_request(body)
    tool_choice = effective_tool_choice(body)
    tools_on = bool(body.tools) and tool_choice != "none"
    tool_constraint = tool_call_constraint(body, tool_choice)
    constraint = single_constraint(
        requested_constraints(body) + ([tool_constraint] if tool_constraint is not None else [])
    )
    llm = state.llm
    prompt = await render_chat_prompt(
        llm.tokenizer,
        body.messages,
        tools=body.tools if tools_on else None,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=body.add_special_tokens,
    )
    request_id = request_id_of(request)
    ctx = _context(state, body, prompt.text, request_id)
    ctx.tool_parser = chat_tool_parser(state, tool_choice, tools_on, prompt)
    ctx.forced_tool_calls = tool_constraint is not None
    ctx.max_tool_calls = 1 if body.parallel_tool_calls is False else None
    if constraint is not None:
        await check_constraint(state, constraint)
        # A generation prompt that already closed the think block (Qwen3's enable_thinking=false)
        # leaves only the answer to generate.
        if ctx.parser_name is not None and not prompt.text.rstrip().endswith(THINK_END):
            constraint = answer_only(constraint, in_reasoning=ctx.starts_in_reasoning)
            await check_constraint(state, constraint)
    params = _sampling_params(state, body, len(prompt.token_ids), constraint)
    children = await admit(
        state, ctx.id, [prompt.token_ids], [params], priority=body.priority, cache_salt=body.cache_salt
    )
    state.metrics.on_api_request(body.n)
    logger.debug(
        "[%s] chat: %d prompt tokens, %d choices, constraint %s, tool parser %s",
        request_id,
        len(prompt.token_ids),
        len(children),
        constraint.param if constraint is not None else "none",
        ctx.tool_parser.name if ctx.tool_parser is not None else "none",
    )
    return await respond(
        request,
        children,
        stream=body.stream,
        events=lambda: _chat_events(ctx, children),
        collect=lambda: _collect(ctx, children),
        keepalive_s=state.sse_keepalive_s,
        request_id=request_id,
    )


def _sampling_params(
    state: ApiState, body: ChatCompletionRequest, num_prompt_tokens: int, constraint: Constraint | None
) -> SamplingParams:
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
        structured_outputs=constraint.spec if constraint is not None else None,
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
        if out.finished:
            finish = ChatStreamChoice(
                index=child.index,
                delta=DeltaMessage(),
                finish_reason=parsers.finish_reason(out.finish_reason),
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
    # The streaming parsers fed the whole text: the two responses can never disagree.
    parsers = ctx.new_parsers()
    reasoning, deltas = parsers.feed("".join(choice.text), finished=True)
    text, calls = collect(deltas)
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
        finish_reason=parsers.finish_reason(choice.finish_reason),
        stop_reason=choice.stop_reason,
    )
