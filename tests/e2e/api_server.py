"""A real izh API server for the e2e tests: uvicorn on a free loopback port, in a thread, over a
real AsyncLLM (its engine core in a thread by default, to spare the small test machines a process)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from izh.api.app import build_app
from izh.config import EngineConfig
from izh.frontend.async_llm import AsyncLLM
from izh.settings import LimitSettings, RateLimitSettings, ServerSettings

START_TIMEOUT_S = 240.0


class ApiServer:
    """One server: `url` once started; `call` runs a function on the server's event loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        start_kwargs: dict[str, Any],
        server: ServerSettings,
        limits: LimitSettings | None = None,
        rate_limits: RateLimitSettings | None = None,
    ) -> None:
        self.config = config
        self.start_kwargs = start_kwargs
        self.server_settings = server
        self.limits = limits
        self.rate_limits = rate_limits
        self.url = ""
        self.app: FastAPI | None = None
        self.llm: AsyncLLM | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="izh-e2e-server", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError("the API server did not start")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        if self._server is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(setattr, self._server, "should_exit", True)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the API server did not stop"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's loop (the AsyncLLM and the app belong to it) and return its result."""
        assert self._loop is not None

        async def wrapper() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(60)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.llm = await AsyncLLM.start(self.config, **self.start_kwargs)
        try:
            self.app = build_app(
                self.llm, self.server_settings, limits=self.limits, rate_limits=self.rate_limits
            )
            # Bound and listening before uvicorn runs: clients may connect as soon as `url` is known.
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
            self._server = uvicorn.Server(config)
            serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            self._started.set()
            await serving
        finally:
            await self.llm.shutdown()


@contextmanager
def api_server(
    config: EngineConfig,
    *,
    start_kwargs: dict[str, Any] | None = None,
    limits: LimitSettings | None = None,
    rate_limits: RateLimitSettings | None = None,
    **server_settings: Any,
) -> Iterator[ApiServer]:
    """A started server over `config`: AsyncLLM.start(**start_kwargs), then build_app with
    ServerSettings(**server_settings) and the `[limits]` / `[rate_limits]` sections given."""
    kwargs = {"core_mode": "thread", **(start_kwargs or {})}
    server = ApiServer(
        config,
        start_kwargs=kwargs,
        server=ServerSettings(**server_settings),
        limits=limits,
        rate_limits=rate_limits,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
