"""POST /tokenize and /detokenize, GET /tokenizer_info, in vLLM's shapes.

/tokenize takes a completion `prompt` or chat `messages` (rendered through the chat template, as
/v1/chat/completions would) and answers {"count", "max_model_len", "tokens"}; /detokenize takes
{"tokens"} and answers {"prompt"}; /tokenizer_info describes the tokenizer as tokenizer_config.json
would. Together they are the remote tokenizer of eval harnesses (lm-evaluation-harness's
`tokenizer_backend=remote`).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from izh.api.chat.prompt import render_chat_prompt
from izh.api.common.images import load_chat_images
from izh.api.common.state import api_state, check_model, json_response, read_json
from izh.api.ops.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from izh.errors import InvalidRequest
from izh.tokenizer import Tokenizer

# izh runs the model's tokenizer.json as it is, whatever class tokenizer_config.json names: that is
# what transformers' PreTrainedTokenizerFast(tokenizer_file=...) runs too.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_NAMED_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


async def tokenize(request: Request) -> Response:
    state = api_state(request)
    body = await read_json(request, TokenizeRequest)
    check_model(state, body.model)
    tokenizer = state.llm.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        image_processor = state.llm.image_processor
        images = await load_chat_images(
            body.messages,
            state.limits,
            accepts_images=image_processor is not None,
            model_name=state.model_name,
        )
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
            image_processor=image_processor,
            images=images,
        )
        token_ids = prompt.token_ids  # a VLM's image placeholders expanded, as the model sees them
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


async def tokenizer_info(request: Request) -> Response:
    state = api_state(request)
    return json_response(describe_tokenizer(state.llm.tokenizer, state.max_model_len))


def describe_tokenizer(tokenizer: Tokenizer, max_model_len: int) -> TokenizerInfoResponse:
    """The tokenizer_config.json view of `tokenizer`; model_max_length is what this server admits."""
    special = tokenizer.special_tokens
    # What encode(add_special_tokens=True) adds, read off the post-processor's actual behaviour.
    with_special = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    bos_id, eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    added = tokenizer.backend.get_added_tokens_decoder()
    extras = {name: content for name, content in special.items() if name not in _NAMED_TOKENS}
    return TokenizerInfoResponse(
        tokenizer_class=TOKENIZER_CLASS,
        bos_token=special.get("bos_token"),
        eos_token=special.get("eos_token"),
        pad_token=special.get("pad_token"),
        unk_token=special.get("unk_token"),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        unk_token_id=tokenizer.unk_token_id,
        add_bos_token=bos_id is not None and with_special[:1] == [bos_id] != plain[:1],
        add_eos_token=eos_id is not None and with_special[-1:] == [eos_id] != plain[-1:],
        model_max_length=max_model_len,
        # decode() applies no clean-up of spaces before punctuation.
        clean_up_tokenization_spaces=False,
        chat_template=tokenizer.chat_template,
        added_tokens_decoder={str(token_id): token.content for token_id, token in sorted(added.items())},
        **extras,
    )
