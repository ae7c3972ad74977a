"""An izh server inside this process, on a free loopback port: `izh chat --local` talks to it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

START_TIMEOUT_S = 600.0


@contextmanager
def local_server(model: str) -> Iterator[str]:
    """Serve `model` (a registry name, .gguf file or HF folder; settings from IZH_* as usual) from a
    background thread with its engine core in a child process; yields the base URL, stops on exit."""
    from izh.hub import resolve_model
    from izh.settings import load_settings

    settings = load_settings(overrides={"model.name": model})
    path = resolve_model(settings.model.name, settings.model.cache_dir, download=True)
    config = settings.to_engine_config(str(path))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    state: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        import uvicorn

        from izh.api.app import build_app
        from izh.frontend.async_llm import AsyncLLM

        llm = await AsyncLLM.start(config)
        try:
            server = uvicorn.Server(uvicorn.Config(build_app(llm), log_config=None, access_log=False))
            state["server"], state["loop"] = server, asyncio.get_running_loop()
            started.set()
            await server.serve(sockets=[sock])
        finally:
            await llm.shutdown(0)

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the caller through `state`
            state["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=run, name="izh-local-server", daemon=True)
    thread.start()
    started.wait(START_TIMEOUT_S)
    if "error" in state or "server" not in state:
        thread.join(5)
        raise state.get("error") or TimeoutError("the local izh server did not start")
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        state["loop"].call_soon_threadsafe(setattr, state["server"], "should_exit", True)
        thread.join(60)
        sock.close()
