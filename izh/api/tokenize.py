"""POST /tokenize and /detokenize, in vLLM's shapes.

/tokenize takes a completion `prompt` or chat `messages` (rendered through the chat template, as
/v1/chat/completions would) and answers {"count", "max_model_len", "tokens"}; /detokenize takes
{"tokens"} and answers {"prompt"}.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from izh.api.chat import render_chat_prompt
from izh.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from izh.api.serving import api_state, check_model, json_response, read_json
from izh.errors import InvalidRequest


async def tokenize(request: Request) -> Response:
    state = api_state(request)
    body = await read_json(request, TokenizeRequest)
    check_model(state, body.model)
    tokenizer = state.llm.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        prompt = await render_chat_prompt(
            tokenizer,
            body.messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            # Templates write their own BOS.
            add_special_tokens=bool(body.add_special_tokens),
        )
        token_ids = prompt.token_ids
    else:
        add_special_tokens = body.add_special_tokens if body.add_special_tokens is not None else True
        token_ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "", add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return json_response(
        TokenizeResponse(
            count=len(token_ids), max_model_len=state.max_model_len, tokens=token_ids, token_strs=token_strs
        )
    )


async def detokenize(request: Request) -> Response:
    state = api_state(request)
    body = await read_json(request, DetokenizeRequest)
    check_model(state, body.model)
    vocab_size = state.llm.ready.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is out of range [0, {vocab_size})", param="tokens")
    text = await asyncio.to_thread(state.llm.tokenizer.decode, body.tokens)
    return json_response(DetokenizeResponse(prompt=text))
