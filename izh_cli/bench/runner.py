"""The load generator: streams requests from one ``httpx.AsyncClient`` and records their timings.

Arrivals follow a Poisson process (gamma-distributed gaps when ``burstiness`` is not 1, as in
``vllm bench serve``) or come all at once; a semaphore caps the requests in flight. The per-chunk work is
kept small (split lines, one ``json.loads``, a clock read) so that 2 cores can drive 256 streams.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from izh_cli.bench.datasets import Sample
from izh_cli.bench.metrics import RequestRecord
from izh_cli.http import DONE, SseDecoder, error_message, exception_kind, http_error_kind

Endpoint = Literal["chat", "completions", "messages"]
INTERRUPTED = "interrupted"
NO_TOKENS = "no tokens received"


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One benchmark level: where to send what, how many and how fast."""

    url: str
    endpoint: Endpoint
    model: str
    concurrency: int
    num_requests: int | None = None
    duration_s: float | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0


@dataclass(slots=True)
class LiveCounters:
    """What the progress display reads while a run goes on (written only by the event loop)."""

    sent: int = 0
    done: int = 0
    errors: int = 0
    chunks: int = 0
    in_flight: int = 0
    retried: int = 0
    """Requests sent again after a kept-alive connection closed without an answer."""


@dataclass(slots=True)
class RunOutcome:
    """A run's records (requests that finished or failed; cancelled ones are dropped) and its duration."""

    config: RunConfig
    records: list[RequestRecord]
    duration_s: float
    interrupted: bool = False
    texts: dict[int, str] = field(default_factory=dict)
    """Generated text of the successful requests whose server sent no usage (to count tokens later)."""
    retried: int = 0
    """Sends repeated after a kept-alive connection closed without an answer (LiveCounters.retried)."""


def arrival_gaps(request_rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Seconds between consecutive arrivals: 0 for an infinite rate, else gamma(burstiness, 1/(rate*burstiness)).

    Burstiness 1 is a Poisson process (exponential gaps); below 1 burstier, above 1 more regular; the mean
    gap is always ``1 / request_rate``.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(request_rate):
        yield from itertools.repeat(0.0)
    theta = 1.0 / (request_rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, theta)


def build_payload(sample: Sample, config: RunConfig, max_tokens: int | None = None) -> dict[str, Any]:
    """The streaming request body, asking for usage in the stream."""
    output_len = max_tokens if max_tokens is not None else sample.output_len
    payload: dict[str, Any] = {
        "model": config.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": config.temperature,
    }
    if config.endpoint == "messages":
        # Anthropic's Messages API: its stream always ends with the usage (message_delta), and it has no
        # ignore_eos (a model that ends early streams fewer tokens; the per-token figures still hold).
        return {
            "model": config.model,
            "stream": True,
            "temperature": config.temperature,
            "messages": sample.chat_messages(),
            "max_tokens": output_len,
        }
    if config.endpoint == "chat":
        payload["messages"] = sample.chat_messages()
        payload["max_completion_tokens"] = output_len
        payload["max_tokens"] = output_len  # servers that predate max_completion_tokens
    else:
        payload["prompt"] = sample.prompt
        payload["max_tokens"] = output_len
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


class StreamRecorder:
    """Turns one stream's events into a RequestRecord; the timing definitions live here (see metrics)."""

    __slots__ = (
        "_chat",
        "_last_choice",
        "_last_text",
        "_messages",
        "_parts",
        "_start",
        "record",
        "usage_seen",
    )

    def __init__(self, record: RequestRecord, start: float, chat: bool, messages: bool = False) -> None:
        self.record = record
        self._start = start
        self._chat = chat
        self._messages = messages
        self._last_text: float | None = None
        self._last_choice: float | None = None
        self._parts: list[str] = []
        self.usage_seen = False

    def on_event(self, event: dict[str, Any], now: float) -> bool:
        """Record one decoded SSE event received at ``now``; True when it carried generated text."""
        if self._messages:
            return self._on_message_event(event, now)
        if event.get("error"):
            error = event["error"]
            message = error.get("message", "") if isinstance(error, dict) else str(error)
            self.record.error = f"stream error: {str(message)[:120]}"
            return False
        usage = event.get("usage")
        if usage:
            self.usage_seen = True
            self.record.output_tokens = usage.get("completion_tokens")
            if usage.get("prompt_tokens") is not None:
                self.record.prompt_tokens = usage["prompt_tokens"]
        choices = event.get("choices")
        if not choices:
            return False
        self._last_choice = now
        text = self._text(choices[0])
        return self._on_text(text, now) if text else False

    def _on_message_event(self, event: dict[str, Any], now: float) -> bool:
        """One event of Anthropic's Messages stream (message_start, content_block_delta, message_delta...)."""
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
            return self._on_text(text, now) if text else False
        if kind == "message_start":
            usage = (event.get("message") or {}).get("usage") or {}
            if usage.get("input_tokens") is not None:
                self.record.prompt_tokens = usage["input_tokens"] + (
                    usage.get("cache_read_input_tokens") or 0
                )
        elif kind == "message_delta":
            self._last_choice = now
            usage = event.get("usage") or {}
            if usage.get("output_tokens") is not None:
                self.usage_seen = True
                self.record.output_tokens = usage["output_tokens"]
        elif kind == "error":
            error = event.get("error") or {}
            self.record.error = f"stream error: {str(error.get('message', ''))[:120]}"
        return False

    def _on_text(self, text: str, now: float) -> bool:
        self._last_choice = now
        if self._last_text is None:
            self.record.ttft_s = now - self._start
        else:
            self.record.itl_s.append(now - self._last_text)
        self._last_text = now
        self.record.num_chunks += 1
        self._parts.append(text)
        return True

    def _text(self, choice: dict[str, Any]) -> str:
        if not self._chat:
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        if not text and delta.get("tool_calls"):
            text = (
                "".join((call.get("function") or {}).get("arguments") or "" for call in delta["tool_calls"])
                or " "
            )
        return text

    def finish(self) -> str:
        """Close the record; returns the generated text."""
        if self.record.error is None:
            if self.record.ttft_s is None or self._last_choice is None:
                self.record.error = NO_TOKENS
            else:
                self.record.latency_s = self._last_choice - self._start
        return "".join(self._parts)


STREAMS_PER_CLIENT = 16


def make_clients(
    concurrency: int, *, headers: dict[str, str], timeout: httpx.Timeout, per_client: int = STREAMS_PER_CLIENT
) -> list[httpx.AsyncClient]:
    """Enough clients for ``concurrency`` streams, ``per_client`` each.

    One client per 16 streams rather than one for all: httpcore's pool re-scans every connection (and
    polls idle sockets) each time a request starts or ends, which grows with the square of the pool size
    and, at 256 streams, costs more CPU than the streams themselves.
    """
    count = max(1, math.ceil(concurrency / per_client))
    # Idle connections go before a server's usual 5 s keep-alive ends (uvicorn's and vLLM's default), so
    # a request is never sent on a connection the server is closing at that moment.
    limits = httpx.Limits(
        max_connections=per_client + 4, max_keepalive_connections=per_client + 4, keepalive_expiry=4.0
    )
    return [httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) for _ in range(count)]


class Runner:
    """Runs one level; ``stop`` (set on Ctrl-C) cancels what is in flight.

    Each request in flight holds a slot (0..concurrency-1) and uses client ``slot % len(clients)``, so
    no client ever has more than its share of streams (none waits for a connection in its pool).
    """

    def __init__(
        self, clients: httpx.AsyncClient | list[httpx.AsyncClient], config: RunConfig, samples: list[Sample]
    ) -> None:
        if not samples:
            raise ValueError("no samples to send")
        self.clients = clients if isinstance(clients, list) else [clients]
        self.config = config
        self.samples = samples
        self.counters = LiveCounters()
        self.started_at = 0.0
        self._records: list[RequestRecord] = []
        self._texts: dict[int, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._fresh: dict[int, httpx.AsyncClient] = {}

    def _fresh_client(self, client: httpx.AsyncClient) -> httpx.AsyncClient:
        """A client like ``client`` that keeps no connection alive: every send goes on a new connection."""
        fresh = self._fresh.get(id(client))
        if fresh is None:
            limits = httpx.Limits(max_keepalive_connections=0)
            fresh = httpx.AsyncClient(headers=client.headers, timeout=client.timeout, limits=limits)
            self._fresh[id(client)] = fresh
        return fresh

    async def run(self, stop: asyncio.Event | None = None) -> RunOutcome:
        try:
            return await self._run(stop or asyncio.Event())
        finally:
            fresh, self._fresh = list(self._fresh.values()), {}
            await asyncio.gather(*(client.aclose() for client in fresh), return_exceptions=True)

    async def _run(self, stop: asyncio.Event) -> RunOutcome:
        self.started_at = time.perf_counter()
        dispatcher = asyncio.create_task(self._dispatch())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({dispatcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        interrupted = not dispatcher.done()
        if interrupted:
            dispatcher.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(dispatcher, *self._tasks, return_exceptions=True)
        else:
            dispatcher.result()  # re-raise a bug in the dispatcher rather than hide it
        duration = time.perf_counter() - self.started_at
        records = [r for r in self._records if r.error != INTERRUPTED]
        return RunOutcome(self.config, records, duration, interrupted, self._texts, self.counters.retried)

    async def _dispatch(self) -> None:
        config = self.config
        semaphore = asyncio.Semaphore(config.concurrency)
        free_slots = list(range(config.concurrency - 1, -1, -1))
        gaps = arrival_gaps(config.request_rate, config.burstiness, random.Random(config.seed))
        next_arrival = self.started_at
        for index in itertools.count():
            if config.num_requests is not None and index >= config.num_requests:
                break
            next_arrival += next(gaps)
            delay = next_arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._past_deadline():
                break
            await semaphore.acquire()
            if self._past_deadline():
                semaphore.release()
                break
            slot = free_slots.pop()
            task = asyncio.create_task(self._one(index, self.clients[slot % len(self.clients)]))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._release, semaphore, free_slots, slot))
        if self._tasks:
            await asyncio.gather(*self._tasks)

    def _release(
        self, semaphore: asyncio.Semaphore, free_slots: list[int], slot: int, task: asyncio.Task[None]
    ) -> None:
        self._tasks.discard(task)
        free_slots.append(slot)
        semaphore.release()

    def _past_deadline(self) -> bool:
        duration = self.config.duration_s
        return duration is not None and time.perf_counter() - self.started_at >= duration

    async def _one(self, index: int, client: httpx.AsyncClient) -> None:
        sample = self.samples[index % len(self.samples)]
        record = RequestRecord(index=index, prompt_tokens=sample.prompt_len)
        self._records.append(record)
        payload = build_payload(sample, self.config)
        counters = self.counters
        counters.sent += 1
        counters.in_flight += 1
        start = time.perf_counter()
        record.start_s = start - self.started_at
        try:
            try:
                text, usage_seen = await self._stream(client, record, payload, start)
            except httpx.RemoteProtocolError:
                # A kept-alive connection that the server closed without answering: llama-server
                # closes one after each stream without saying so, and the next request sent on it
                # fails before any byte comes back. Nothing reached the server's model, so the
                # request goes again, once, on a new connection (which no server has had time to
                # close); another pooled one could be just as stale.
                if record.num_chunks or record.ttft_s is not None:
                    raise
                counters.retried += 1
                text, usage_seen = await self._stream(self._fresh_client(client), record, payload, start)
            if record.ok and not usage_seen:
                self._texts[index] = text
        except asyncio.CancelledError:
            record.error = INTERRUPTED
            raise
        except Exception as exc:
            # A transport failure or a malformed stream fails this request, never the run.
            record.error = exception_kind(exc)
        finally:
            counters.in_flight -= 1
            if record.error != INTERRUPTED:
                counters.done += 1
                counters.errors += 0 if record.ok else 1

    async def _stream(
        self, client: httpx.AsyncClient, record: RequestRecord, payload: dict[str, Any], start: float
    ) -> tuple[str, bool]:
        endpoint = self.config.endpoint
        recorder = StreamRecorder(record, start, endpoint == "chat", messages=endpoint == "messages")
        counters = self.counters
        async with client.stream("POST", self.config.url, json=payload) as response:
            if response.status_code != 200:
                body = await response.aread()
                record.error = http_error_kind(
                    response.status_code, error_message(body, response.reason_phrase)
                )
                return "", False
            decoder = SseDecoder()
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                for data in decoder.feed(chunk):
                    if data == DONE:
                        continue
                    if self._on_data(recorder, data, now):
                        counters.chunks += 1
                if record.error is not None:
                    break
            for data in decoder.flush():
                if data != DONE:
                    self._on_data(recorder, data, time.perf_counter())
        return recorder.finish(), recorder.usage_seen

    @staticmethod
    def _on_data(recorder: StreamRecorder, data: bytes, now: float) -> bool:
        try:
            event = json.loads(data)
        except ValueError:
            recorder.record.error = "bad SSE event (not JSON)"
            return False
        return isinstance(event, dict) and recorder.on_event(event, now)
