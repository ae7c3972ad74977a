"""Sampling params for a request: the request's values, else the model's defaults (generation_config.json),
else vLLM's; max_tokens by the API's policy (an explicit value as sent, a default clamped to the room the
prompt leaves). The params are checked against the model once, by the input processor on admission.
"""

from __future__ import annotations

from typing import Any

from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
)
from izh.api.common.constraints import Constraint
from izh.api.common.output_length import requested_output_length
from izh.api.common.protocol import (
    CompletionRequest,
    SamplingFields,
)
from izh.api.common.state import ApiState
from izh.errors import InvalidRequest
from izh.sampling_params import SamplingParams, StructuredOutputsParams, context_room

# The generation_config.json keys that are sampling defaults (vLLM's --generation-config auto).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The model's sampling defaults from generation_config.json (numbers only; junk is skipped).

    `max_new_tokens` becomes the default max_tokens. As with vLLM's `--generation-config auto`, a
    request's own values always win.
    """
    defaults: dict[str, Any] = {}
    for key in _GENERATION_CONFIG_KEYS:
        value = generation_config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults[key] = value
    max_new_tokens = generation_config.get("max_new_tokens")
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens > 0:
        defaults["max_tokens"] = max_new_tokens
    return defaults


def resolve_max_tokens(
    requested: int | None,
    *,
    explicit: bool,
    default: int | None,
    room: int,
    allow_prompt_only: bool = False,
) -> int | None:
    """The max_tokens to ask for: the API's policy; the context length is checked where the
    request is validated (`izh.frontend.input_processor`), once.

    A client's explicit max_tokens passes as it is (an explicit 0, compute the prompt and generate
    nothing, only with `allow_prompt_only`). A default (the request field's, else the model's) is
    clamped to the `room` the prompt leaves; None takes all of it. With no room, None: the input
    processor refuses the request with the numbers.
    """
    if explicit and requested is not None:
        if requested < 0 or (requested == 0 and not allow_prompt_only):
            raise InvalidRequest(f"max_tokens must be >= 1, got {requested}", param="max_tokens")
        return requested
    value = requested if requested is not None else default
    if value is None or room <= 0:
        return None
    return min(value, room)


def build_sampling_params(
    body: SamplingFields,
    defaults: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams for `body`: the request's values, else the model's defaults, else vLLM's.

    Validated on construction: a bad value raises InvalidRequest naming its field.
    """
    values: dict[str, Any] = {
        "n": body.n,
        "presence_penalty": body.presence_penalty if body.presence_penalty is not None else 0.0,
        "frequency_penalty": body.frequency_penalty if body.frequency_penalty is not None else 0.0,
        "seed": body.seed,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": body.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": dict(body.logit_bias) if body.logit_bias else None,
        # An empty allow-list is the client's, and a 400 (nothing could be sampled), not "no list".
        "allowed_token_ids": None if body.allowed_token_ids is None else list(body.allowed_token_ids),
        "bad_words": list(body.bad_words or []),
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "structured_outputs": structured_outputs,
        "speculative_decoding": body.speculative_decoding,
    }
    for key in _GENERATION_CONFIG_KEYS:
        value = getattr(body, key)
        if value is None:
            value = defaults.get(key)
        if value is not None:
            values[key] = value
    return SamplingParams(**values)


def chat_sampling_params(
    state: ApiState,
    body: ChatCompletionRequest,
    num_prompt_tokens: int,
    constraint: Constraint | None,
    clamp_output_length: bool = False,
) -> SamplingParams:
    """A chat request's params: max_completion_tokens (or the older max_tokens) beside the messages.

    `clamp_output_length` (Anthropic's Messages API): the requested length is clamped to the room the
    prompt leaves, as a default is, instead of refused when it does not fit."""
    requested = requested_output_length(body)
    max_tokens = resolve_max_tokens(
        requested[1] if requested is not None else None,
        explicit=requested is not None and not clamp_output_length,
        default=state.sampling_defaults.get("max_tokens"),
        room=context_room(state.max_model_len, num_prompt_tokens),
    )
    return build_sampling_params(
        body,
        state.sampling_defaults,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        structured_outputs=constraint.spec if constraint is not None else None,
    )


def completion_sampling_params(
    state: ApiState,
    body: CompletionRequest,
    num_prompt_tokens: int,
    structured_outputs: StructuredOutputsParams | None,
) -> SamplingParams:
    """The params of one prompt of a completion batch (echo with logprobs asks for the prompt's)."""
    max_tokens = resolve_max_tokens(
        body.max_tokens,
        # The field defaults to 16 (OpenAI's legacy default), which clamps rather than refuses.
        explicit="max_tokens" in body.model_fields_set and body.max_tokens is not None,
        default=state.sampling_defaults.get("max_tokens"),
        room=context_room(state.max_model_len, num_prompt_tokens),
        allow_prompt_only=body.echo,
    )
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        # Echoed prompt tokens carry logprobs too: ask the engine for the prompt's.
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    return build_sampling_params(
        body,
        state.sampling_defaults,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
    )
