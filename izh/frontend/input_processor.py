"""The one door into the engine core: a request's tokens and params checked against the model, once,
and the engine's AddRequest built from them.

`process_request` runs where a request's prompt token ids and sampling params are final, just before
it goes to the engine core: in `AsyncLLM.add_request` (the server) and in `LLM._add_request`
(offline), both with the model's facts (`ModelFacts`). Everything a user can get wrong about a
request with respect to the model is refused here (`validate_request`, and a VLM's image
placeholders), as InvalidRequest / ContextLengthExceeded with the message and param an HTTP error
body shows; the engine core and the scheduler then only assert what this guarantees (a request that
fails there is a bug, and fails alone with an internal error).

What runs elsewhere, once each: SamplingParams checks its own fields when it is built (types and
ranges, token ids >= 0); AsyncLLM checks what only it knows (request ids in flight, n == 1, the
RequestScope's limits) and admission.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from izh.engine_messages import AddRequest, ImageInput
from izh.errors import ContextLengthExceeded, InvalidRequest
from izh.guided_spec import validate_spec
from izh.pooling_params import PoolingParams
from izh.sampling_params import SamplingParams, context_room


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What validating a request needs to know of the model (the engine core's Ready, or the offline
    core's own answers)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    can_generate: bool = True
    pooling_task: str = "embed"
    """What the model's pooling requests do: "embed", or "score" (a cross-encoder)."""
    hidden_size: int = 0
    matryoshka_dimensions: Sequence[int] | None = None
    image_token_id: int | None = None
    """A VLM's image placeholder token; None for a model that takes no images."""


def process_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    facts: ModelFacts,
    *,
    prompt_param: str = "prompt",
    priority: int = 0,
    cache_salt: str | None = None,
    pooling_params: PoolingParams | None = None,
    images: list[ImageInput] | None = None,
    lora_name: str | None = None,
) -> AddRequest:
    """THE door into the engine core: one request (n == 1) checked against the model, returned as the
    AddRequest to send, its params validated (max_tokens resolved).

    `images` (a VLM's preprocessed images, placed in the prompt) are refused by a model that takes
    none; a VLM's prompt without images may not hold its placeholder token. Then `validate_request`.
    `prompt_param` names the field the prompt came from in the errors about it.
    """
    if images and facts.image_token_id is None:
        raise InvalidRequest(f"this model ({facts.model_name}) takes no images", param=prompt_param)
    if not images and facts.image_token_id is not None:
        check_no_image_placeholders(prompt_token_ids, facts.image_token_id, prompt_param)
    params = validate_request(
        prompt_token_ids,
        params,
        vocab_size=facts.vocab_size,
        max_model_len=facts.max_model_len,
        prompt_param=prompt_param,
        pooling_params=pooling_params,
        can_generate=facts.can_generate,
        pooling_task=facts.pooling_task,
        hidden_size=facts.hidden_size,
        matryoshka_dimensions=facts.matryoshka_dimensions,
    )
    return AddRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        arrival_time=time.time(),
        priority=priority,
        cache_salt=cache_salt,
        pooling_params=pooling_params,
        images=images or None,
        lora_name=lora_name,
    )


def check_no_image_placeholders(prompt_token_ids: list[int], image_token_id: int, param: str) -> None:
    """A VLM's prompt without images may not hold its image placeholder token: the model would read the
    placeholder's own embedding where features belong (transformers refuses it too)."""
    if image_token_id in prompt_token_ids:
        raise InvalidRequest(
            f"the {param} holds the model's image placeholder token but no image; send images as image_url "
            "parts of a chat message",
            param=param,
        )


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    prompt_param: str = "prompt",
    pooling_params: PoolingParams | None = None,
    can_generate: bool = True,
    pooling_task: str = "embed",
    hidden_size: int = 0,
    matryoshka_dimensions: Sequence[int] | None = None,
) -> SamplingParams:
    """Check one request (n == 1) against the model; returns its params with max_tokens resolved.

    A pooling request (`pooling_params` set, max_tokens 0) has its task and `dimensions` checked
    against the model (`validate_pooling`); a generation request to a model that cannot generate (an
    encoder: `can_generate` False) is refused, naming `model`.

    In this order: the prompt (non-empty, every id in [0, vocab_size)); the context length (a
    max_tokens None becomes the room the prompt leaves); the vocabulary-dependent sampling params
    (`SamplingParams.validate_vocab`); the structured outputs spec (llguidance can enforce it;
    cached by spec, so cheap when the same spec comes again).

    `prompt_param` names the field the prompt came from ("prompt", "prompt.1", "messages"): the
    errors about the prompt name it, as the OpenAI API does. Raises InvalidRequest, or
    ContextLengthExceeded when the prompt plus max_tokens do not fit `max_model_len`.
    """
    if pooling_params is not None:
        validate_pooling(
            pooling_params,
            task=pooling_task,
            hidden_size=hidden_size,
            matryoshka_dimensions=matryoshka_dimensions,
        )
        if params.max_tokens != 0:
            raise InvalidRequest(
                "an embedding request generates no tokens (max_tokens 0)", param="max_tokens"
            )
        if pooling_params.segment_start is not None and pooling_params.segment_start >= len(prompt_token_ids):
            raise InvalidRequest(
                f"the pair's second segment starts at token {pooling_params.segment_start}, past the "
                f"{len(prompt_token_ids)} tokens of the {prompt_param}",
                param=prompt_param,
            )
    elif not can_generate:
        raise InvalidRequest(
            cannot_generate_message(pooling_task), param="model", code="model_cannot_generate"
        )
    check_prompt_token_ids(prompt_token_ids, vocab_size, prompt_param)
    params = resolve_context(len(prompt_token_ids), params, max_model_len, prompt_param)
    params.validate_vocab(vocab_size)
    if params.structured_outputs is not None:
        validate_spec(params.structured_outputs)
    return params


def check_prompt_token_ids(prompt_token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """InvalidRequest(param=param) for an empty prompt or a token id outside [0, vocab_size)."""
    if not prompt_token_ids:
        raise InvalidRequest(f"the {param} is empty", param=param)
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(f"{param} token id {bad} is out of range [0, {vocab_size})", param=param)


def resolve_context(
    num_prompt_tokens: int, params: SamplingParams, max_model_len: int, prompt_param: str = "prompt"
) -> SamplingParams:
    """The params with max_tokens set, or ContextLengthExceeded with the numbers.

    max_tokens 0 (compute the prompt, sample nothing) lets the prompt fill the whole context; any
    other needs room for one output token at least; an explicit max_tokens must fit beside the
    prompt (OpenAI's behaviour: it is refused, not clamped); None takes all the room left.
    """
    max_tokens = params.max_tokens
    prefix = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens == 0:
        if num_prompt_tokens > max_model_len:
            raise ContextLengthExceeded(
                f"{prefix}your request has {num_prompt_tokens} input tokens. Please reduce the length "
                f"of the {prompt_param}.",
                param=prompt_param,
            )
        return params
    room = context_room(max_model_len, num_prompt_tokens)
    if room <= 0:
        raise ContextLengthExceeded(
            f"{prefix}your request has {num_prompt_tokens} input tokens, which leaves no room for the "
            f"completion. Please reduce the length of the {prompt_param}.",
            param=prompt_param,
        )
    if max_tokens is None:
        if params.min_tokens > room:
            # SamplingParams' own check, for the max_tokens resolved here.
            raise InvalidRequest(
                f"min_tokens ({params.min_tokens}) must be <= max_tokens ({room})", param="min_tokens"
            )
        return params.with_max_tokens(room)
    if max_tokens > room:
        raise ContextLengthExceeded(
            f"{prefix}you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of the "
            f"{prompt_param} or the completion.",
            param="max_tokens",
        )
    return params


def cannot_generate_message(pooling_task: str, model: str = "this model") -> str:
    """Why a model that only pools refuses generation, and which routes it serves."""
    if pooling_task == "score":
        return f"{model} is a cross-encoder (a reranker): it cannot generate text; use /v1/rerank or /score"
    return f"{model} is an embedding model (an encoder): it cannot generate text; use /v1/embeddings"


def validate_pooling(
    pooling: PoolingParams,
    *,
    task: str = "embed",
    hidden_size: int,
    matryoshka_dimensions: Sequence[int] | None,
) -> None:
    """InvalidRequest(param="model") for a task the model does not pool for (a cross-encoder scores
    pairs and embeds nothing; an embedding model has no classifier head to score with); then
    InvalidRequest(param="dimensions") unless the model may return `pooling.dimensions` values: it
    must declare Matryoshka training (config.json's `matryoshka_dimensions` or `is_matryoshka`), and
    the size must be one it lists (or any up to the hidden size, for `is_matryoshka`)."""
    if pooling.task != task:
        if task == "score":
            why = "a cross-encoder: it scores text pairs (/v1/rerank, /score) and returns no embeddings"
        else:
            why = "no cross-encoder: it has no classifier head to score a text pair with"
        raise InvalidRequest(
            f"this model is {why}",
            param="model",
            code="model_cannot_embed" if task == "score" else "model_cannot_score",
        )
    dims = pooling.dimensions
    if dims is None:
        return
    if matryoshka_dimensions is None:
        raise InvalidRequest(
            "this model does not support the dimensions parameter: it declares no Matryoshka "
            f"embeddings, so its vectors have {hidden_size} values and cannot be shortened",
            param="dimensions",
        )
    if dims > hidden_size:
        raise InvalidRequest(f"dimensions must be at most {hidden_size}, got {dims}", param="dimensions")
    if matryoshka_dimensions and dims not in matryoshka_dimensions:
        raise InvalidRequest(
            f"dimensions must be one of {', '.join(map(str, matryoshka_dimensions))} for this model, got {dims}",
            param="dimensions",
        )
