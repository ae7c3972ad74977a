"""The server stack every izh server runs, shared by `izh serve` (izh_cli/serve.py), the API processes of
its supervisor (izh_cli/serve_multi.py) and `izh chat --local` (izh_cli/local_server.py): the engine
started from the settings, the app built over it, uvicorn configured and wrapped with izh's signal
handling (drain, then stop), and the logging set-up. Neither command module imports the other's
internals: both import this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from izh.config import EngineConfig
    from izh.frontend.async_llm import AsyncLLM
    from izh.settings import IzhSettings

logger = logging.getLogger("izh.serve")

EXIT_ENGINE_DEAD = 1


def default_engine_threads(config: EngineConfig) -> EngineConfig:
    """Unless set, the core's torch threads are all cores but one on machines with more than 2 cores:
    the API process streams on the spare one. On 2 cores the engine needs both: SmolLM2 served 71 vs
    50 tok/s for one stream and 493 vs 332 at 32 (`izh bench`, 128 + 128 tokens); the API's own cost
    (~50 us per streamed token) only dominates for a tiny model, where `--num-threads 1` doubles it.
    The core is not reniced: a niced engine yields to every process on a shared machine, not only to
    its API process (docs/operations.md, "Sharing a small machine's cores")."""
    if config.num_threads is not None:
        return config
    import dataclasses
    import os

    cpus = os.cpu_count() or 1
    return dataclasses.replace(config, num_threads=cpus - 1 if cpus > 2 else cpus)


async def start_llm(settings: IzhSettings, engine_config: EngineConfig) -> AsyncLLM:
    """The engine as every izh server starts it (`izh serve`, `izh chat --local`): the [engine]
    section's core mode and the [server] section's admission, timeout and restart settings."""
    from izh.frontend.async_llm import AsyncLLM

    s = settings.server
    return await AsyncLLM.start(
        engine_config,
        core_mode=settings.engine.core_mode,
        max_requests_in_flight=s.max_requests_in_flight,
        max_waiting_requests=s.max_waiting_requests,
        request_timeout_s=s.request_timeout_s,
        heartbeat_timeout_s=s.engine_heartbeat_timeout_s,
        step_timeout_s=s.engine_step_timeout_s or None,
        max_buffered_outputs=s.max_buffered_outputs,
        restart_dead_core=s.restart_dead_core,
    )


def build_server_app(llm: AsyncLLM, settings: IzhSettings, api_index: int | None = None) -> FastAPI:
    """The API app over a started `llm` as every izh server builds it: the [server], [limits] and
    [rate_limits] sections; `api_index` for API process `api_index` of several (izh_cli/serve_multi.py)."""
    from izh.api.app import build_app

    return build_app(
        llm, settings.server, limits=settings.limits, rate_limits=settings.rate_limits, api_index=api_index
    )


def uvicorn_config(app: FastAPI, settings: IzhSettings) -> uvicorn.Config:
    import uvicorn

    s = settings.server
    return uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        http=header_timeout_protocol(s.header_timeout_s),
        log_config=None,  # our logging set-up stays in charge
        access_log=settings.logging.level == "debug",
        timeout_graceful_shutdown=int(s.drain_timeout_s) + 5,
        timeout_keep_alive=s.timeout_keep_alive_s,
        limit_concurrency=s.max_connections,
        lifespan="on",
    )


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing a connection that has not sent a complete request head
    within `timeout_s` of connecting or of its previous response.

    uvicorn itself only times out keep-alive connections after a response, and restarts that timer
    on every byte received: a client trickling header bytes (slowloris), or connecting and saying
    nothing, would hold a connection forever.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout_s, self._on_header_timeout)

        def _on_header_timeout(self) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being served: body and response have their own bounds
            if not self.transport.is_closing():
                logger.debug("closing a connection that sent no complete request within %.0f s", timeout_s)
                self.transport.close()

    return HeaderTimeoutProtocol


def make_server(config: uvicorn.Config, app: FastAPI, llm: AsyncLLM, drain_timeout_s: float) -> Any:
    import uvicorn  # here, not at module level: `izh --help` must not import the server stack

    class Server(uvicorn.Server):
        """uvicorn.Server with izh's signal handling: drain first, then stop; exit 0, not re-raise."""

        def __init__(self, config: uvicorn.Config, app: Any, llm: AsyncLLM, drain_timeout_s: float) -> None:
            super().__init__(config)
            self.app = app
            self.llm = llm
            self.drain_timeout_s = drain_timeout_s
            self.stopping = False
            self._tasks: set[asyncio.Task[None]] = set()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
            self._spawn(self._watch_engine())
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                for task in self._tasks:
                    task.cancel()

        def _spawn(self, coro: Any) -> None:
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        def _on_signal(self, sig: int) -> None:
            if self.stopping:
                logger.warning("second %s: exiting now", signal.Signals(sig).name)
                self.should_exit = self.force_exit = True
                return
            self.stopping = True
            logger.info(
                "%s: draining (no new requests; up to %.0f s for in-flight ones)",
                signal.Signals(sig).name,
                self.drain_timeout_s,
            )
            self.app.state.draining = True
            self._spawn(self._drain())

        async def _drain(self) -> None:
            try:
                await self.llm.shutdown(self.drain_timeout_s)
            finally:
                self.should_exit = True

        async def _watch_engine(self) -> None:
            # The client's watchdog notices a dead or hung core; we only turn that into an exit.
            while not self.llm.is_dead:
                await asyncio.sleep(0.25)
            if self.stopping:
                return
            logger.error("engine core died (%s); shutting down", self.llm.dead_reason)
            await asyncio.sleep(0.5)  # let failing streams send their error event and [DONE]
            self.should_exit = True

    return Server(config, app, llm, drain_timeout_s)


def configure_logging(level: str, json_format: bool) -> None:
    """Root logging on stderr: plain lines, or one JSON object per line."""
    import json
    import sys
    import time

    class JsonFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            entry: dict[str, Any] = {
                "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": record.getMessage(),
            }
            # Structured fields (izh.api.ops.request_log passes them as `extra={"fields": {...}}`).
            fields = getattr(record, "fields", None)
            if isinstance(fields, dict):
                entry.update((key, value) for key, value in fields.items() if key not in entry)
            if record.exc_info:
                entry["exc"] = self.formatException(record.exc_info)
            return json.dumps(entry, ensure_ascii=False)

    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
