"""`izh serve --api-server-count N --data-parallel-size M`: a supervisor over M engine cores and N API
processes that share one listening socket.

The `izh serve` process becomes a supervisor that serves no HTTP itself. It binds the port once, starts
the M cores (each told the output address of every API process) and then the N API processes (spawned,
each in its own process group so that a terminal's Ctrl-C reaches the supervisor only), hands each the
listening socket, the cores' input addresses and pids and its index, and waits. Each API process runs
the usual app (izh_cli/server.py's uvicorn server, drain included) over an AsyncLLM attached to the cores
(izh.frontend.dp_client): the kernel hands each new connection to whichever process accepts first.

Lifecycle (docs/operations.md, "Scale out"):
- SIGTERM/SIGINT: every API process gets SIGTERM and drains (no new requests, in-flight ones finish
  for up to server.drain_timeout_s); once all have exited, the cores get SIGTERM; exit 0. A second
  signal forwards a second SIGTERM (the API processes exit at once) and kills the cores.
- An API process that exits unexpectedly (killed, crashed): logged with its exit status; the others
  are drained and stopped as on SIGTERM and the supervisor exits 1, for systemd / Kubernetes to
  restart the whole server (no API process is restarted alone: its streams are gone anyway, and a
  clean start is simpler to reason about).
- A data-parallel core that dies: logged; its requests fail with 503 errors in every API process and
  the others keep serving (/ready: 200, status "degraded"). When every core is dead the API processes
  exit and so does the supervisor, with 1.
- The supervisor killed with SIGKILL: the cores and the API processes notice their parent is gone and
  exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from izh.errors import describe_exit
from izh_cli._common import EXIT_USAGE, fail, hint_for, stderr_console

if TYPE_CHECKING:
    from izh.config import EngineConfig
    from izh.frontend.client import AttachedCore
    from izh.settings import IzhSettings

logger = logging.getLogger("izh.serve")

EXIT_FAILURE = 1
_CORE_STOP_WAIT_S = 10.0
_LISTEN_BACKLOG = 2048


def needs_supervisor(settings: IzhSettings) -> bool:
    return settings.server.api_server_count > 1 or settings.engine.data_parallel_size > 1


def check_settings(settings: IzhSettings) -> None:
    """Refuse the settings a supervised server cannot honour (rather than ignore them)."""
    if settings.engine.core_mode != "process":
        fail(
            "engine.core_mode thread cannot be combined with --api-server-count > 1 or "
            "--data-parallel-size > 1 (the cores are processes the supervisor starts)",
            code=EXIT_USAGE,
        )
    if settings.server.restart_dead_core:
        fail(
            "server.restart_dead_core cannot be combined with --api-server-count > 1 or "
            "--data-parallel-size > 1: a dead core is reported (data parallel: the others serve on, /ready "
            "says degraded), and when none is left the server exits 1 for its supervisor to restart it",
            code=EXIT_USAGE,
        )
    if settings.server.allow_runtime_lora_updating:
        fail(
            "server.allow_runtime_lora_updating cannot be combined with --api-server-count > 1 or "
            "--data-parallel-size > 1: an adapter loaded at runtime would reach one API process and one "
            "core only. Name the adapters at start with --lora-modules instead",
            code=EXIT_USAGE,
        )
    engine = settings.engine
    if engine.data_parallel_size > 1 and (engine.nnodes > 1 or engine.dist_init_addr is not None):
        fail(
            "--data-parallel-size > 1 cannot be combined with a multi-host tensor-parallel start "
            "(--nnodes / --dist-init-addr): every core would join the same rendezvous. Run one "
            "`izh serve` per data-parallel replica instead, or tensor parallel on one host",
            code=EXIT_USAGE,
        )


def core_threads(config: EngineConfig, data_parallel_size: int) -> EngineConfig:
    """Unless set, the machine's cores split between the data-parallel cores (all but one on machines
    with more than 2, as for one core: see serve.default_engine_threads)."""
    if config.num_threads is not None:
        return config
    cpus = os.cpu_count() or 1
    usable = cpus - 1 if cpus > 2 else cpus
    return dataclasses.replace(config, num_threads=max(1, usable // data_parallel_size))


def serve_supervised(settings: IzhSettings, engine_config: EngineConfig) -> int:
    """Run the supervisor until the server stops; its exit code."""
    check_settings(settings)
    config = core_threads(engine_config, settings.engine.data_parallel_size)
    return asyncio.run(Supervisor(settings, config).run())


@dataclass(frozen=True)
class ApiProcessSpec:
    """What an API process is handed (pickled by multiprocessing's spawn; the socket as a file
    descriptor)."""

    index: int
    settings: IzhSettings
    engine_config: EngineConfig
    cores: list[AttachedCore]
    sock: socket.socket
    status: multiprocessing.connection.Connection
    """The API process sends ("ready",) once it serves, or ("error", message, hint) when it cannot start
    (the hint the single server would print for that error, or None)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket every API process accepts on (bound once, here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Starts the cores and the API processes, watches them, stops them in order."""

    def __init__(self, settings: IzhSettings, engine_config: EngineConfig) -> None:
        self.settings = settings
        self.engine_config = engine_config
        self.num_api = settings.server.api_server_count
        self.num_cores = settings.engine.data_parallel_size
        self.console = stderr_console()
        self.ctx = multiprocessing.get_context("spawn")
        self.cores: list[BaseProcess] = []
        self.apis: list[BaseProcess] = []
        self.status: list[multiprocessing.connection.Connection] = []
        self.events: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self.stopping = False
        self.forced = False
        self.exit_code = 0
        self.num_ready = 0
        self.exited_apis: set[int] = set()
        self.dead_cores: set[int] = set()
        self.tmp_dir = tempfile.mkdtemp(prefix="izh-serve-")

    async def run(self) -> int:
        from izh.settings import export_prometheus_multiproc_dir

        loop = asyncio.get_running_loop()
        s = self.settings.server
        try:
            try:
                sock = bind_socket(s.host, s.port)
            except OSError as exc:
                fail(f"cannot listen on {s.host}:{s.port}: {exc.strerror or exc}")
            metrics_dir = os.path.join(self.tmp_dir, "metrics")
            os.mkdir(metrics_dir)
            # Before any API process starts (they read it when they import prometheus_client).
            export_prometheus_multiproc_dir(metrics_dir)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
            with self.console.status(
                f"[bold]loading {self.engine_config.model}[/] ({self.num_cores} engine cores, "
                f"{self.num_api} API processes starting)..."
            ):
                self._start(sock)
                sock.close()  # the API processes hold it now
                await self._until_started()
            if not self.stopping:
                self.console.print(
                    f"[bold green]izh[/] serving on http://{s.host}:{s.port}/v1 with {self.num_api} API "
                    f"processes and {self.num_cores} engine cores "
                    f"(pids: API {', '.join(str(p.pid) for p in self.apis)}; "
                    f"cores {', '.join(str(p.pid) for p in self.cores)})",
                    highlight=False,
                )
            await self._watch()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await self._stop()
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return self.exit_code

    # --- starting -------------------------------------------------------------------------------

    def _start(self, sock: socket.socket) -> None:
        from izh.engine.core_proc import DEFAULT_CORE_FACTORY, run_engine_core
        from izh.frontend.client import AttachedCore

        log_level = logging.getLogger("izh").getEffectiveLevel()
        loop = asyncio.get_running_loop()
        inputs = [f"ipc://{self.tmp_dir}/core{k}-in.sock" for k in range(self.num_cores)]
        outputs = [
            [f"ipc://{self.tmp_dir}/core{k}-api{a}-out.sock" for a in range(self.num_api)]
            for k in range(self.num_cores)
        ]
        for k in range(self.num_cores):
            proc = self.ctx.Process(
                target=run_engine_core,
                args=(self.engine_config, inputs[k], outputs[k], DEFAULT_CORE_FACTORY, log_level),
                name=f"EngineCore-{k}",
                daemon=True,
            )
            proc.start()
            self.cores.append(proc)
            loop.add_reader(proc.sentinel, self._post, "core_exit", k)
            logger.info("started engine core %d (pid %s)", k, proc.pid)
        for a in range(self.num_api):
            cores = [
                AttachedCore(inputs[k], outputs[k][a], client_index=a, pid=self.cores[k].pid)
                for k in range(self.num_cores)
            ]
            parent_end, child_end = self.ctx.Pipe(duplex=False)
            spec = ApiProcessSpec(a, self.settings, self.engine_config, cores, sock, child_end)
            proc = self.ctx.Process(target=api_process_main, args=(spec,), name=f"ApiServer-{a}", daemon=True)
            proc.start()
            child_end.close()
            self.apis.append(proc)
            self.status.append(parent_end)
            loop.add_reader(proc.sentinel, self._post, "api_exit", a)
            loop.add_reader(parent_end.fileno(), self._post, "api_status", a)
            logger.info("started API process %d (pid %s)", a, proc.pid)

    def _post(self, kind: str, index: int) -> None:
        loop = asyncio.get_running_loop()
        if kind == "core_exit":
            loop.remove_reader(self.cores[index].sentinel)
        elif kind == "api_exit":
            loop.remove_reader(self.apis[index].sentinel)
        elif kind == "api_status":
            loop.remove_reader(self.status[index].fileno())  # back once the message is read
        self.events.put_nowait((kind, index))

    async def _until_started(self) -> None:
        while self.num_ready < self.num_api and not self.stopping:
            self._handle(*await self.events.get())

    async def _watch(self) -> None:
        while len(self.exited_apis) < self.num_api:
            self._handle(*await self.events.get())

    # --- events ---------------------------------------------------------------------------------

    def _handle(self, kind: str, index: int) -> None:
        if kind == "api_status":
            self._on_status(index)
        elif kind == "api_exit":
            self._on_api_exit(index)
        elif kind == "core_exit":
            self._on_core_exit(index)
        elif kind == "signal":
            self._on_stop_signal(index)

    def _on_status(self, a: int) -> None:
        conn = self.status[a]
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # it exited; its exit is reported on its own
        asyncio.get_running_loop().add_reader(conn.fileno(), self._post, "api_status", a)
        if message[0] == "ready":
            self.num_ready += 1
        elif message[0] == "error" and not self.stopping:
            self.console.print(f"[bold red]Error:[/] {message[1]}", highlight=False)
            if len(message) > 2 and message[2]:
                self.console.print(f"[dim]Hint: {message[2]}[/]", highlight=False)
            self._begin_stop(EXIT_FAILURE)

    def _on_api_exit(self, a: int) -> None:
        self.exited_apis.add(a)
        proc = self.apis[a]
        proc.join(1)
        if self.stopping:
            return
        alive_cores = [k for k, core in enumerate(self.cores) if core.is_alive()]
        if not alive_cores:
            logger.error(
                "every engine core died; API process %d exited (%s)", a, describe_exit(proc.exitcode)
            )
            self.console.print("[bold red]Error:[/] the engine core died", highlight=False)
        else:
            logger.error(
                "API process %d (pid %s) exited unexpectedly (%s); stopping the server (exit 1) for a "
                "supervisor to restart it",
                a,
                proc.pid,
                describe_exit(proc.exitcode),
            )
        self._begin_stop(EXIT_FAILURE)

    def _on_core_exit(self, k: int) -> None:
        self.dead_cores.add(k)
        proc = self.cores[k]
        proc.join(1)
        if self.stopping:
            return
        alive = self.num_cores - len(self.dead_cores)
        if alive:
            logger.error(
                "engine core %d (pid %s) exited (%s); its requests failed, %d of %d cores serve on (degraded)",
                k,
                proc.pid,
                describe_exit(proc.exitcode),
                alive,
                self.num_cores,
            )
        else:
            # The API processes notice (every request fails, /health 503) and exit; so do we.
            logger.error(
                "engine core %d (pid %s) exited (%s); no core is left",
                k,
                proc.pid,
                describe_exit(proc.exitcode),
            )

    def _on_signal(self, sig: int) -> None:
        self.events.put_nowait(("signal", sig))

    def _on_stop_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.stopping:
            logger.warning("second %s: stopping now", name)
            self.forced = True
            self._signal_apis(signal.SIGTERM)  # their second signal: exit at once
            for core in self.cores:
                if core.is_alive():
                    core.kill()
            return
        logger.info(
            "%s: draining %d API processes (up to %.0f s for in-flight requests)",
            name,
            self.num_api,
            self.settings.server.drain_timeout_s,
        )
        self._begin_stop(0)

    def _begin_stop(self, exit_code: int) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.exit_code = exit_code
        self._signal_apis(signal.SIGTERM)

    def _signal_apis(self, sig: int) -> None:
        for a, proc in enumerate(self.apis):
            if a not in self.exited_apis and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    # --- stopping -------------------------------------------------------------------------------

    async def _stop(self) -> None:
        """API processes first (they drain), then the cores; never leaves a process behind."""
        self.stopping = True
        self._signal_apis(signal.SIGTERM)
        deadline = self.settings.server.drain_timeout_s + 15
        await _join_all(self.apis, deadline)
        for proc in self.apis:
            if proc.is_alive():
                logger.warning("API process %s did not exit; killing it", proc.pid)
                proc.kill()
        await _join_all(self.apis, 5)
        for proc in self.cores:
            if proc.is_alive():
                if self.forced:
                    proc.kill()
                else:
                    proc.terminate()  # the core's SIGTERM handler unwinds its loop in order
        await _join_all(self.cores, _CORE_STOP_WAIT_S)
        for proc in self.cores:
            if proc.is_alive():
                logger.warning("engine core %s did not exit; killing it", proc.pid)
                proc.kill()
        await _join_all(self.cores, 5)
        for conn in self.status:
            conn.close()


async def _join_all(procs: list[BaseProcess], timeout_s: float) -> None:
    def join() -> None:
        for proc in procs:
            proc.join(timeout_s)

    if procs:
        await asyncio.to_thread(join)


# --- the API process -------------------------------------------------------------------------------


def api_process_main(spec: ApiProcessSpec) -> None:
    """The entry point of API process `spec.index` (spawned)."""
    from izh_cli.server import configure_logging

    os.setpgrp()  # a terminal's Ctrl-C goes to the supervisor, which drains us with SIGTERM
    multiprocessing.current_process().name = f"ApiServer-{spec.index}"
    configure_logging(spec.settings.logging.level, spec.settings.logging.json_format)
    _exit_with_parent()
    code = asyncio.run(_serve_api(spec))
    spec.status.close()
    sys.exit(code)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.warning("the izh serve supervisor is gone; API process exits")
        logging.shutdown()
        os._exit(EXIT_FAILURE)

    threading.Thread(target=watch, name="ApiParentWatch", daemon=True).start()


async def _serve_api(spec: ApiProcessSpec) -> int:
    from izh.errors import IzhError
    from izh.frontend.dp_client import start_attached_llm
    from izh_cli.server import EXIT_ENGINE_DEAD, build_server_app, make_server, uvicorn_config

    settings = spec.settings
    s = settings.server
    try:
        llm = await start_attached_llm(
            spec.engine_config,
            spec.cores,
            max_requests_in_flight=s.max_requests_in_flight,
            max_waiting_requests=s.max_waiting_requests,
            request_timeout_s=s.request_timeout_s,
            max_buffered_outputs=s.max_buffered_outputs,
            heartbeat_timeout_s=s.engine_heartbeat_timeout_s,
            step_timeout_s=s.engine_step_timeout_s or None,
        )
    except IzhError as exc:
        spec.status.send(("error", exc.message, hint_for(exc)))
        return EXIT_FAILURE
    server: Any = None
    try:
        app = build_server_app(llm, settings, api_index=spec.index)
        server = make_server(uvicorn_config(app, settings), app, llm, s.drain_timeout_s)
        spec.status.send(("ready",))
        await server.serve(sockets=[spec.sock])
    except Exception as exc:
        logger.exception("API process %d failed", spec.index)
        with contextlib.suppress(OSError):
            spec.status.send(("error", f"API process {spec.index} failed: {exc}", None))
        return EXIT_FAILURE
    finally:
        forced = server is not None and server.force_exit
        await llm.shutdown(0, core_timeout_s=0 if forced else 5.0)
    if llm.is_dead and not server.stopping:
        return EXIT_ENGINE_DEAD
    return 0
