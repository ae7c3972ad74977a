"""AsyncLLM: the API process's engine: admission, one output stream per request, deadlines, drain.

Everything that can refuse a request (validation, context length, admission) happens in
`add_request`, before the caller starts streaming, so a refusal is still a real HTTP status; the
request's validation against the model is `input_processor.process_request`, the one door into the core.
The core's outputs arrive as one EngineOutputs message per step; `_on_outputs` handles a message
in one synchronous pass: per request one detokenize/stop-check and one wake-up of its consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgspec

from izh.config import EngineConfig
from izh.engine.core_proc import DEFAULT_CORE_FACTORY
from izh.engine_messages import Abort, AddRequest, EngineOutputs, ImageInput, Ready
from izh.errors import (
    EngineDead,
    InvalidRequest,
    IzhError,
    LoraAdapterError,
    ModelNotFound,
    Overloaded,
)
from izh.frontend.client import EngineCoreClient
from izh.frontend.image_processor import load_image_processor
from izh.frontend.input_processor import ModelFacts, process_request
from izh.frontend.output_processor import OutputProcessor, RequestOutput, RequestState
from izh.frontend.stats import RequestMetrics, StatLogger, StatLoggers
from izh.pooling_params import PoolingParams
from izh.sampling_params import SamplingParams
from izh.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED_OUTPUTS = 1024


@dataclass(slots=True)
class RequestScope:
    """One API request as the engine sees it: the client's policy in, what its sequences used out.

    The API's middleware sets one per HTTP request in REQUEST_SCOPE; every `add_request` made in
    that context (a route may fan out into several) applies its policy, and each engine request adds
    its usage here when it ends. A context variable rather than a parameter, so that no route can
    forget the tenant's cache salt or escape its limits.
    """

    key_id: str | None = None
    cache_salt: str | None = None
    """The tenant's prefix-cache salt; a request's own cache_salt is appended to it."""
    max_prompt_tokens: int | None = None
    capture_text: bool = False
    """Keep the prompts and outputs (for a request log that asked for them)."""
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    first_token_time: float = 0.0
    """time.monotonic() of the first token of any of its requests (0.0: none yet)."""
    prompts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens of every sequence: what a rate limit charges."""
        return self.num_prompt_tokens + self.num_output_tokens

    def add_usage(self, metrics: RequestMetrics) -> None:
        self.num_prompt_tokens += metrics.num_prompt_tokens
        self.num_cached_tokens += metrics.num_cached_tokens
        self.num_output_tokens += metrics.num_generation_tokens
        if metrics.finish_reason is not None:
            self.finish_reasons.append(metrics.finish_reason)
        first = metrics.first_token_time
        if first and (not self.first_token_time or first < self.first_token_time):
            self.first_token_time = first


REQUEST_SCOPE: ContextVar[RequestScope | None] = ContextVar("izh_request_scope", default=None)


def combined_cache_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    """The salt an engine request runs with: the tenant's, then the request's own.

    Tenant salts have a fixed length, so the concatenation is unambiguous: no request salt can make
    one tenant's salt equal another's.
    """
    if tenant_salt is None:
        return request_salt
    return tenant_salt if request_salt is None else f"{tenant_salt}:{request_salt}"


class RequestStream:
    """The outputs of one request, as an async iterator of RequestOutput deltas.

    Ends after the output with `finished` set. A request that fails raises from the iterator:
    EngineDead when the core dies or the server shuts down, InvalidRequest when the core rejects it,
    IzhError otherwise. Cancelling the consuming task, `abort()`, `aclose()` or leaving an
    `async with` block early aborts the request (the core frees its blocks on its next step).
    Outputs the consumer has not taken yet are merged into one, never queued one by one.
    """

    __slots__ = (
        "_done",
        "_error",
        "_llm",
        "_num_buffered",
        "_pending",
        "_timer",
        "_waiter",
        "request_id",
        "scope",
        "state",
    )

    def __init__(
        self, request_id: str, state: RequestState, llm: AsyncLLM, scope: RequestScope | None = None
    ) -> None:
        self.request_id = request_id
        self.state = state
        self.scope = scope
        self._llm = llm
        self._pending: RequestOutput | None = None
        self._num_buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._done = False

    @property
    def finished(self) -> bool:
        """The request is over (its final output may still wait to be read)."""
        return self.state.finished or self._error is not None

    # --- producer side (AsyncLLM, on the event loop) -------------------------------------------

    def _put(self, out: RequestOutput) -> int:
        """Buffer one output for the consumer; returns how many are merged and unread."""
        if self._pending is None:
            self._pending = out
            self._num_buffered = 1
        else:
            self._pending.merge(out)
            self._num_buffered += 1
        self._wake()
        return self._num_buffered

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- consumer side --------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            out = self._pending
            if out is not None:
                self._pending = None
                self._num_buffered = 0
                if out.finished:
                    self._done = True
                if out.finish_reason == "error":
                    raise _request_error(out)
                return out
            if self._error is not None:
                error, self._error = self._error, None
                self._done = True
                raise error
            if self._done:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.abort()
                raise
            finally:
                self._waiter = None

    def abort(self) -> None:
        """Stop the request now (no-op once it finished)."""
        if not self._done:
            self._done = True
            self._pending = None
            self._llm._abort_request(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


def _request_error(out: RequestOutput) -> IzhError:
    """The exception a consumer sees for a finish_reason "error" output."""
    message = out.error or "the request failed"
    if out.error_code == 400:
        return InvalidRequest(message)
    if out.error_code == 503:
        return EngineDead(message)  # its engine core died (data parallel: the others serve on)
    return IzhError(message)


class ForwardToLLM:
    """A client's callbacks for an AsyncLLM that does not exist yet: they forward once `llm` is set.
    Until then no request is in flight, so nothing is lost; a death meanwhile is still recorded by the
    client (is_dead), and the starter checks it."""

    def __init__(self) -> None:
        self.llm: AsyncLLM | None = None

    def on_outputs(self, msg: EngineOutputs) -> None:
        if self.llm is not None:
            self.llm._on_outputs(msg)

    def on_dead(self, reason: str) -> None:
        if self.llm is not None:
            self.llm._on_dead(reason)


class AsyncLLM:
    """Generate with an engine core in another process (or a thread, for debugging).

    Call everything from one event loop. Start with `await AsyncLLM.start(config)`.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        *,
        max_requests_in_flight: int,
        max_waiting_requests: int,
        request_timeout_s: float | None,
        max_buffered_outputs: int,
        stat_loggers: Sequence[StatLogger],
        restart_dead_core: bool = False,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.model_name = config.served_model_name
        self.tokenizer = tokenizer
        self.max_requests_in_flight = max_requests_in_flight
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout_s = request_timeout_s
        self.max_buffered_outputs = max_buffered_outputs
        self.stat_loggers = StatLoggers(stat_loggers)
        self._processor = OutputProcessor(tokenizer)
        self.image_processor = load_image_processor(config.model)
        """A vision-language model's image processor (its prompt layout and pixels); None: text only."""
        self._requests: dict[str, RequestStream] = {}
        self._num_waiting = 0
        """Admitted requests without any output token yet (queued or prefilling in the core)."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._client: EngineCoreClient | None = None
        self.restart_dead_core = restart_dead_core
        self._client_options = dict(client_options or {})
        """EngineCoreClient.start's keyword arguments, to start a replacement core alike."""
        self.lora_adapters: dict[str, str] = {}
        """The LoRA adapters requests may name in `model`: name -> path (the core's, kept in step by
        `load_lora_adapter` / `unload_lora_adapter`; set from Ready at start)."""
        self._restart_task: asyncio.Task[None] | None = None
        self._restart_error: str | None = None
        self.num_core_restarts = 0

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        core_mode: str = "process",
        max_requests_in_flight: int = 512,
        max_waiting_requests: int = 1024,
        request_timeout_s: float | None = None,
        max_buffered_outputs: int = DEFAULT_MAX_BUFFERED_OUTPUTS,
        heartbeat_timeout_s: float = 30.0,
        heartbeat_interval_s: float | None = None,
        step_timeout_s: float | None = None,
        stat_loggers: Sequence[StatLogger] = (),
        core_factory: str = DEFAULT_CORE_FACTORY,
        ready_timeout_s: float = 600.0,
        tokenizer: Tokenizer | None = None,
        restart_dead_core: bool = False,
    ) -> AsyncLLM:
        """Load the tokenizer (here, no torch) while the core loads the model; wait for Ready.

        `max_waiting_requests` bounds admitted requests that have no output token yet;
        `max_buffered_outputs` bounds the step outputs a slow consumer leaves unread before its
        request is aborted. With `restart_dead_core`, a core that dies or hangs is replaced by a new
        one (its requests fail; see `_restart_core`). Raises ModelLoadError / EngineDead when the
        core cannot start.
        """
        forward = ForwardToLLM()
        client_options: dict[str, Any] = {
            "core_mode": core_mode,
            "core_factory": core_factory,
            "ready_timeout_s": ready_timeout_s,
            "heartbeat_interval_s": heartbeat_interval_s or min(5.0, heartbeat_timeout_s / 3),
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "step_timeout_s": step_timeout_s,
        }
        client_task = asyncio.ensure_future(
            EngineCoreClient.start(
                config, on_outputs=forward.on_outputs, on_dead=forward.on_dead, **client_options
            )
        )
        if tokenizer is None:
            tokenizer = await load_tokenizer_beside(config.model, client_task)
        client = await client_task
        llm = forward.llm = cls(
            config,
            tokenizer,
            max_requests_in_flight=max_requests_in_flight,
            max_waiting_requests=max_waiting_requests,
            request_timeout_s=request_timeout_s,
            max_buffered_outputs=max_buffered_outputs,
            stat_loggers=stat_loggers,
            restart_dead_core=restart_dead_core,
            client_options=client_options,
        )
        llm.bind_client(client)
        if client.is_dead:  # it died between Ready and now, before `llm` could hear of it
            llm._on_dead(client.dead_reason or "unknown")
        return llm

    def bind_client(self, client: EngineCoreClient) -> None:
        """Talk to the core(s) through `client` (started and ready), and serve the LoRA adapters they
        loaded at start."""
        self._client = client
        if client.ready is not None:
            self.lora_adapters = dict(client.ready.lora_adapters)

    # --- state ----------------------------------------------------------------------------------

    @property
    def client(self) -> EngineCoreClient:
        assert self._client is not None, "use AsyncLLM.start()"
        return self._client

    @property
    def ready(self) -> Ready:
        ready = self.client.ready
        assert ready is not None
        return ready

    @property
    def is_ready(self) -> bool:
        """Serving: the core is up and answered a heartbeat in time, no restart is under way, and
        the server is not draining."""
        client = self._client
        return (
            client is not None
            and not client.is_dead
            and client.is_responsive
            and self._restart_task is None
            and not self._draining
        )

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_restarting(self) -> bool:
        """A dead core is being replaced (new requests are refused until the new one is ready)."""
        return self._restart_task is not None

    @property
    def is_dead(self) -> bool:
        """The core is gone for good: dead, and no restart is under way (or one failed)."""
        return self._client is not None and self._client.is_dead and self._restart_task is None

    @property
    def dead_reason(self) -> str | None:
        reason = self._client.dead_reason if self._client is not None else None
        if reason is not None and self._restart_error is not None:
            reason = f"{reason}; the restart failed: {self._restart_error}"
        return reason

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    # --- requests -------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        deadline_s: float | None = None,
        prompt_param: str = "prompt",
        pooling_params: PoolingParams | None = None,
        images: list[ImageInput] | None = None,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Validate, admit and send one request (n == 1); returns its output stream.

        The request is validated here, once (`input_processor.process_request`; the core trusts
        it); `prompt_param` names the field the prompt came from in the errors about it
        ("prompt", "prompt.1", "messages"). `deadline_s` (seconds from now; default
        `request_timeout_s`) ends the request with what it has and finish_reason "length". The
        current RequestScope (if any) adds its cache salt and prompt limit and collects the usage.
        Raises InvalidRequest / ContextLengthExceeded for a bad request, Overloaded when too busy,
        draining or restarting the core, EngineDead when the core is gone.

        `pooling_params` makes it an embedding request (params with max_tokens 0): its finished
        output carries the vector in `embedding`. `images` are a VLM's preprocessed images, placed in
        the prompt by `image_processor` (izh.frontend.image_processor.ImagePrompt). `lora_name` runs it
        with that LoRA adapter (one of `lora_adapters`; another name is a 404 naming `model`).
        """
        if lora_name is not None and lora_name not in self.lora_adapters:
            raise ModelNotFound(f"The model `{lora_name}` does not exist.", param="model")
        scope = REQUEST_SCOPE.get()
        request = await self._processed_request(
            request_id,
            params,
            functools.partial(
                process_request,
                request_id,
                prompt_token_ids,
                params,
                self._model_facts(),
                prompt_param=prompt_param,
                priority=priority,
                cache_salt=combined_cache_salt(scope.cache_salt if scope else None, cache_salt),
                pooling_params=pooling_params,
                images=images,
                lora_name=lora_name,
            ),
        )
        if scope is not None:
            _check_prompt_limit(prompt_token_ids, scope.max_prompt_tokens)
        self._check_admission()
        now = time.monotonic()
        state = self._processor.make_request_state(
            request_id, prompt_token_ids, request.sampling_params, arrival_time=now
        )
        state.metrics.lora_name = lora_name
        stream = RequestStream(request_id, state, self, scope)
        self.client.send(request)
        if scope is not None:
            scope.num_requests += 1
            if scope.capture_text:
                scope.prompts.append(self.tokenizer.decode(prompt_token_ids))
        self._requests[request_id] = stream
        self._num_waiting += 1
        self._idle.clear()
        timeout_s = deadline_s if deadline_s is not None else self.request_timeout_s
        if timeout_s is not None:
            loop = asyncio.get_running_loop()
            stream._timer = loop.call_later(max(timeout_s, 0.0), self._on_deadline, stream)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        deadline_s: float | None = None,
        prompt_param: str = "prompt",
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """add_request, then yield its outputs; closing or cancelling the generator aborts it."""
        stream = await self.add_request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            deadline_s=deadline_s,
            prompt_param=prompt_param,
            lora_name=lora_name,
        )
        async with stream:
            async for out in stream:
                yield out

    async def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op when it already finished)."""
        self._abort_request(request_id)

    def _model_facts(self) -> ModelFacts:
        ready = self.ready
        return ModelFacts(
            model_name=self.model_name,
            vocab_size=ready.vocab_size,
            max_model_len=ready.max_model_len,
            can_generate=ready.can_generate,
            pooling_task=ready.pooling_task,
            hidden_size=ready.hidden_size,
            matryoshka_dimensions=ready.matryoshka_dimensions,
            image_token_id=self.image_processor.image_token_id if self.image_processor is not None else None,
        )

    async def _processed_request(
        self, request_id: str, params: SamplingParams, process: Callable[[], AddRequest]
    ) -> AddRequest:
        """What only AsyncLLM knows (ids in flight, one sequence), then the one door
        (`process`: `input_processor.process_request` with the request bound).

        A structured outputs spec may take a grammar compile to check: that runs off the event
        loop (the result is cached by spec, so a spec the API checked already is quick)."""
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if params.n != 1:
            raise InvalidRequest(
                f"AsyncLLM takes one sequence per request (n=1), got n={params.n}", param="n"
            )
        if params.structured_outputs is None:
            return process()
        request = await asyncio.to_thread(process)
        if request_id in self._requests:  # added by another task while this one waited
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        return request

    def _check_admission(self) -> None:
        client = self.client
        if self._restart_task is not None:
            raise Overloaded(
                "the engine core is restarting after a failure; retry shortly", code="engine_restarting"
            )
        if client.is_dead:
            raise EngineDead(f"the engine core is dead: {self.dead_reason}")
        if self._draining:
            raise Overloaded("server is shutting down")
        if len(self._requests) >= self.max_requests_in_flight:
            raise Overloaded(
                f"server is overloaded: {len(self._requests)} requests in flight "
                f"(limit {self.max_requests_in_flight}); retry later"
            )
        if self._num_waiting >= self.max_waiting_requests:
            raise Overloaded(
                f"server is overloaded: {self._num_waiting} requests waiting "
                f"(limit {self.max_waiting_requests}); retry later"
            )

    # --- the output path (hot: once per step) ----------------------------------------------------

    def _on_outputs(self, msg: EngineOutputs) -> None:
        now = time.monotonic()
        requests = self._requests
        process = self._processor.process
        loggers = self.stat_loggers if self.stat_loggers else None
        max_buffered = self.max_buffered_outputs
        to_abort: list[str] = []
        for eo in msg.outputs:
            stream = requests.get(eo.request_id)
            if stream is None:
                continue  # finished or aborted here already; the core's late word on it
            state = stream.state
            is_first = not state.metrics.first_token_time
            out = process(state, eo, now)
            if eo.new_token_ids:
                if is_first:
                    self._num_waiting -= 1
                if loggers is not None:
                    loggers.on_new_tokens(eo.request_id, len(eo.new_token_ids), now, is_first)
            if out.finished:
                self._forget(stream)
                if eo.finish_reason is None:
                    to_abort.append(eo.request_id)  # a stop string ended it; the core runs on
                stream._put(out)
            elif stream._put(out) > max_buffered:
                self._fail_slow_consumer(stream)
                to_abort.append(eo.request_id)
        if msg.stats is not None and loggers is not None:
            loggers.on_scheduler_stats(msg.stats)
        if to_abort:
            self._send_abort(to_abort)

    def _forget(self, stream: RequestStream) -> None:
        """Drop a finished request's bookkeeping and report its metrics."""
        del self._requests[stream.request_id]
        if stream._timer is not None:
            stream._timer.cancel()
        metrics = stream.state.metrics
        if not metrics.first_token_time:
            self._num_waiting -= 1
        scope = stream.scope
        if scope is not None:
            scope.add_usage(metrics)
            if scope.capture_text:
                scope.outputs.append(stream.state.detokenizer.text)
        if self.stat_loggers:
            self.stat_loggers.on_request_finished(metrics)
        if not self._requests:
            self._idle.set()

    def _finish_from_frontend(
        self, stream: RequestStream, finish_reason: str, *, error: str | None = None, error_code: int = 0
    ) -> RequestOutput:
        out = self._processor.finish(
            stream.state, finish_reason, time.monotonic(), error=error, error_code=error_code
        )
        self._forget(stream)
        return out

    def _fail_slow_consumer(self, stream: RequestStream) -> None:
        logger.warning(
            "request %s: aborted, its consumer left more than %d outputs unread",
            stream.request_id,
            self.max_buffered_outputs,
        )
        out = self._finish_from_frontend(
            stream,
            "error",
            error=f"the client read too slowly: more than {self.max_buffered_outputs} outputs were buffered",
            error_code=500,
        )
        stream._pending = None
        stream._put(out)

    def _on_deadline(self, stream: RequestStream) -> None:
        if stream.state.finished or self._requests.get(stream.request_id) is not stream:
            return
        logger.info("request %s: deadline reached; ending it with finish_reason length", stream.request_id)
        stream._put(self._finish_from_frontend(stream, "length"))
        self._send_abort([stream.request_id])

    def _abort_request(self, request_id: str) -> None:
        stream = self._requests.get(request_id)
        if stream is None:
            return
        logger.debug("request %s: aborted", request_id)
        stream._put(self._finish_from_frontend(stream, "abort"))
        self._send_abort([request_id])

    def _send_abort(self, request_ids: list[str]) -> None:
        client = self.client
        if client.is_dead:
            return
        with contextlib.suppress(IzhError):  # the core is gone or closing: nothing left to free
            client.send(Abort(request_ids))

    def _on_dead(self, reason: str) -> None:
        """Fail every in-flight request: the core that ran them is gone. Then maybe replace it."""
        self._fail_all(EngineDead(f"the engine core is dead: {reason}"))
        if self.restart_dead_core and not self._draining and self._restart_task is None:
            self._restart_task = asyncio.get_running_loop().create_task(
                self._restart_core(reason), name="izh-core-restart"
            )

    async def _restart_core(self, reason: str) -> None:
        """Stop what is left of the dead (or hung) core and start a new one alike.

        While this runs, new requests get 503 with Retry-After and /ready is red. If the new core
        cannot start, the server is dead for good (`is_dead`), as without restarts.
        """
        logger.warning("restarting the engine core (%s)", reason)
        try:
            await self.client.shutdown(timeout_s=0)  # hung or dead: nothing to wait for
            # (A shutdown() meanwhile cancels this task; start() then stops the half-started core.)
            self._client = await EngineCoreClient.start(
                self.config, on_outputs=self._on_outputs, on_dead=self._on_dead, **self._client_options
            )
        except Exception as exc:
            self._restart_error = str(exc) or type(exc).__name__
            logger.error("the engine core could not be restarted: %s", self._restart_error)
            return
        finally:
            self._restart_task = None
        try:
            await self._resync_lora_adapters()
        except Exception as exc:  # the new core serves the base model and its start-up adapters anyway
            logger.error("LoRA adapters not restored after the restart: %s", exc)
        self.num_core_restarts += 1
        logger.info("engine core restarted (%d restarts so far)", self.num_core_restarts)

    def _fail_all(self, error: IzhError) -> None:
        streams = list(self._requests.values())
        if streams:
            logger.error("failing %d in-flight requests: %s", len(streams), error.message)
        for stream in streams:
            self._processor.finish(stream.state, "error", time.monotonic(), error=error.message)
            self._forget(stream)
            stream._fail(error)

    # --- utilities and shutdown -----------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """The core's latest published SchedulerStats (as a dict) with their age `stats_age_s` (None
        before the first), plus the frontend's request counts. Never waits for the core: it publishes
        while busy and idle, so the age is at most its current step plus a few ms.

        Leaves out the block map (`get_kv_block_map`) and `iteration_tokens` (a per-message delta
        that /metrics' histogram consumes).
        """
        stats, age = self.client.latest_stats()
        result: dict[str, Any] = {} if stats is None else msgspec.structs.asdict(stats)
        result.pop("iteration_tokens", None)
        result.pop("kv_block_states", None)
        result["num_requests_in_flight"] = self.num_in_flight
        result["num_requests_waiting_frontend"] = self._num_waiting
        result["stats_age_s"] = age
        return result

    def get_kv_block_map(self) -> tuple[list[int], float | None]:
        """The core's latest published per-block states and their age (never waits for the core)."""
        return self.client.latest_block_map()

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block that no request is using; True when the cache was reset."""
        return bool(await self.client.call_utility("reset_prefix_cache"))

    async def kv_block_states(self) -> list[int]:
        """The core's per-block states (for debugging and tests)."""
        return list(await self.client.call_utility("kv_block_states"))

    async def load_lora_adapter(self, name: str, path: str) -> str:
        """Load the PEFT LoRA adapter at `path` (a folder on the core's machine) as `name`; returns its
        resolved path. LoraAdapterError (400) when the name is taken or the folder cannot be served
        (the message says why), e.g. a rank above max_lora_rank."""
        if name == self.model_name:
            raise LoraAdapterError(f"{name!r} is the base model's name", param="lora_name")
        if name in self.lora_adapters:
            raise LoraAdapterError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        result = await self.client.call_utility(
            "load_lora_adapter", name, path, timeout_s=LORA_LOAD_TIMEOUT_S
        )
        _raise_lora_error(result)
        self.lora_adapters[name] = str(result["path"])
        return self.lora_adapters[name]

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload the LoRA adapter `name` (ModelNotFound when it is not loaded). Requests already running
        on it finish with it; new ones naming it get a 404."""
        if name not in self.lora_adapters:
            raise ModelNotFound(f"the LoRA adapter {name!r} is not loaded", param="lora_name")
        result = await self.client.call_utility("unload_lora_adapter", name)
        self.lora_adapters.pop(name, None)
        _raise_lora_error(result)

    async def _resync_lora_adapters(self) -> None:
        """After a core restart: the new core has the start-up adapters; load what was loaded at runtime
        and unload what was unloaded (an adapter that fails to load again is dropped, and logged)."""
        ready = self.client.ready
        if ready is None:
            return
        loaded = dict(ready.lora_adapters)
        for name in [n for n in loaded if n not in self.lora_adapters]:
            await self.client.call_utility("unload_lora_adapter", name)
        for name, path in list(self.lora_adapters.items()):
            if name in loaded:
                continue
            result = await self.client.call_utility(
                "load_lora_adapter", name, path, timeout_s=LORA_LOAD_TIMEOUT_S
            )
            if "error" in result:
                logger.error("LoRA adapter %s could not be loaded again: %s", name, result["error"])
                del self.lora_adapters[name]

    async def shutdown(self, drain_timeout_s: float = 0, *, core_timeout_s: float = 5.0) -> None:
        """Stop admitting; let in-flight requests finish for up to `drain_timeout_s`; fail the rest
        with EngineDead; stop the core (given `core_timeout_s` to exit by itself; 0 kills it at
        once). Idempotent."""
        first = not self._draining
        self._draining = True
        restart = self._restart_task
        if restart is not None:
            restart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restart
            self._restart_task = None
        if first and drain_timeout_s > 0 and self._requests and not self.is_dead:
            logger.info("draining %d in-flight requests (up to %.1f s)", len(self._requests), drain_timeout_s)
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
            except TimeoutError:
                logger.warning("%d requests still in flight after the drain timeout", len(self._requests))
        self._fail_all(EngineDead("the server shut down before the request finished"))
        if self._client is not None:
            await self._client.shutdown(core_timeout_s)


LORA_LOAD_TIMEOUT_S = 300.0
"""How long loading an adapter in the core may take (reading its safetensors file)."""


def _raise_lora_error(result: dict[str, Any]) -> None:
    """The core's refusal of a LoRA load or unload ({"error", "status", "code", "param"}) as its IzhError."""
    if "error" not in result:
        return
    cls = ModelNotFound if result.get("status") == 404 else LoraAdapterError
    raise cls(str(result["error"]), param=result.get("param"), code=result.get("code"))


def _check_prompt_limit(prompt_token_ids: list[int], max_prompt_tokens: int | None) -> None:
    if max_prompt_tokens is not None and len(prompt_token_ids) > max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {len(prompt_token_ids)} tokens, over the limit of {max_prompt_tokens} "
            "(limits.max_prompt_tokens)",
            param="prompt",
            code="limit_exceeded",
        )


async def load_tokenizer_beside(model: str, client_task: asyncio.Future[EngineCoreClient]) -> Tokenizer:
    """Load the tokenizer while the core starts; if it fails, shut the core down before raising."""
    tokenizer_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, model))
    both: set[asyncio.Future[Any]] = {tokenizer_task, client_task}
    try:
        await asyncio.wait(both)
    except asyncio.CancelledError:
        client_task.cancel()
        raise
    error = tokenizer_task.exception()
    if error is None:
        return tokenizer_task.result()
    if client_task.exception() is None:
        await client_task.result().shutdown(timeout_s=1.0)
    raise error
