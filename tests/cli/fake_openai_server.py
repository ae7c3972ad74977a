"""A small, real OpenAI-compatible server for testing the toolkit (bench, inspect, chat) in isolation.

A FastAPI app served by uvicorn on a free loopback port in a thread. It streams completions and chat
completions token by token (whitespace "tokens"), reports usage, tokenizes, exposes /metrics with vLLM's
names under the ``izh:`` or ``vllm:`` prefix, and izh's stats endpoint. Errors on demand, by a marker
in the prompt: ``FAIL_429`` and ``FAIL_500`` answer with that status, ``FAIL_STREAM`` fails mid-stream
(an SSE error event, then ``[DONE]``, as vLLM does); ``BLOCK`` sends one token and then waits until the
client disconnects, setting ``state.blocked`` (a test's signal that a request is in flight). A path in
``FakeConfig.hang`` (/health, /metrics, /v1/izh/stats) never answers: it waits until its client leaves;
with ``FakeConfig.rendezvous`` those three answer only once all three were asked (a client asking them
one after another times out on the first).

Chat replies are deterministic and show the conversation they saw: ``[system] You said: <last user
message> (turn N)`` where N counts the user messages, so a transcript proves what history was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0)
FAIL_MARKERS = {"FAIL_429": 429, "FAIL_500": 500}
BLOCK_MARKER = "BLOCK"


@dataclass
class FakeConfig:
    model: str = "fake-model"
    metrics_prefix: Literal["izh:", "vllm:"] = "izh:"
    usage: bool = True
    """Send the usage chunk when the client asks for it (include_usage)."""
    tokenize: bool | Literal["llama.cpp"] = True
    """False: no /tokenize (404); "llama.cpp": llama-server's request shape (`content` in, `tokens` out)."""
    natural_len: int = 8
    """Tokens a completion generates before its "EOS" when ignore_eos is not set."""
    token_delay_s: float = 0.0
    ttft_s: float = 0.02
    """The TTFT observed into the /metrics histogram for each request (deterministic on purpose)."""
    itl_s: float = 0.03
    num_blocks: int = 32
    stats_shape: Literal["flat", "nested", "none"] = "nested"
    metrics: bool = True
    """Without metrics, /metrics answers 501 as llama.cpp does when started without --metrics."""
    hang: tuple[str, ...] = ()
    """Service paths that never answer (each call waits until its client gives up)."""
    rendezvous: bool = False
    """/health, /metrics and /v1/izh/stats each wait until all three were asked (then a new round)."""


@dataclass
class FakeState:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    blocked: threading.Event = field(default_factory=threading.Event)
    """Set when a request with the BLOCK marker is streaming (it then never ends until the client leaves)."""
    hung: list[str] = field(default_factory=list)
    """The path of every call to a ``FakeConfig.hang`` path, as it began to hang."""


class FakeMetrics:
    """vLLM's metric names under the configured prefix, in a registry of their own."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{prefix}time_to_first_token_seconds", "TTFT", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(f"{prefix}inter_token_latency_seconds", "ITL", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{prefix}e2e_request_latency_seconds", "E2E", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{prefix}prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(f"{prefix}generation_tokens", "generated tokens", registry=r)
        self.success = Counter(f"{prefix}request_success", "finished", ["finished_reason"], registry=r)
        self.prefix_queries = Counter(f"{prefix}prefix_cache_queries", "queried tokens", registry=r)
        self.prefix_hits = Counter(f"{prefix}prefix_cache_hits", "hit tokens", registry=r)
        self.preemptions = Counter(f"{prefix}num_preemptions", "preemptions", registry=r)
        self.running = Gauge(f"{prefix}num_requests_running", "running", registry=r)
        self.waiting = Gauge(f"{prefix}num_requests_waiting", "waiting", registry=r)
        self.kv_usage = Gauge(f"{prefix}kv_cache_usage_perc", "kv usage", registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(reason)
        self.kv_usage.set(0.25)  # as the fake stats' block map: a quarter of the blocks in use

    def observe(self, config: FakeConfig, prompt_tokens: int, output_tokens: int, reason: str) -> None:
        self.ttft.observe(config.ttft_s)
        for _ in range(max(output_tokens - 1, 0)):
            self.itl.observe(config.itl_s)
        self.e2e.observe(config.ttft_s + config.itl_s * max(output_tokens - 1, 0))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(prompt_tokens // 2)
        self.success.labels(reason).inc()


def _error(status: int, message: str) -> JSONResponse:
    kind = (
        "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status
    )


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def chat_reply(messages: list[dict[str, Any]]) -> str:
    system = next((str(m.get("content")) for m in messages if m.get("role") == "system"), None)
    users = [str(m.get("content")) for m in messages if m.get("role") == "user"]
    prefix = f"[{system}] " if system else ""
    return f"{prefix}You said: {users[-1] if users else ''} (turn {len(users)})"


class FakeServer:
    """The app and what it saw; ``app`` is a FastAPI instance."""

    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.state = FakeState()
        self.metrics = FakeMetrics(self.config.metrics_prefix)
        self._round: set[str] = set()
        self._round_done = asyncio.Event()
        self.app = self._build()

    # --- generation ---------------------------------------------------------------------------------

    def _tokens(self, body: dict[str, Any], chat: bool) -> tuple[list[str], str]:
        """The output "tokens" and the finish reason."""
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if chat:
            words = chat_reply(body.get("messages") or []).split(" ")
            natural = [w if i == 0 else f" {w}" for i, w in enumerate(words)]
        else:
            natural = [f" tok{i}" for i in range(self.config.natural_len)]
        if body.get("ignore_eos"):
            tokens = [natural[i % len(natural)] for i in range(max_tokens)]
            return tokens, "length"
        return natural[:max_tokens], "length" if len(natural) > max_tokens else "stop"

    @staticmethod
    def _prompt_text(body: dict[str, Any]) -> str:
        if "messages" in body:
            return " ".join(str(m.get("content", "")) for m in body["messages"])
        return str(body.get("prompt", ""))

    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        self.state.bodies.append(body)
        prompt = self._prompt_text(body)
        for marker, status in FAIL_MARKERS.items():
            if marker in prompt:
                self.metrics.success.labels("error").inc()
                return _error(status, f"fake failure {status} on demand")
        if body.get("model") != self.config.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        tokens, reason = self._tokens(body, chat)
        prompt_tokens = len(prompt.split())
        reasoning = ["Let", " me", " think."] if chat and "think" in prompt else []
        if not body.get("stream"):
            self.metrics.observe(self.config, prompt_tokens, len(tokens), reason)
            return JSONResponse(self._full(body, chat, "".join(tokens), reason, prompt_tokens, len(tokens)))
        stream = self._stream(body, chat, tokens, reasoning, reason, prompt_tokens, "FAIL_STREAM" in prompt)
        return StreamingResponse(stream, media_type="text/event-stream")

    def _full(
        self, body: dict[str, Any], chat: bool, text: str, reason: str, prompt_tokens: int, n: int
    ) -> dict[str, Any]:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            return {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [choice],
                "usage": usage,
            }
        choice2 = {"index": 0, "text": text, "finish_reason": reason}
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": body["model"],
            "choices": [choice2],
            "usage": usage,
        }

    async def _stream(
        self,
        body: dict[str, Any],
        chat: bool,
        tokens: list[str],
        reasoning: list[str],
        reason: str,
        prompt_tokens: int,
        fail: bool,
    ) -> AsyncIterator[bytes]:
        base = {
            "id": "chatcmpl-fake" if chat else "cmpl-fake",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(self.state.started),
            "model": body["model"],
        }

        def chunk(delta: dict[str, Any] | str, finish: str | None = None) -> bytes:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta
            return _sse({**base, "choices": [choice]})

        self.metrics.running.inc()
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            for piece in reasoning:
                await asyncio.sleep(self.config.token_delay_s)
                yield chunk({"reasoning_content": piece})
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.config.token_delay_s)
                if i == 1 and BLOCK_MARKER in self._prompt_text(body):
                    self.state.blocked.set()
                    await asyncio.Event().wait()  # until the client goes away and the stream is cancelled
                if fail and i == 2:
                    yield _sse(
                        {"error": {"message": "fake failure mid-stream", "type": "server_error", "code": 500}}
                    )
                    yield _sse("[DONE]")
                    self.metrics.success.labels("error").inc()
                    return
                yield chunk({"content": token} if chat else token)
            yield chunk({} if chat else "", reason)
            if self.config.usage and (body.get("stream_options") or {}).get("include_usage"):
                n = len(tokens) + len(reasoning)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                }
                yield _sse({**base, "choices": [], "usage": usage})
            yield _sse("[DONE]")
            self.metrics.observe(self.config, prompt_tokens, len(tokens) + len(reasoning), reason)
        finally:
            self.metrics.running.dec()

    # --- the app ------------------------------------------------------------------------------------

    def _stats(self) -> dict[str, Any]:
        n = self.config.num_blocks
        used, cached = n // 4, n // 4
        states = [2] * used + [1] * cached + [0] * (n - used - cached)
        scheduler = {
            "num_running": 3,
            "num_waiting": 2,
            "num_preemptions": 1,
            "kv_cache_usage": used / n,
            "num_blocks": n,
            "prefix_cache_queries": 100,
            "prefix_cache_hits": 40,
        }
        if self.config.stats_shape == "flat":
            return {**scheduler, "kv_block_states": states}
        # izh's shape (izh.api.ops.routes.izh_stats)
        return {
            "model": self.config.model,
            "max_model_len": 4096,
            "num_requests_in_flight": 1,
            "draining": False,
            "scheduler": scheduler,
            "kv_block_states": states,
        }

    async def _hang_if_asked(self, request: Request) -> None:
        """For a path in ``config.hang``, return only once the client disconnected; with
        ``config.rendezvous``, once the other service paths were asked too (or the client left)."""
        path = request.url.path
        if path in self.config.hang:
            self.state.hung.append(path)
            done = asyncio.Event()  # never set
        elif self.config.rendezvous:
            done = self._round_done
            self._round.add(path)
            if self._round == {"/health", "/metrics", "/v1/izh/stats"}:
                self._round, self._round_done = set(), asyncio.Event()
                done.set()
        else:
            return
        while not done.is_set() and not await request.is_disconnected():
            await asyncio.sleep(0.01)

    def _build(self) -> FastAPI:
        app = FastAPI()
        config = self.config

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {"id": config.model, "object": "model", "owned_by": "fake", "max_model_len": 4096}
            return {"object": "list", "data": [card]}

        @app.get("/version")
        async def version() -> dict[str, Any]:
            return {"version": "fake-1.0"}

        @app.get("/health")
        async def health(request: Request) -> Response:
            await self._hang_if_asked(request)
            return Response(status_code=200)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            if not config.tokenize:
                return _error(404, "Not Found")
            body = await request.json()
            if (
                config.tokenize == "llama.cpp"
            ):  # reads `content`; any other field is ignored, as llama-server does
                return JSONResponse({"tokens": list(range(len(str(body.get("content", "")).split())))})
            count = len(self._prompt_text(body).split())
            return JSONResponse({"count": count, "tokens": list(range(count)), "max_model_len": 4096})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate(request, chat=True)

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            await self._hang_if_asked(request)
            if not config.metrics:
                return _error(501, "This server does not support metrics endpoint.")
            return PlainTextResponse(generate_latest(self.metrics.registry).decode())

        if config.stats_shape != "none":

            @app.get("/v1/izh/stats")
            async def stats(request: Request) -> dict[str, Any]:
                await self._hang_if_asked(request)
                return self._stats()

        return app


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a thread; yields its base URL (no /v1).

    The socket listens before the thread starts, so clients can connect at once (the kernel queues
    them until uvicorn accepts): no waiting for start-up.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def fake_server(config: FakeConfig | None = None) -> Iterator[tuple[str, FakeServer]]:
    """A FakeServer running on loopback: (base URL, the server object for its state)."""
    fake = FakeServer(config)
    with serve(fake.app) as url:
        yield url, fake
