"""EngineCoreClient: start the engine core, talk to it over ZMQ, and watch that it lives.

The client binds a PULL socket (outputs) on an `ipc://` path in a private temp dir, starts
`run_engine_core` in a spawned process (or, for debugging, a daemon thread), and once the core is
ready connects a PUSH socket (inputs) to the input socket the core bound in the same dir.
All socket use happens on the event loop's thread: ZMQ sockets are not thread-safe.

Watchdogs turn a lost core into `is_dead` with a reason: the process sentinel (the core exited), a
heartbeat (a ping not answered within `heartbeat_timeout_s`: the core process is stopped or frozen) and
the step bound (the core's answer says one step has run past `step_timeout_s`: hung in a step). The
core's input thread answers pings during a step too, so a long step (a prefill of many tokens on a slow
CPU) keeps the core alive and the server ready; the frontend logs a warning when one outlasts the
heartbeat timeout.

The core publishes its stats on its outputs; the output loop keeps the latest (`latest_stats`), so a
dashboard reads them at once instead of waiting for the core to finish its current step.

With `attach` (an `AttachedCore`), the client starts nothing: `izh serve --api-server-count N` (or
`--data-parallel-size N`) starts the cores itself and hands each API process the addresses, its
`client_index` and the core's pid. The client then binds its own output address, stamps its index on
what it sends, watches the pid (a pidfd: the core is not its child) and, on shutdown, leaves the core
to its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from izh.config import EngineConfig
from izh.engine.core_proc import DEFAULT_CORE_FACTORY, run_engine_core
from izh.engine_messages import (
    AddRequest,
    Dead,
    EngineInput,
    EngineMessage,
    EngineOutputs,
    Ready,
    SchedulerStats,
    Shutdown,
    Utility,
    UtilityResult,
    make_encoder,
    make_output_decoder,
)
from izh.errors import EngineDead, IzhError, describe_exit, model_load_error

logger = logging.getLogger(__name__)

CORE_MODES = ("process", "thread")
# Inputs this big go out without a copy (a long prompt); below it copying is cheaper.
_ZERO_COPY_MIN_BYTES = 64 * 1024
# After the core process exits, how long a Dead message it sent just before may still take to
# arrive: its reason ("step() failed: ...") beats the bare exit code.
_DEAD_MESSAGE_GRACE_S = 0.5
# Messages the output reader handles per wake-up before letting other callbacks run.
_DRAIN_BATCH = 64
_TERMINATE_WAIT_S = 3.0


@dataclass(frozen=True, slots=True)
class AttachedCore:
    """A core another process started (izh serve's supervisor), and this frontend's place at it."""

    input_addr: str
    """The core's input address (it binds it)."""
    output_addr: str
    """This frontend's output address (this client binds it; the core connects to it)."""
    client_index: int
    """This frontend's index among the core's frontends (its position in the core's output list)."""
    pid: int | None = None
    """The core process, watched for its exit."""


class EngineCoreClient:
    """The frontend's end of the engine core: sockets, process, output loop and watchdogs.

    Make one with `await EngineCoreClient.start(...)`. `on_outputs` gets every EngineOutputs message
    (called on the event loop, in arrival order); `on_dead` gets the reason once if the core dies or
    hangs (never after `shutdown()` began).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_outputs: Callable[[EngineOutputs], None],
        on_dead: Callable[[str], None],
        core_mode: str = "process",
        core_factory: str = DEFAULT_CORE_FACTORY,
        heartbeat_interval_s: float = 5.0,
        heartbeat_timeout_s: float = 30.0,
        step_timeout_s: float | None = None,
        attach: AttachedCore | None = None,
    ) -> None:
        if core_mode not in CORE_MODES:
            raise ValueError(f"core_mode must be one of {', '.join(CORE_MODES)}, got {core_mode!r}")
        self.config = config
        self.core_mode = core_mode
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._step_timeout_s = step_timeout_s
        self._long_step_warned = -1
        """The step (the core's count) already reported as long."""
        self._loop = asyncio.get_running_loop()
        self._encoder = make_encoder()
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        self._core_exited: asyncio.Future[int | None] = self._loop.create_future()
        self._dead_reason: str | None = None
        self._closing = False
        self._closed = False
        self._tasks: list[asyncio.Future[None]] = []
        self._reaper: asyncio.Future[None] | None = None
        self._shutdown_task: asyncio.Future[None] | None = None
        self._last_alive = self._loop.time()
        """Loop time of the core's latest message: every output and heartbeat answer is a sign of life."""
        self.ready: Ready | None = None
        self._stats: SchedulerStats | None = None
        self._stats_ts = 0.0
        self._block_map: bytes | None = None
        self._block_map_ts = 0.0

        self.attach = attach
        self.client_index = attach.client_index if attach is not None else 0
        self._pidfd: int | None = None
        if attach is None:
            self._tmp_dir: str | None = tempfile.mkdtemp(prefix="izh-core-")
            self.input_addr = f"ipc://{self._tmp_dir}/input.sock"
            self.output_addr = f"ipc://{self._tmp_dir}/output.sock"
        else:
            self._tmp_dir = None
            self.input_addr, self.output_addr = attach.input_addr, attach.output_addr
        self._ctx = zmq.Context()
        self._in_sock = self._ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._in_sock.setsockopt(zmq.LINGER, 1000)
        self._in_connected = False
        out_sock = self._ctx.socket(zmq.PULL)
        out_sock.setsockopt(zmq.RCVHWM, 0)
        out_sock.setsockopt(zmq.LINGER, 0)
        out_sock.bind(self.output_addr)
        self._out_sock = out_sock
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        try:
            if attach is None:
                self._start_core(core_factory)
            else:
                self._watch_pid(attach.pid)
        except BaseException:
            _cleanup(None, self._ctx, self._tmp_dir)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._ctx, self._tmp_dir)

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        *,
        on_outputs: Callable[[EngineOutputs], None],
        on_dead: Callable[[str], None],
        core_mode: str = "process",
        core_factory: str = DEFAULT_CORE_FACTORY,
        ready_timeout_s: float = 600.0,
        heartbeat_interval_s: float = 5.0,
        heartbeat_timeout_s: float = 30.0,
        step_timeout_s: float | None = None,
        attach: AttachedCore | None = None,
    ) -> EngineCoreClient:
        """Start the core (or, with `attach`, connect to a running one) and wait for Ready.

        Raises ModelLoadError with the core's reason if it sends Dead while starting, and EngineDead
        if it exits without a word or is not ready within `ready_timeout_s`.
        """
        client = cls(
            config,
            on_outputs=on_outputs,
            on_dead=on_dead,
            core_mode=core_mode,
            core_factory=core_factory,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            step_timeout_s=step_timeout_s,
            attach=attach,
        )
        try:
            client.ready = await client._wait_ready(ready_timeout_s)
            client._last_alive = client._loop.time()
            client._connect_input()
        except BaseException:
            await client.shutdown(timeout_s=1.0)
            raise
        client._tasks = [
            asyncio.create_task(client._output_loop(), name="izh-core-output"),
            asyncio.create_task(client._heartbeat_loop(), name="izh-core-heartbeat"),
        ]
        return client

    # --- state ----------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def is_responsive(self) -> bool:
        """The core said something within the heartbeat timeout (its input thread answers pings even
        during a step, so a stopped or frozen process turns this False before the watchdog declares
        it dead)."""
        return self._loop.time() - self._last_alive <= self._heartbeat_timeout_s

    @property
    def seconds_since_alive(self) -> float:
        return self._loop.time() - self._last_alive

    def latest_stats(self) -> tuple[SchedulerStats | None, float | None]:
        """The core's latest published stats and their age in seconds ((None, None) before any)."""
        if self._stats is None:
            return None, None
        return self._stats, max(0.0, time.monotonic() - self._stats_ts)

    def latest_block_map(self) -> tuple[list[int], float | None]:
        """The core's latest published KV block states (one per block id) and their age in seconds."""
        if self._block_map is None:
            return [], None
        return list(self._block_map), max(0.0, time.monotonic() - self._block_map_ts)

    def engine_states(self) -> list[dict[str, Any]]:
        """This core as /v1/izh/stats lists it (`engines`; a DataParallelClient lists each)."""
        return [engine_state(self, 0)]

    @property
    def core_pid(self) -> int | None:
        """The core process's id (None in thread mode)."""
        if self.attach is not None:
            return self.attach.pid
        return self._proc.pid if self._proc is not None else None

    # --- starting -------------------------------------------------------------------------------

    def _start_core(self, core_factory: str) -> None:
        log_level = logging.getLogger("izh").getEffectiveLevel()
        args = (self.config, self.input_addr, self.output_addr, core_factory, log_level)
        if self.core_mode == "process":
            proc = multiprocessing.get_context("spawn").Process(
                target=run_engine_core, args=args, name="EngineCore", daemon=True
            )
            proc.start()
            self._proc = proc
            self._loop.add_reader(proc.sentinel, self._on_process_exit)
            logger.info("started EngineCore process (pid %s)", proc.pid)
        else:
            self._thread = threading.Thread(
                target=self._thread_main, args=args, name="EngineCore", daemon=True
            )
            self._thread.start()

    def _watch_pid(self, pid: int | None) -> None:
        """An attached core is not our child: a pidfd tells when it exits (exit status unknown)."""
        if pid is None:
            return
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._loop.call_soon(self._set_core_exited, None)
            return
        except (AttributeError, OSError) as exc:  # no pidfds here (not Linux >= 5.3)
            logger.info("cannot watch the engine core's pid (%s); the heartbeat alone watches it", exc)
            return
        self._loop.add_reader(self._pidfd, self._on_pid_exit)

    def _on_pid_exit(self) -> None:
        self._close_pidfd()
        self._set_core_exited(None)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _thread_main(self, *args: Any) -> None:
        """Debug mode: the core loop in this process; report its end like a process exit."""
        exit_code: int | None = 0
        try:
            run_engine_core(*args)
        except SystemExit as exc:
            exit_code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            logger.exception("EngineCore thread crashed")
            exit_code = 1
        finally:
            with contextlib.suppress(RuntimeError):  # the loop may be closed at interpreter exit
                self._loop.call_soon_threadsafe(self._set_core_exited, exit_code)

    def _connect_input(self) -> None:
        """Connect to the core's input socket (bound by the time it is ready, or loading)."""
        if not self._in_connected:
            self._in_sock.connect(self.input_addr)
            self._in_connected = True

    async def _wait_ready(self, timeout_s: float) -> Ready:
        decoder = make_output_decoder()
        recv = asyncio.ensure_future(self._recv_one())
        try:
            waited: set[asyncio.Future[Any]] = {recv, self._core_exited}
            done, _ = await asyncio.wait(waited, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done and self._core_exited in done:
                # It may have said why just before exiting.
                await asyncio.wait({recv}, timeout=_DEAD_MESSAGE_GRACE_S)
            if not recv.done():
                if self._core_exited.done():
                    code = describe_exit(self._core_exited.result())
                    raise EngineDead(
                        f"the engine core exited while starting ({code}); its log above says why"
                    )
                raise EngineDead(f"the engine core was not ready within {timeout_s:g} s")
            msg = decoder.decode(recv.result().buffer)
        finally:
            recv.cancel()
        if isinstance(msg, Dead):
            raise model_load_error(msg.reason, msg.error_code)
        if not isinstance(msg, Ready):
            raise EngineDead(f"the engine core sent {type(msg).__name__} before Ready")
        logger.info(
            "EngineCore ready (%s): max_model_len=%d, %d KV blocks of %d tokens, %s %s",
            self.core_mode,
            msg.max_model_len,
            msg.num_blocks,
            msg.block_size,
            msg.device,
            msg.dtype,
        )
        return msg

    # --- talking to the core --------------------------------------------------------------------

    def send(self, msg: EngineInput) -> None:
        """Queue one message for the core; raises EngineDead once the core is gone."""
        if self._dead_reason is not None:
            raise EngineDead(f"the engine core is dead: {self._dead_reason}")
        if self._closed:
            raise EngineDead("the engine core was shut down")
        if self.client_index and type(msg) in (AddRequest, Utility):
            msg.client_index = self.client_index  # type: ignore[union-attr]
        data = self._encoder.encode(msg)
        try:
            # A connected PUSH with no high-water mark queues and never blocks; NOBLOCK makes
            # sure the event loop never waits here whatever happens to the core.
            self._in_sock.send(data, zmq.NOBLOCK, copy=len(data) < _ZERO_COPY_MIN_BYTES)
        except zmq.Again:
            raise EngineDead("the engine core is not accepting input") from None

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = 30.0) -> Any:
        """Call a utility method on the core (ping, reset_prefix_cache, kv_block_states).

        Raises TimeoutError after `timeout_s`, EngineDead if the core dies meanwhile, and IzhError
        if the core reports that the method failed.
        """
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending_calls[call_id] = future
        try:
            self.send(Utility(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending_calls.pop(call_id, None)

    # --- the output loop ------------------------------------------------------------------------

    async def _recv_one(self) -> zmq.Frame:
        """The next frame from the core, waiting for one (the start-up's Ready or Dead)."""
        sock = self._out_sock
        fd = sock.getsockopt(zmq.FD)
        while True:
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return sock.recv(zmq.NOBLOCK, copy=False)
            readable: asyncio.Future[None] = self._loop.create_future()
            self._loop.add_reader(fd, _set_once, readable)
            try:
                # zmq's FD signals edges: what arrived before the reader is seen by EVENTS alone.
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    await readable
            finally:
                self._loop.remove_reader(fd)

    async def _output_loop(self) -> None:
        """Dispatch the core's messages from a reader on the socket's FD until cancelled.

        Each wake-up reads every message queued (zmq's FD signals edges, so whatever is left unread
        would wait for the next message), up to _DRAIN_BATCH before letting other callbacks run. A
        pyzmq asyncio recv per message cost a future and an epoll registration and removal each:
        at one stream, a fifth of the frontend's time per token.
        """
        decoder = make_output_decoder()
        sock = self._out_sock
        fd = sock.getsockopt(zmq.FD)
        lost: asyncio.Future[None] = self._loop.create_future()

        def drain() -> None:
            try:
                for _ in range(_DRAIN_BATCH):
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        return
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                    self._last_alive = self._loop.time()
                    try:
                        msg = decoder.decode(frame.buffer)
                    except Exception:
                        logger.exception("undecodable message from the engine core")
                        continue
                    self._dispatch(msg)
                self._loop.call_soon(drain)  # more may be queued: no edge will say so
            except zmq.ZMQError as exc:
                if not lost.done():
                    lost.set_exception(exc)

        self._loop.add_reader(fd, drain)
        try:
            drain()  # what came before the reader
            await lost
        except zmq.ZMQError as exc:
            # Without this reader no output ever arrives again: as good as dead.
            self._mark_dead(f"lost the engine core's output socket: {exc}")
        finally:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(fd)

    def _dispatch(self, msg: EngineMessage) -> None:
        if isinstance(msg, EngineOutputs):
            if msg.stats is not None:
                self._keep_stats(msg.stats, msg.timestamp)
            try:
                self._on_outputs(msg)
            except Exception:
                # A bug in the handler must not stop every other request's outputs.
                logger.exception("output handler failed")
        elif isinstance(msg, UtilityResult):
            self._resolve_call(msg)
        elif isinstance(msg, Dead):
            self._mark_dead(msg.reason)
        else:
            logger.warning("unexpected %s from the engine core", type(msg).__name__)

    def _keep_stats(self, stats: SchedulerStats, timestamp: float) -> None:
        """Keep the snapshot (timestamp: the core's monotonic clock, the same clock as ours)."""
        self._stats, self._stats_ts = stats, timestamp
        if stats.kv_block_states is not None:
            self._block_map, self._block_map_ts = stats.kv_block_states, timestamp

    def _resolve_call(self, msg: UtilityResult) -> None:
        future = self._pending_calls.pop(msg.call_id, None)
        if future is None or future.done():
            return  # timed out already
        if msg.error is not None:
            future.set_exception(IzhError(f"engine core utility failed: {msg.error}"))
        else:
            future.set_result(msg.result)

    # --- watchdogs ------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self._closing and self._dead_reason is None:
            await asyncio.sleep(self._heartbeat_interval_s)
            try:
                liveness = await self.call_utility("ping", timeout_s=self._heartbeat_timeout_s)
            except TimeoutError:
                self._mark_dead(
                    f"the engine core did not answer a heartbeat within {self._heartbeat_timeout_s:g} s "
                    "(the process is stopped or frozen?)"
                )
                return
            except IzhError:
                return  # dead or closed: reported elsewhere
            if not self._step_alive(liveness):
                return

    def _step_alive(self, liveness: dict[str, Any]) -> bool:
        """Check a heartbeat's answer: False (and dead) once one step has run past the step bound."""
        running_s, step = liveness.get("step_running_s"), liveness.get("num_steps", 0)
        if running_s is None:
            return True
        if self._step_timeout_s and running_s > self._step_timeout_s:
            self._mark_dead(
                f"one engine step has run for {running_s:.0f} s, past the step timeout of "
                f"{self._step_timeout_s:g} s (hung in a step?)"
            )
            return False
        if running_s > self._heartbeat_timeout_s and step != self._long_step_warned:
            self._long_step_warned = step
            logger.warning(
                "engine step %d has run for %.0f s and goes on (a long prefill on a slow or busy CPU?); "
                "the core answers heartbeats meanwhile",
                step,
                running_s,
            )
        return True

    def _on_process_exit(self) -> None:
        assert self._proc is not None
        self._loop.remove_reader(self._proc.sentinel)
        self._reaper = asyncio.ensure_future(self._reap(self._proc))

    async def _reap(self, proc: multiprocessing.process.BaseProcess) -> None:
        # The sentinel fires as the process closes its files; its exit status follows at once.
        await asyncio.to_thread(proc.join)
        self._set_core_exited(proc.exitcode)

    def _set_core_exited(self, exit_code: int | None) -> None:
        if not self._core_exited.done():
            self._core_exited.set_result(exit_code)
        if self.ready is not None and not self._closing and self._dead_reason is None:
            self._tasks.append(asyncio.ensure_future(self._report_unexpected_exit(exit_code)))

    async def _report_unexpected_exit(self, exit_code: int | None) -> None:
        # Let a Dead sent just before the exit arrive first: its reason is the useful one.
        await asyncio.sleep(_DEAD_MESSAGE_GRACE_S)
        self._mark_dead(f"the engine core exited unexpectedly ({describe_exit(exit_code)})")

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None or self._closing:
            return
        self._dead_reason = reason
        logger.error("engine core is dead: %s", reason)
        error = EngineDead(f"the engine core is dead: {reason}")
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)
        self._pending_calls.clear()
        self._on_dead(reason)

    # --- shutdown -------------------------------------------------------------------------------

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to exit, wait up to `timeout_s`, then terminate/kill it; release everything.

        A core already declared dead (it hung, or lost its socket), or any core when `timeout_s` is
        0, is killed at once: a dead one cannot be trusted to act on a request or on SIGTERM (a
        stopped process ignores both). Idempotent; a concurrent second call waits for the first.
        Never leaves the core process behind.
        """
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout_s))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout_s: float) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self.attach is not None:
            # The core is its owner's (izh serve's supervisor) to stop; it serves other frontends.
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._close_pidfd()
            self._release()
            self._fail_pending_calls()
            return
        if (
            (self._dead_reason is not None or timeout_s <= 0)
            and self._proc is not None
            and not self._core_exited.done()
        ):
            logger.warning("killing the engine core (pid %s) without waiting", self._proc.pid)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join)
            self._set_core_exited(self._proc.exitcode)
        if not self._core_exited.done():
            with contextlib.suppress(zmq.ZMQError):
                self._connect_input()  # it may still be loading: Shutdown waits for it there
                self._in_sock.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            await self._wait_core_exit(timeout_s)
        if self._proc is not None and not self._core_exited.done():
            logger.warning("EngineCore did not exit within %.1f s; terminating it", timeout_s)
            self._proc.terminate()
            if not await self._wait_core_exit(_TERMINATE_WAIT_S):
                logger.warning("EngineCore ignored SIGTERM; killing it")
                self._proc.kill()
                await asyncio.to_thread(self._proc.join)
        if self._thread is not None and self._thread.is_alive():
            logger.warning("EngineCore thread did not exit within %.1f s; abandoning it", timeout_s)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._release()
        self._fail_pending_calls()

    def _fail_pending_calls(self) -> None:
        error = EngineDead("the engine core was shut down")
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)
        self._pending_calls.clear()

    async def _wait_core_exit(self, timeout_s: float) -> bool:
        done, _ = await asyncio.wait({self._core_exited}, timeout=timeout_s)
        return bool(done)

    def _release(self) -> None:
        self._closed = True
        if self._proc is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._proc.sentinel)
        self._out_sock.close(linger=0)
        self._finalizer()  # closes the context, removes the temp dir, reaps the process


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _cleanup(
    proc: multiprocessing.process.BaseProcess | None, ctx: zmq.Context[Any], tmp_dir: str | None
) -> None:
    """Release what a client holds; runs once, from shutdown(), garbage collection or atexit."""
    if proc is not None:
        if proc.is_alive():
            proc.terminate()
            proc.join(_TERMINATE_WAIT_S)
        if proc.is_alive():
            proc.kill()
        proc.join()
    ctx.destroy(linger=0)
    if tmp_dir is not None:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def engine_state(client: EngineCoreClient, index: int, dead_reason: str | None = None) -> dict[str, Any]:
    """One core as /v1/izh/stats shows it (`engines`)."""
    stats, age = client.latest_stats()
    reason = dead_reason or client.dead_reason
    return {
        "engine": index,
        "pid": client.core_pid,
        "alive": reason is None,
        "dead_reason": reason,
        "num_running": stats.num_running if stats is not None and reason is None else 0,
        "num_waiting": stats.num_waiting if stats is not None and reason is None else 0,
        "kv_cache_usage": stats.kv_cache_usage if stats is not None and reason is None else 0.0,
        "num_blocks": stats.num_blocks if stats is not None else 0,
        "prefix_cache_queries": stats.prefix_cache_queries if stats is not None else 0,
        "prefix_cache_hits": stats.prefix_cache_hits if stats is not None else 0,
        "spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens if stats is not None else 0,
        "spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens if stats is not None else 0,
        "stats_age_s": age,
    }
