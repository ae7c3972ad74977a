"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API on chat's machinery.

The body becomes the chat request it means (izh.api.messages.convert); chat's `prepare_chat`
renders, constrains and admits it (so tools run through the same template, grammar-enforced tool
choice and tool-call parsers as chat), and izh.api.messages.stream builds the content blocks and
events. count_tokens renders the same prompt and counts it, admitting nothing. Auth is the guard's
(`x-api-key` or a bearer key); every error, before or during a stream, is in Anthropic's envelope
(izh.api.errors picks it by path).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from izh.api.chat.prompt import render_chat_prompt
from izh.api.chat.routes import prepare_chat
from izh.api.common.constraints import effective_tool_choice
from izh.api.common.fanout import Child, abort_all, respond
from izh.api.common.images import load_chat_images
from izh.api.common.protocol import RequestModel
from izh.api.common.sse import SSEResponse
from izh.api.common.state import (
    ApiState,
    api_state,
    check_can_generate,
    check_model,
    check_serving,
    read_json,
    request_id_of,
)
from izh.api.messages.convert import CLEAR_THINKING, Conversion, chat_request
from izh.api.messages.protocol import CountTokensRequest, MessagesRequest
from izh.api.messages.stream import (
    MessageContext,
    anthropic_sse,
    collect_message,
    message_events,
    new_message_id,
)
from izh.errors import InvalidRequest

logger = logging.getLogger(__name__)

_EXTRA = "Extra inputs are not permitted"


async def _read(request: Request, model: type[RequestModel]) -> RequestModel:
    """The validated body; an unknown field is refused as not supported (pydantic's words otherwise)."""
    try:
        return await read_json(request, model)
    except InvalidRequest as exc:
        if exc.message.endswith(_EXTRA) and exc.param:
            raise InvalidRequest(
                f"{exc.param}: this field is not supported by this server",
                param=exc.param,
                code="unsupported",
            ) from None
        raise


async def create_message(request: Request) -> Response:
    """Anthropic's Messages API (stream or not)."""
    state = api_state(request)
    check_serving(request)
    body = await _read(request, MessagesRequest)
    lora_name = check_model(state, body.model)
    check_can_generate(state)
    conversion = Conversion()
    chat_body = chat_request(
        body,
        reasoning=state.reasoning_parser is not None,
        open_signature=state.reasoning_seal.open,
        conversion=conversion,
    )
    request_id = request_id_of(request)
    message_id = new_message_id()
    chat = await prepare_chat(
        state, chat_body, request_id, message_id, lora_name=lora_name, clamp_output_length=True
    )
    state.metrics.on_api_request(1, "/v1/messages")
    if body.metadata is not None and body.metadata.user_id:
        logger.info("[%s] messages: metadata.user_id %s", request_id, body.metadata.user_id)
    omitted = body.thinking is not None and body.thinking.display == "omitted"
    ctx = MessageContext(
        id=message_id,
        model=body.model,
        chat=chat.ctx,
        stop_sequences=tuple(body.stop_sequences or ()),
        max_tokens=body.max_tokens,
        seal_thinking=state.reasoning_seal.seal if omitted else None,
        context_management=_applied_edits(state, conversion),
    )
    children = chat.children
    if body.stream:
        events = anthropic_sse(
            message_events(ctx, children), keepalive_s=state.sse_keepalive_s, request_id=request_id
        )
        return SSEResponse(events, on_close=lambda: abort_all(children))
    return await respond(
        request,
        children,
        stream=False,
        events=lambda: message_events(ctx, children),
        collect=lambda: _collected(ctx, children),
        keepalive_s=state.sse_keepalive_s,
        request_id=request_id,
    )


def _applied_edits(state: ApiState, conversion: Conversion) -> dict[str, Any] | None:
    """The response's `context_management`: the context edits that cleared something (Anthropic's
    shape; the cleared tokens counted as the thinking's own text tokenizes)."""
    if not conversion.context_edits:
        return None
    cleared = conversion.cleared_thinking
    if not cleared:
        return {"applied_edits": []}
    tokenizer = state.llm.tokenizer
    num_tokens = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in cleared)
    edit = {
        "type": CLEAR_THINKING,
        "cleared_thinking_turns": len(cleared),
        "cleared_input_tokens": num_tokens,
    }
    return {"applied_edits": [edit]}


async def _collected(ctx: MessageContext, children: list[Child]) -> JSONResponse:
    return JSONResponse(await collect_message(ctx, children))


async def count_tokens(request: Request) -> Response:
    """The prompt's token count for a Messages body: the same rendering, nothing admitted."""
    state = api_state(request)
    body = await _read(request, CountTokensRequest)
    check_model(state, body.model)
    check_can_generate(state)
    return JSONResponse({"input_tokens": await count_prompt_tokens(state, body)})


async def count_prompt_tokens(state: ApiState, body: CountTokensRequest) -> int:
    chat_body = chat_request(
        body, reasoning=state.reasoning_parser is not None, open_signature=state.reasoning_seal.open
    )
    tool_choice = effective_tool_choice(chat_body)
    tools_on = bool(chat_body.tools) and tool_choice != "none"
    image_processor = state.llm.image_processor
    images = await load_chat_images(
        chat_body.messages,
        state.limits,
        accepts_images=image_processor is not None,
        model_name=state.model_name,
    )
    prompt = await render_chat_prompt(
        state.llm.tokenizer,
        chat_body.messages,
        tools=chat_body.tools if tools_on else None,
        add_generation_prompt=True,
        continue_final_message=False,
        chat_template=None,
        chat_template_kwargs=chat_body.chat_template_kwargs,
        add_special_tokens=False,
        image_processor=image_processor,
        images=images,
    )
    return len(prompt.token_ids)
