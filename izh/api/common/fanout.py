"""Fan-out: n x prompts become admitted child requests (all or none), their outputs merge back into one
stream and their usage into one count, and the route answers (SSE or JSON), aborting them when the
client goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from izh.api.common.protocol import PromptTokensDetails, UsageInfo
from izh.api.common.sse import SSEResponse, sse_stream
from izh.api.common.state import ApiState, json_response, request_id_of
from izh.engine_messages import ImageInput
from izh.errors import InvalidRequest
from izh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from izh.frontend.async_llm import RequestStream
    from izh.frontend.output_processor import RequestOutput

logger = logging.getLogger(__name__)

MAX_CHILD_REQUESTS = 1024
"""Most child requests (prompts x n) one HTTP request may fan out into."""

T = TypeVar("T")


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
    prompt_params: list[str],
    priority: int,
    cache_salt: str | None,
    images: list[ImageInput] | None = None,
    lora_name: str | None = None,
) -> list[Child]:
    """Add every child request (ids `{base_id}-{i}`) before anything is streamed.

    `params[i]` (with the request's n) goes with `prompts[i]`, which came from the request field
    `prompt_params[i]` ("messages", "prompt", "prompt.1"): the input processor validates each child
    on admission and names that field in its errors. If any child is refused
    (overloaded, context length, ...), the admitted ones are aborted and the refusal propagates,
    so the client gets a real HTTP status. `images` (a chat prompt's, placed in it) go with every child.
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
        for prompt_index, (prompt, prompt_sampling, field) in enumerate(
            zip(prompts, params, prompt_params, strict=True)
        ):
            for sample_index in range(n):
                index = prompt_index * n + sample_index
                stream = await state.llm.add_request(
                    f"{base_id}-{index}",
                    prompt,
                    child_params(prompt_sampling, sample_index),
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_name=lora_name,
                    deadline_s=state.default_request_timeout_s,
                    prompt_param=field,
                    images=images,
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
    if len(children) == 1:
        # The common case (one prompt, n = 1): no futures and no wait per token.
        child = children[0]
        try:
            async for out in child.stream:
                yield child, out
        finally:
            child.stream.abort()
        return
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


def abort_all(children: list[Child]) -> None:
    for child in children:
        child.stream.abort()


async def respond(
    request: Request,
    children: list[Child],
    *,
    stream: bool,
    events: Callable[[], AsyncIterator[bytes]],
    collect: Callable[[], Awaitable[Any]],
    keepalive_s: float | None,
    request_id: str,
) -> Response:
    """The route's answer: an SSE stream of `events()`, or the JSON that `collect()` builds, aborting
    the children when the client goes away (or the route fails) either way."""
    if stream:
        body = sse_stream(events(), keepalive_s=keepalive_s, request_id=request_id)
        return SSEResponse(body, on_close=lambda: abort_all(children))
    try:
        result = await until_disconnected(request, collect())
    finally:
        abort_all(children)
    return result if isinstance(result, Response) else json_response(result)


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
