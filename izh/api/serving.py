"""What the generation routes share: the app's state, sampling params with the model's defaults,
fan-out of n x prompts into admitted child requests, merging their streams, logprobs and usage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from izh.api.protocol import (
    ChatLogprobEntry,
    CompletionLogprobs,
    PromptTokensDetails,
    RequestModel,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    parse_body,
)
from izh.errors import ContextLengthExceeded, EngineDead, InvalidRequest, ModelNotFound, Overloaded
from izh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from izh.api.metrics import PrometheusStatLogger
    from izh.frontend.async_llm import AsyncLLM, RequestStream
    from izh.frontend.output_processor import PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI's convention for "practically impossible".
MIN_LOGPROB = -9999.0
MAX_CHILD_REQUESTS = 1024
"""Most child requests (prompts x n) one HTTP request may fan out into."""
# The generation_config.json keys that are sampling defaults (vLLM's --generation-config auto).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

T = TypeVar("T")


@dataclass(slots=True)
class ApiState:
    """Everything a route needs, on `app.state.izh` (the draining flag is `app.state.draining`)."""

    llm: AsyncLLM
    model_name: str
    max_model_len: int
    max_body_bytes: int
    sse_keepalive_s: float | None
    reasoning_parser: str | None
    default_request_timeout_s: float | None
    metrics: PrometheusStatLogger
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = 0


def api_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.izh
    return state


def request_id_of(request: Request) -> str:
    """The id the app's middleware gave this request (the X-Request-Id it echoes, made unique)."""
    request_id = getattr(request.state, "request_id", None)
    return request_id if isinstance(request_id, str) else uuid.uuid4().hex


def json_response(body: BaseModel, status_code: int = 200) -> Response:
    """A pydantic body as JSON (serialized by pydantic, without FastAPI's re-validation)."""
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


def check_model(state: ApiState, model: str | None) -> None:
    """A request may omit the model; naming another one is a 404 model_not_found."""
    if model and model != state.model_name:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


def check_serving(request: Request) -> None:
    """Refuse new generation work while draining (503 with Retry-After) or when the core is dead."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    if getattr(request.app.state, "draining", False):
        raise Overloaded("server is shutting down")


async def read_json(request: Request, model: type[RequestModel]) -> RequestModel:
    """The validated body of a POST route (bounded by max_body_bytes)."""
    return await parse_body(request, model, api_state(request).max_body_bytes)


# --- sampling params ------------------------------------------------------------------------------


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
) -> int:
    """The max_tokens to run with, or ContextLengthExceeded with the numbers.

    A client's explicit max_tokens must fit beside the prompt (OpenAI's behaviour); a default is
    clamped to the room left instead.
    """
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens, which leaves no room for the completion. Please reduce "
            f"the length of the {param}.",
            param=param,
        )
    if explicit and requested is not None:
        if requested >= 1 and requested > room:
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
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
    }
    for key in _GENERATION_CONFIG_KEYS:
        value = getattr(body, key)
        if value is None:
            value = defaults.get(key)
        if value is not None:
            values[key] = value
    return SamplingParams(**values)


def check_unsupported(body: SamplingFields) -> None:
    """Structured outputs come in a later release: refuse them rather than answer unconstrained."""
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            raise InvalidRequest(f"{name} is not supported yet", param=name, code="unsupported")


def check_prompt_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids:
        raise InvalidRequest(f"the {param} is empty", param=param)
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(f"{param} token id {bad} is out of range [0, {vocab_size})", param=param)


# --- fan-out and admission ------------------------------------------------------------------------


@dataclass(slots=True)
class Child:
    """One child request: choice `index` = prompt_index * n + sample_index."""

    index: int
    prompt_index: int
    sample_index: int
    stream: RequestStream


def child_params(params: SamplingParams, sample_index: int) -> SamplingParams:
    """The params of one of n samples: n=1, and distinct seeds so seeded samples still differ."""
    seed = params.seed
    if seed is not None and sample_index:
        seed = seed + sample_index
    return msgspec.structs.replace(params, n=1, seed=seed)


async def admit(
    state: ApiState,
    base_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    priority: int,
    cache_salt: str | None,
) -> list[Child]:
    """Add every child request (ids `{base_id}-{i}`) before anything is streamed.

    `params[i]` (with the request's n) goes with `prompts[i]`. If any child is refused
    (overloaded, context length, ...), the admitted ones are aborted and the refusal propagates,
    so the client gets a real HTTP status.
    """
    n = params[0].n
    if len(prompts) * n > MAX_CHILD_REQUESTS:
        raise InvalidRequest(
            f"a request may ask for at most {MAX_CHILD_REQUESTS} completions (prompts x n), "
            f"got {len(prompts)} x {n}",
            param="n",
        )
    children: list[Child] = []
    try:
        for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            for sample_index in range(n):
                index = prompt_index * n + sample_index
                stream = await state.llm.add_request(
                    f"{base_id}-{index}",
                    prompt,
                    child_params(prompt_params, sample_index),
                    priority=priority,
                    cache_salt=cache_salt,
                    deadline_s=state.default_request_timeout_s,
                )
                children.append(Child(index, prompt_index, sample_index, stream))
    except BaseException:
        for child in children:
            child.stream.abort()
        raise
    return children


async def merge_outputs(children: list[Child]) -> AsyncIterator[tuple[Child, RequestOutput]]:
    """The outputs of all children as they come. Closing this generator aborts unfinished children.

    One pending read per child keeps each child's backpressure: outputs a slow client has not
    taken are merged by its RequestStream, never queued here.
    """
    pending: dict[asyncio.Future[RequestOutput], Child] = {}
    try:
        for child in children:
            pending[asyncio.ensure_future(anext(child.stream))] = child
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f].index):
                child = pending.pop(future)
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                if not out.finished:
                    pending[asyncio.ensure_future(anext(child.stream))] = child
                yield child, out
    finally:
        for future in pending:
            future.cancel()
        if pending:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(pending)
        for child in children:
            child.stream.abort()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Run `work`; if the client disconnects first, cancel it (aborting its requests).

    After the body is read, the next ASGI receive() returns only when the client goes away.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (task, watcher):
            if not future.done():
                future.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({task, watcher})
    if task.cancelled():
        logger.info("[%s] client disconnected; request aborted", request_id_of(request))
        # Nobody is there to read it; 499 is nginx's "client closed request".
        return Response(status_code=499)
    return task.result()


async def _wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# --- logprobs and usage ---------------------------------------------------------------------------


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(positions: list[PositionLogprobs], top_logprobs: int) -> list[ChatLogprobEntry]:
    """Chat's `logprobs.content` entries for generated positions."""
    return [
        ChatLogprobEntry(
            token=p.chosen.token,
            logprob=_finite(p.chosen.logprob),
            bytes=p.chosen.token_bytes,
            top_logprobs=[
                TopLogprob(token=t.token, logprob=_finite(t.logprob), bytes=t.token_bytes)
                for t in p.top[:top_logprobs]
            ],
        )
        for p in positions
    ]


def append_completion_logprobs(
    into: CompletionLogprobs,
    positions: list[PositionLogprobs | None],
    num_top: int,
    text_offset: int,
    prompt_token_strs: list[str] | None = None,
) -> int:
    """Extend the legacy completions shape; returns the text offset after the last token.

    A None position (the first prompt token has no logprob) needs its token text from
    `prompt_token_strs`. Like vLLM, the chosen token is always among its position's top_logprobs.
    """
    for i, position in enumerate(positions):
        if position is None:
            token = prompt_token_strs[i] if prompt_token_strs is not None else ""
            into.tokens.append(token)
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            token = position.chosen.token
            into.tokens.append(token)
            into.token_logprobs.append(_finite(position.chosen.logprob))
            top = {t.token: _finite(t.logprob) for t in position.top[:num_top]}
            top.setdefault(token, _finite(position.chosen.logprob))
            into.top_logprobs.append(top)
        into.text_offset.append(text_offset)
        text_offset += len(token)
    return text_offset


def prompt_logprobs_json(
    positions: list[PositionLogprobs | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` response field: per position {token_id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    result: list[dict[str, Any] | None] = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        entry = {
            str(t.token_id): {"logprob": _finite(t.logprob), "rank": None, "decoded_token": t.token}
            for t in position.top
        }
        entry[str(position.chosen.token_id)] = {
            "logprob": _finite(position.chosen.logprob),
            "rank": position.rank,
            "decoded_token": position.chosen.token,
        }
        result.append(entry)
    return result


@dataclass(slots=True)
class UsageCounter:
    """Token counts of one HTTP request: each prompt counted once however many samples it has."""

    num_prompt_tokens: dict[int, int] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    num_output_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, child: Child, out: RequestOutput) -> None:
        # Each prompt's first sample speaks for its prompt (later samples hit its cached prefix);
        # until it has spoken, any sample of that prompt does.
        if child.sample_index == 0 or child.prompt_index not in self.num_prompt_tokens:
            self.num_prompt_tokens[child.prompt_index] = out.num_prompt_tokens
            self.num_cached_tokens[child.prompt_index] = out.num_cached_tokens
        self.num_output_tokens[child.index] = out.num_output_tokens

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(self.num_prompt_tokens.values())
        completion_tokens = sum(self.num_output_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.num_cached_tokens.values())),
        )
