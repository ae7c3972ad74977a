"""Sampling params for a request: the request's values, else the model's defaults (generation_config.json),
else vLLM's; max_tokens resolved against the room the prompt leaves.
"""

from __future__ import annotations

from typing import Any

from izh.api.constraints import Constraint
from izh.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from izh.api.state import ApiState
from izh.errors import ContextLengthExceeded, InvalidRequest
from izh.sampling_params import SamplingParams, StructuredOutputsParams

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
    num_prompt_tokens: int,
    max_model_len: int,
    param: str,
    allow_prompt_only: bool = False,
) -> int:
    """The max_tokens to run with, or ContextLengthExceeded with the numbers.

    A client's explicit max_tokens must fit beside the prompt (OpenAI's behaviour); a default is
    clamped to the room left instead. An explicit 0 (compute the prompt, generate nothing) is
    refused unless `allow_prompt_only`; then the prompt alone may fill the context.
    """
    if explicit and requested is not None and requested < 1:
        if requested < 0 or not allow_prompt_only:
            raise InvalidRequest(f"max_tokens must be >= 1, got {requested}", param="max_tokens")
        if num_prompt_tokens > max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_model_len} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens. Please reduce the length of the {param}.",
                param=param,
            )
        return 0
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens, which leaves no room for the completion. Please reduce "
            f"the length of the {param}.",
            param=param,
        )
    if explicit and requested is not None:
        if requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {param}, {requested} "
                f"in the completion). Please reduce the length of the {param} or the completion.",
                param="max_tokens",
            )
        return requested
    value = requested if requested is not None else default
    return room if value is None else min(value, room)


def build_sampling_params(
    body: SamplingFields,
    defaults: dict[str, Any],
    *,
    max_tokens: int,
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
    }
    for key in _GENERATION_CONFIG_KEYS:
        value = getattr(body, key)
        if value is None:
            value = defaults.get(key)
        if value is not None:
            values[key] = value
    return SamplingParams(**values)


def chat_sampling_params(
    state: ApiState, body: ChatCompletionRequest, num_prompt_tokens: int, constraint: Constraint | None
) -> SamplingParams:
    """A chat request's params: max_completion_tokens (or the older max_tokens) beside the messages."""
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


def completion_sampling_params(
    state: ApiState,
    body: CompletionRequest,
    num_prompt_tokens: int,
    index: int,
    num_prompts: int,
    structured_outputs: StructuredOutputsParams | None,
) -> SamplingParams:
    """The params of prompt `index` of a completion batch (echo with logprobs asks for the prompt's)."""
    max_tokens = resolve_max_tokens(
        body.max_tokens,
        # The field defaults to 16 (OpenAI's legacy default), which clamps rather than refuses.
        explicit="max_tokens" in body.model_fields_set and body.max_tokens is not None,
        default=state.sampling_defaults.get("max_tokens"),
        num_prompt_tokens=num_prompt_tokens,
        max_model_len=state.max_model_len,
        param="prompt" if num_prompts == 1 else f"prompt.{index}",
        allow_prompt_only=body.echo,
    )
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        # Echoed prompt tokens carry logprobs too: ask the engine for the prompt's.
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    params = build_sampling_params(
        body,
        state.sampling_defaults,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
    )
    params.validate(state.llm.ready.vocab_size)
    return params
