"""An izh server inside this process, on a free loopback port: `izh chat --local` talks to it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

START_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class LocalServer:
    """A running local server: its base URL and, when the settings ask for keys, one of them."""

    url: str
    api_key: str | None


@contextmanager
def local_server(model: str) -> Iterator[LocalServer]:
    """Serve `model` (a registry name, .gguf file or HF folder) from a background thread with its
    engine core in a child process, built as `izh serve` builds its server (the settings from IZH_*
    as usual: [engine], [server], [limits], [rate_limits]) but on a free loopback port; yields it,
    stops on exit."""
    from izh.hub import resolve_model
    from izh.settings import load_settings
    from izh_cli.server import build_server_app, default_engine_threads, start_llm

    settings = load_settings(overrides={"model.name": model})
    path = resolve_model(settings.model.name, settings.model.cache_dir, download=True)
    config = default_engine_threads(settings.to_engine_config(str(path)))
    keys = sorted(settings.server.api_key_values())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    state: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        import uvicorn

        llm = await start_llm(settings, config)
        try:
            app = build_server_app(llm, settings)
            server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
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
        yield LocalServer(f"http://127.0.0.1:{port}/v1", keys[0] if keys else None)
    finally:
        state["loop"].call_soon_threadsafe(setattr, state["server"], "should_exit", True)
        thread.join(60)
        sock.close()
