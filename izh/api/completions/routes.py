"""POST /v1/completions: text or token-id prompts (one or a batch), n samples each, stream or not.

Choice `index` = prompt_index * n + sample_index. With `echo`, each choice starts with its prompt
(and, with logprobs, the prompt's logprobs; the first prompt token has none). `echo` with
`max_tokens: 0` scores a prompt (OpenAI's legacy API, eval harnesses): the engine computes the
prompt and samples nothing, and the choice is the prompt with its logprobs, finish_reason "length".
Output constraints (structured_outputs, guided_*, response_format) apply to every choice's completion.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from izh.api.common.completion_prompt import Prompt, decode_echoes, encode_prompts
from izh.api.common.constraints import check_constraint, requested_constraints, single_constraint
from izh.api.common.fanout import Child, UsageCounter, admit, merge_outputs, respond
from izh.api.common.logprobs import append_completion_logprobs, prompt_logprobs_json
from izh.api.common.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from izh.api.common.sampling import completion_sampling_params
from izh.api.common.sse import data_event
from izh.api.common.state import (
    api_state,
    check_can_generate,
    check_model,
    check_serving,
    read_json,
    request_id_of,
)
from izh.errors import InvalidRequest
from izh.frontend.output_processor import RequestOutput
from izh.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def check_completion_request(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise InvalidRequest("suffix is not supported", param="suffix", code="unsupported")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequest(
            "max_tokens must be >= 1; 0 (no completion) is accepted only with echo, to score the "
            "prompt (its text and, with logprobs, its logprobs)",
            param="max_tokens",
        )
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest(
            f"best_of must equal n (izh returns every sample it generates), got best_of={body.best_of}, n={body.n}",
            param="best_of",
        )


@dataclass(slots=True)
class CompletionContext:
    id: str
    created: int
    model: str
    prompts: list[Prompt]
    echo: bool
    logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    tokenizer: Tokenizer
    want_prompt_logprobs: bool = False
    offsets: dict[int, int] = field(default_factory=dict)
    """Per choice: the text offset the next token starts at (legacy logprobs)."""
    started: set[int] = field(default_factory=set)


async def create_completion(request: Request) -> Response:
    """OpenAI's legacy completions (stream or not), with vLLM's extensions."""
    state = api_state(request)
    check_serving(request)
    body = await read_json(request, CompletionRequest)
    lora_name = check_model(state, body.model)
    check_can_generate(state)
    check_completion_request(body)
    constraint = single_constraint(requested_constraints(body))
    llm = state.llm
    prompts = await encode_prompts(llm.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
    if constraint is not None:
        await check_constraint(state, constraint)
    structured_outputs = constraint.spec if constraint is not None else None
    params = [
        completion_sampling_params(state, body, len(prompt.token_ids), structured_outputs)
        for prompt in prompts
    ]
    request_id = request_id_of(request)
    options = body.stream_options
    ctx = CompletionContext(
        id=f"cmpl-{request_id}",
        created=int(time.time()),
        model=lora_name or state.model_name,
        prompts=prompts,
        echo=body.echo,
        logprobs=body.logprobs,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.continuous_usage_stats),
        tokenizer=llm.tokenizer,
        want_prompt_logprobs=body.prompt_logprobs is not None,
    )
    state.metrics.on_api_request(body.n, "/v1/completions")
    children = await admit(
        state,
        ctx.id,
        [p.token_ids for p in prompts],
        params,
        prompt_params=["prompt"] if len(prompts) == 1 else [f"prompt.{i}" for i in range(len(prompts))],
        priority=body.priority,
        cache_salt=body.cache_salt,
        lora_name=lora_name,
    )
    if body.echo:
        await decode_echoes(llm.tokenizer, prompts)
    logger.debug("[%s] completion: %d prompts, %d choices", request_id, len(prompts), len(children))
    return await respond(
        request,
        children,
        stream=body.stream,
        events=lambda: _events(ctx, children),
        collect=lambda: _collect(ctx, children),
        keepalive_s=state.sse_keepalive_s,
        request_id=request_id,
    )


def _first_token_strs(ctx: CompletionContext, child: Child) -> list[str]:
    """Display text of the first prompt token (the one position without a logprob)."""
    token_ids = ctx.prompts[child.prompt_index].token_ids[:1]
    return [ctx.tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in token_ids]


def _piece(ctx: CompletionContext, child: Child, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
    """The text and legacy logprobs one output adds to its choice (the echo on the first one)."""
    text = out.text
    logprobs = CompletionLogprobs() if ctx.logprobs is not None else None
    offset = ctx.offsets.get(child.index, 0)
    first = child.index not in ctx.started
    ctx.started.add(child.index)
    if first and ctx.echo:
        text = (ctx.prompts[child.prompt_index].text or "") + text
        if logprobs is not None and out.prompt_logprobs is not None:
            offset = append_completion_logprobs(
                logprobs, out.prompt_logprobs, ctx.logprobs or 0, offset, _first_token_strs(ctx, child)
            )
    if logprobs is not None and out.logprobs:
        offset = append_completion_logprobs(logprobs, list(out.logprobs), ctx.logprobs or 0, offset)
    ctx.offsets[child.index] = offset
    return text, logprobs


def _chunk(ctx: CompletionContext, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
    body = CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage)
    return data_event(body.model_dump_json())


async def _events(ctx: CompletionContext, children: list[Child]) -> AsyncIterator[bytes]:
    """The chunks of a streamed completion; the last text of a choice carries its finish_reason."""
    usage = UsageCounter()
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        text, logprobs = _piece(ctx, child, out)
        if not text and not out.finished and not (logprobs and logprobs.tokens):
            continue
        choice = CompletionChoice(
            index=child.index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        yield _chunk(ctx, [choice], usage.usage() if ctx.continuous_usage else None)
    if ctx.include_usage:
        yield _chunk(ctx, [], usage.usage())


async def _collect(ctx: CompletionContext, children: list[Child]) -> CompletionResponse:
    usage = UsageCounter()
    texts: dict[int, list[str]] = {child.index: [] for child in children}
    logprobs: dict[int, CompletionLogprobs] = {child.index: CompletionLogprobs() for child in children}
    finish: dict[int, RequestOutput] = {}
    prompt_logprobs: dict[int, list[dict[str, object] | None] | None] = {}
    async for child, out in merge_outputs(children):
        usage.add(child, out)
        text, piece = _piece(ctx, child, out)
        texts[child.index].append(text)
        if piece is not None:
            _extend(logprobs[child.index], piece)
        if out.prompt_logprobs is not None and ctx.want_prompt_logprobs:
            prompt_logprobs[child.index] = prompt_logprobs_json(out.prompt_logprobs)
        if out.finished:
            finish[child.index] = out
    choices = [
        CompletionChoice(
            index=index,
            text="".join(texts[index]),
            logprobs=logprobs[index] if ctx.logprobs is not None else None,
            finish_reason=finish[index].finish_reason if index in finish else None,
            stop_reason=finish[index].stop_reason if index in finish else None,
            prompt_logprobs=prompt_logprobs.get(index),
        )
        for index in sorted(texts)
    ]
    return CompletionResponse(
        id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage.usage()
    )


def _extend(into: CompletionLogprobs, piece: CompletionLogprobs) -> None:
    into.tokens.extend(piece.tokens)
    into.token_logprobs.extend(piece.token_logprobs)
    into.top_logprobs.extend(piece.top_logprobs)
    into.text_offset.extend(piece.text_offset)
