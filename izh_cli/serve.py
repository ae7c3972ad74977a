"""`izh serve`: the OpenAI-compatible server (engine core in its own process) under uvicorn.

Lifecycle: SIGTERM/SIGINT → stop admitting (503, /ready red), let in-flight requests finish for up to
server.drain_timeout_s, fail the rest, stop the core, exit 0; a second signal exits at once. If the
engine core dies (or hangs past server.engine_heartbeat_timeout_s), in-flight requests get an error,
/health answers 503 and the process exits 1 so that a supervisor (systemd) restarts it; with
server.restart_dead_core the server starts a new core itself instead. The core process never
outlives the server (it watches its parent, and every exit path stops it). See docs/operations.md.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

import typer

from izh_cli._common import ConfigOption, cli_errors, load_cli_settings, stderr_console, transfer_progress
from izh_cli._common import with_settings_flags as _with_settings_flags
from izh_cli.serve_multi import needs_supervisor, serve_supervised
from izh_cli.server import (
    EXIT_ENGINE_DEAD,
    build_server_app,
    configure_logging,
    default_engine_threads,
    make_server,
    start_llm,
    uvicorn_config,
)
from izh_cli.tp_node import run_worker_node, with_rendezvous_env

if TYPE_CHECKING:
    from izh.config import EngineConfig
    from izh.settings import IzhSettings


@_with_settings_flags
def serve(
    model: Annotated[
        str | None,
        typer.Argument(
            help="Model: a registry name (smollm2), a .gguf file or a Hugging Face folder. "
            "Default: model.name from the settings (smollm2).",
            show_default=False,
        ),
    ] = None,
    config: ConfigOption = None,
    *,
    settings_overrides: dict[str, Any],
) -> None:
    """Serve a model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models, ...)."""
    settings = load_cli_settings(config, settings_overrides, model=model)
    configure_logging(settings.logging.level, settings.logging.json_format)
    from izh.hub import resolve_model

    with cli_errors():
        with transfer_progress() as progress:
            path = resolve_model(
                settings.model.name, settings.model.cache_dir, download=True, progress=progress
            )
        engine_config = with_rendezvous_env(settings.to_engine_config(str(path)))
        if not engine_config.serves:  # a tensor-parallel worker host (docs/operations.md)
            raise typer.Exit(run_worker_node(default_engine_threads(engine_config)))
        if needs_supervisor(settings):  # --api-server-count / --data-parallel-size > 1
            code = serve_supervised(settings, engine_config)
        else:
            code = asyncio.run(_serve(settings, default_engine_threads(engine_config)))
    raise typer.Exit(code)


async def _serve(settings: IzhSettings, engine_config: EngineConfig) -> int:
    server_settings = settings.server
    console = stderr_console()
    with console.status(f"[bold]loading {engine_config.model}[/] (engine core starting)..."):
        llm = await start_llm(settings, engine_config)
    server: Any = None
    try:
        app = build_server_app(llm, settings)
        server = make_server(uvicorn_config(app, settings), app, llm, server_settings.drain_timeout_s)
        ready = llm.ready
        console.print(
            f"[bold green]izh[/] serving [bold]{llm.model_name}[/] on "
            f"http://{server_settings.host}:{server_settings.port}/v1 "
            f"({ready.device}, {ready.dtype}, max_model_len {ready.max_model_len}, "
            f"{ready.num_blocks} KV blocks of {ready.block_size}, KV cache {ready.kv_cache_dtype}: "
            f"{ready.kv_tokens_per_gib} tokens per GiB)",
            highlight=False,
        )
        await server.serve()
    finally:
        # A second signal means now: the core gets no grace either.
        forced = server is not None and server.force_exit
        await llm.shutdown(0, core_timeout_s=0 if forced else 5.0)
    if llm.is_dead and not server.stopping:
        console.print(f"[bold red]Error:[/] the engine core died: {llm.dead_reason}", highlight=False)
        return EXIT_ENGINE_DEAD
    return 0
