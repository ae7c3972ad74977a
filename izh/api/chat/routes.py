"""POST /v1/chat/completions: messages through the chat template, then stream or collect.

Everything that can refuse the request (body, template, constraints, context length, admission of
every child) happens before the first byte, so a refusal is a real HTTP status. A streamed answer
is a role chunk per choice, reasoning, content and tool-call deltas, a finish chunk per choice,
then the usage chunk. The role chunks wait for the first output, so that a request still queued or
prefilling gets SSE keep-alive comments (they are sent only before the first event).

Tools: with tool_choice "auto" the tools are rendered and the model's output parsed for calls;
"none" renders and parses nothing; "required" or a named tool also constrains generation to
well-formed Hermes `<tool_call>` blocks whose arguments match the tool's parameters (one block for a
named tool). A forced call that repeats an earlier one, or the first call when parallel_tool_calls
is false, ends the message: the request is aborted in the engine there and the choice finishes with
"tool_calls" (see izh.parsers.tool_calls). A chat template that never mentions `tools` gets them
as a Hermes system prompt instead, and the tool calls and tool results of the history as Hermes
text. Output constraints (response_format, structured_outputs, guided_*, forced tool calls) apply
to the answer only when a reasoning parser is active: the think block before it stays free (see
constraints.answer_only).

`prepare_chat` (template, constraints, sampling params, admission) is shared with the Responses
route (izh.api.responses.routes), which maps its body onto a chat request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from izh.api.chat.choices import ChatContext, chat_tool_parser
from izh.api.chat.collect import collect_chat_completion
from izh.api.chat.prompt import ChatPrompt, message_text, render_chat_prompt
from izh.api.chat.stream import chat_events
from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
)
from izh.api.common.constraints import (
    Constraint,
    answer_constraint,
    auto_tool_constraint,
    effective_tool_choice,
    requested_constraints,
    single_constraint,
    tool_call_constraint,
)
from izh.api.common.fanout import Child, admit, respond
from izh.api.common.images import load_chat_images
from izh.api.common.sampling import chat_sampling_params
from izh.api.common.state import (
    ApiState,
    api_state,
    check_can_generate,
    check_model,
    check_serving,
    read_json,
    request_id_of,
)
from izh.errors import InvalidRequest
from izh.parsers.harmony import HarmonyToolParser
from izh.parsers.hermes import HermesToolParser
from izh.parsers.reasoning import prompt_ends_in_reasoning
from izh.parsers.reasoning_parsers import HARMONY_PARSERS, reasoning_in_think_block
from izh.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


def check_chat_request(body: ChatCompletionRequest) -> None:
    """Refuse inconsistent logprobs fields."""
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs"
            )
        if body.top_logprobs > 0 and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", param="top_logprobs")


async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions (stream or not), with vLLM's extensions."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, ChatCompletionRequest)
    lora_name = check_model(state, body.model)
    request_id = request_id_of(request)
    chat = await prepare_chat(state, body, request_id, f"chatcmpl-{request_id}", lora_name=lora_name)
    state.metrics.on_api_request(body.n, "/v1/chat/completions")
    ctx, children = chat.ctx, chat.children
    return await respond(
        request,
        children,
        stream=body.stream,
        events=lambda: chat_events(ctx, children),
        collect=lambda: collect_chat_completion(ctx, children),
        keepalive_s=state.sse_keepalive_s,
        request_id=request_id,
    )


@dataclass(slots=True)
class PreparedChat:
    """A chat request rendered, constrained and admitted: what streaming or collecting it needs."""

    ctx: ChatContext
    prompt: ChatPrompt
    children: list[Child]


async def prepare_chat(
    state: ApiState,
    body: ChatCompletionRequest,
    request_id: str,
    response_id: str,
    prompt_param: str = "messages",
    lora_name: str | None = None,
    clamp_output_length: bool = False,
) -> PreparedChat:
    """Everything before the first byte: the template, tools and constraints, the sampling params and
    the admission of every child (ids `{response_id}-{i}`), each of which can refuse the request.

    The chat route's, and the Responses route's on the chat request its body maps to; the input
    processor names `prompt_param` in its refusals (context length). `lora_name`: the LoRA adapter the
    request runs with (from `state.check_model`), also the response's `model`. `clamp_output_length`:
    max_tokens is clamped to the room the prompt leaves (the Messages API's policy).
    """
    check_can_generate(state)
    check_chat_request(body)
    tool_choice = effective_tool_choice(body)
    tools_on = bool(body.tools) and tool_choice != "none"
    tool_constraint = tool_call_constraint(body, tool_choice)
    constraint = single_constraint(
        requested_constraints(body) + ([tool_constraint] if tool_constraint is not None else [])
    )
    image_processor = state.llm.image_processor
    images = await load_chat_images(
        body.messages, state.limits, accepts_images=image_processor is not None, model_name=state.model_name
    )
    prompt = await render_chat_prompt(
        state.llm.tokenizer,
        body.messages,
        tools=body.tools if tools_on else None,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=body.add_special_tokens,
        image_processor=image_processor,
        images=images,
    )
    ctx = _context(state, body, prompt.text, response_id)
    if lora_name is not None:
        ctx.model = lora_name
    ctx.tool_parser = chat_tool_parser(state, tool_choice, tools_on, prompt)
    ctx.forced_tool_calls = tool_constraint is not None
    if ctx.tool_parser is not None and tool_choice == "auto":
        ctx.loose_tool_names = frozenset(tool.function.name for tool in body.tools or [])
        # Hermes calls can be held well-formed while leaving text free; another constraint wins.
        if constraint is None and ctx.tool_parser is HermesToolParser:
            constraint = auto_tool_constraint(body)
    ctx.max_tool_calls = 1 if body.parallel_tool_calls is False else None
    if constraint is not None:
        constraint = await answer_constraint(
            state,
            constraint,
            reasoning=reasoning_in_think_block(ctx.parser_name),
            prompt_text=prompt.text,
            starts_in_reasoning=ctx.starts_in_reasoning,
        )
    if ctx.parser_name in HARMONY_PARSERS or ctx.tool_parser is HarmonyToolParser:
        # Harmony's markers are special tokens: its parsers read them, and drop them from the answer.
        body = body.model_copy(update={"skip_special_tokens": False})
    params = chat_sampling_params(
        state, body, len(prompt.token_ids), constraint, clamp_output_length=clamp_output_length
    )
    children = await admit(
        state,
        ctx.id,
        [prompt.token_ids],
        [params],
        prompt_params=[prompt_param],
        priority=body.priority,
        cache_salt=body.cache_salt,
        images=prompt.images,
        lora_name=lora_name,
    )
    _log_admitted(request_id, prompt, len(children), constraint, ctx)
    return PreparedChat(ctx, prompt, children)


def _context(state: ApiState, body: ChatCompletionRequest, prompt_text: str, response_id: str) -> ChatContext:
    last = body.messages[-1]
    # vLLM's chat echo: repeat the final message when it is the assistant's, being continued.
    echo_text = message_text(last, len(body.messages) - 1) if body.echo and last.role == "assistant" else None
    options = body.stream_options
    return ChatContext(
        id=response_id,
        created=int(time.time()),
        model=state.model_name,
        parser_name=state.reasoning_parser,
        starts_in_reasoning=prompt_ends_in_reasoning(prompt_text),
        echo_text=echo_text or None,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
    )


def _log_admitted(
    request_id: str, prompt: ChatPrompt, num_choices: int, constraint: Constraint | None, ctx: ChatContext
) -> None:
    logger.debug(
        "[%s] chat: %d prompt tokens, %d choices, constraint %s, tool parser %s",
        request_id,
        len(prompt.token_ids),
        num_choices,
        constraint.param if constraint is not None else "none",
        ctx.tool_parser.name if ctx.tool_parser is not None else "none",
    )
