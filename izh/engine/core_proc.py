"""The engine core's process loop: an input thread, the busy loop, an output thread.

`run_engine_core` is the entry point of the spawned core process (and the body of the debug thread).
The frontend picks `ipc://` paths in a private temp dir and binds the output PULL socket; the core
connects its output PUSH socket there and binds the input PULL socket. Only the busy-loop thread
touches the EngineCore; the I/O threads only decode and encode, and libzmq releases the GIL while
it waits, so I/O overlaps steps. The input thread answers the frontend's heartbeat (`ping`) itself,
with how long the step under way has run: a step that takes minutes (a long prefill on a slow CPU)
does not silence the core, and the frontend still sees a step that never ends.

Several frontends (`izh serve --api-server-count N`, izh_cli/serve_multi.py): the core is given one
output address per frontend, all bound by the frontends, and connects a PUSH socket to each. Every
frontend's PUSH connects to the one input PULL (fair-queued). AddRequest and Utility carry the
sender's `client_index`; the output thread sends each request's outputs, and each utility's answer,
to that frontend only, and the stats, Ready and Dead to all of them. The output sockets have no
high-water mark and send without blocking: a frontend that falls behind (a GC pause) gets every
message later, and one that is gone (killed) never blocks the others; its queue grows only until the
supervisor, which stops the whole server when an API process dies, stops the core.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from izh.config import EngineConfig
from izh.engine_messages import (
    Abort,
    AddRequest,
    Dead,
    EngineInput,
    EngineMessage,
    EngineOutput,
    EngineOutputs,
    Ready,
    SchedulerStats,
    Shutdown,
    Utility,
    UtilityResult,
    make_encoder,
    make_input_decoder,
)
from izh.errors import IzhError

logger = logging.getLogger(__name__)

DEFAULT_CORE_FACTORY = "izh.engine.core:EngineCore"
STATS_INTERVAL_S = 0.05
"""Scheduler stats ride on an outputs message at most this often while busy (and always when idle)."""
BLOCK_MAP_INTERVAL_S = 0.25
"""The KV block map (O(num_blocks) to build) rides on the stats at most this often while busy."""
IDLE_STATS_INTERVAL_S = 1.0
"""An idle core publishes its stats this often: the frontend's copy stays fresh (and it is alive)."""
# Messages at least this big are sent without a copy; below it the copy is cheaper than the
# bookkeeping of a zero-copy frame (pyzmq's own default threshold).
_ZERO_COPY_MIN_BYTES = 64 * 1024
# How long a closing socket may still flush queued messages (a Dead must reach the frontend).
_LINGER_MS = 2000


class EngineCoreLike(Protocol):
    """What the loop needs of an engine core (EngineCore, or a test double)."""

    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: str
    dtype: str

    def add_request(self, req: AddRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]: ...
    def step(self) -> list[EngineOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def make_stats(self) -> SchedulerStats: ...
    def reset_prefix_cache(self) -> bool: ...
    def kv_block_states(self) -> list[int]: ...
    def embedding_info(self) -> dict[str, Any]: ...
    def lora_info(self) -> dict[str, Any]: ...
    def kv_cache_info(self) -> dict[str, Any]: ...
    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]: ...
    def unload_lora_adapter(self, name: str) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


class _Fatal(Exception):
    """step() (or the core itself) failed: the core sends Dead and exits non-zero."""


@dataclass(slots=True)
class _InputClosed:
    """Put on the input queue when the input socket fails: the frontend is gone."""

    reason: str


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str | list[str],
    core_factory: str = DEFAULT_CORE_FACTORY,
    log_level: int | None = None,
) -> None:
    """Build the core, send Ready (or Dead and return), then serve until Shutdown.

    `output_addr` is the frontend's output address, or one per frontend (its list index is the
    frontend's `client_index`).

    `core_factory` is "module:attribute", called with the config. In the process's main thread this
    also names the process "EngineCore", configures logging at `log_level` and sets the signal
    handlers. An exception in step() sends Dead and raises SystemExit(1) (a thread just ends).
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    output_addrs = [output_addr] if isinstance(output_addr, str) else list(output_addr)
    if in_main_thread:
        # SIGTERM stays pending until the I/O threads run and own their sockets. The threads inherit
        # the mask, so the signal then reaches only this thread, and no start-up it interrupts can
        # leave a socket that nobody closes (ctx.term() would wait for it forever).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        addrs = [input_addr, *output_addrs]
        _setup_process(log_level, [a.removeprefix("ipc://") for a in addrs if a.startswith("ipc://")])
    ctx = zmq.Context()
    out_socks = []
    for addr in output_addrs:
        out_sock = ctx.socket(zmq.PUSH)
        out_sock.setsockopt(zmq.LINGER, _LINGER_MS)
        if len(output_addrs) > 1:
            out_sock.setsockopt(zmq.SNDHWM, 0)  # see the module docstring: never drop, never block
        out_sock.connect(addr)
        out_socks.append(out_sock)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    # Bound before Ready: the frontend connects once it is ready, and its first sends then queue
    # at once (a connecting PUSH gets its pipe immediately; a binding one only when a peer shows).
    in_sock.bind(input_addr)
    loop = EngineCoreProc(in_sock, out_socks)
    loop.start_io()
    if in_main_thread:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    exit_code = 0
    try:
        exit_code = loop.run(config, core_factory)
    finally:
        # Flushes the queued messages (a Dead among them) within the linger time and shuts the core
        # down; term() then wakes the input thread's blocking recv with ETERM, and it closes its socket.
        loop.close()
        ctx.term()
    if exit_code:
        raise SystemExit(exit_code)


def _build_core(
    config: EngineConfig, core_factory: str, send: Callable[[EngineMessage], None]
) -> EngineCoreLike | None:
    """The core, announced with Ready; or None after sending Dead with a one-line reason."""
    try:
        factory = _resolve_factory(core_factory)
        core: EngineCoreLike = factory(config)
    except Exception as exc:  # every startup failure must reach the frontend as Dead
        exit_request = _system_exit_within(exc)
        if exit_request is not None:
            # A SIGTERM's SystemExit that Python wrapped on the way out (one raised in a class body's
            # __set_name__ comes back as a RuntimeError): the core ends as the signal asked, as it
            # does when the SystemExit arrives bare.
            raise exit_request from exc
        reason = _one_line(exc)
        logger.error("EngineCore failed to start: %s", reason, exc_info=not isinstance(exc, IzhError))
        send(Dead(reason, error_code=exc.code if isinstance(exc, IzhError) else None))
        return None
    ready = Ready(
        max_model_len=core.max_model_len,
        num_blocks=core.num_blocks,
        block_size=core.block_size,
        vocab_size=core.vocab_size,
        eos_token_ids=sorted(core.eos_token_ids),
        device=core.device,
        dtype=core.dtype,
        **core.embedding_info(),
        **core.lora_info(),
        **core.kv_cache_info(),
    )
    send(ready)
    logger.info(
        "EngineCore ready: max_model_len=%d num_blocks=%d block_size=%d device=%s dtype=%s "
        "kv_cache_dtype=%s (%d tokens per GiB)",
        core.max_model_len,
        core.num_blocks,
        core.block_size,
        core.device,
        core.dtype,
        ready.kv_cache_dtype,
        ready.kv_tokens_per_gib,
    )
    return core


def _system_exit_within(exc: BaseException) -> SystemExit | None:
    """The SystemExit this exception was raised from or while handling, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, SystemExit):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _resolve_factory(dotted: str) -> Callable[[EngineConfig], Any]:
    module_name, sep, attr = dotted.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"core factory must look like 'package.module:name', got {dotted!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        raise TypeError(f"core factory {dotted!r} is not callable")
    return factory


def _one_line(exc: BaseException) -> str:
    """A readable one-line reason: an IzhError's own message, else "Type: message"."""
    text = exc.message if isinstance(exc, IzhError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split()) or type(exc).__name__


def _setup_process(log_level: int | None, ipc_paths: list[str]) -> None:
    """Name the process, configure logging and let the parent drive shutdown."""
    import multiprocessing

    multiprocessing.current_process().name = "EngineCore"
    _set_kernel_thread_name(b"EngineCore")
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=log_level if log_level is not None else logging.INFO,
            format="%(asctime)s %(levelname)s EngineCore[%(process)d] %(name)s: %(message)s",
        )
    elif log_level is not None:
        root.setLevel(log_level)
    # Ctrl-C reaches the whole process group; the frontend handles it once and sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A direct SIGTERM (systemd, an operator) ends the core in order: the busy loop unwinds.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    parent = multiprocessing.parent_process()
    if parent is not None:
        watcher = threading.Thread(
            target=_exit_when_parent_dies,
            args=(parent.sentinel, ipc_paths),
            name="EngineCoreParentWatch",
            daemon=True,
        )
        watcher.start()


def _exit_when_parent_dies(parent_sentinel: int, ipc_paths: list[str]) -> None:
    """A frontend killed with SIGKILL cannot send Shutdown: never outlive it as an orphan."""
    import multiprocessing.connection

    multiprocessing.connection.wait([parent_sentinel])
    logger.warning("the frontend process is gone; EngineCore exits")
    _remove_ipc_files(ipc_paths)
    # Not an orderly unwind: with no peer left, a send may block forever and keep ctx.term()
    # waiting. Nobody is left to tell; the OS frees the memory (and the GPU's).
    logging.shutdown()
    os._exit(1)


def _remove_ipc_files(paths: list[str]) -> None:
    """Remove the socket files and their dir (only if then empty: never more than the frontend made)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for directory in {os.path.dirname(path) for path in paths}:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _set_kernel_thread_name(name: bytes) -> None:
    """Show "EngineCore" in ps/top (prctl PR_SET_NAME); best effort, Linux only."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        pr_set_name = 15
        libc.prctl(pr_set_name, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass(slots=True)
class _Targeted:
    """A message for one frontend only (a UtilityResult for its caller)."""

    client_index: int
    msg: EngineMessage


class EngineCoreProc:
    """The busy loop around one core, with its input and output threads."""

    def __init__(self, in_sock: zmq.Socket, out_sock: zmq.Socket | list[zmq.Socket]) -> None:
        self.core: EngineCoreLike  # set by run() once built
        self._has_core = False
        self._in_sock = in_sock
        self._out_socks = [out_sock] if isinstance(out_sock, zmq.Socket) else list(out_sock)
        self._out_sock = self._out_socks[0]
        self._owners: dict[str, int] = {}
        """request id -> client_index, for requests of frontends other than 0 (several frontends)."""
        self._inputs: queue.SimpleQueue[EngineInput | _InputClosed] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[EngineMessage | _Targeted | None] = queue.SimpleQueue()
        self._input_thread = threading.Thread(target=self._input_loop, name="EngineCoreInput", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="EngineCoreOutput", daemon=True)
        self._last_stats_time = 0.0
        self._last_block_map_time = 0.0
        self._stopping = False
        self._num_steps = 0
        self._step_started: float | None = None
        """Monotonic start of the step under way (None between steps): written by the busy loop, read
        by the input thread when it answers a heartbeat."""

    def start_io(self) -> None:
        """Start the I/O threads; from here on they own the sockets (see close())."""
        self._input_thread.start()
        self._output_thread.start()

    def run(self, config: EngineConfig, core_factory: str) -> int:
        """Build the core, then serve until Shutdown (0) or a fatal error (1, after sending Dead).

        A core that fails to build sends Dead and returns 0: the frontend has the reason."""
        core = _build_core(config, core_factory, self._outputs.put)
        if core is None:
            return 0
        self.core, self._has_core = core, True
        if threading.current_thread() is threading.main_thread():
            # What the start-up made (modules, tokenizer tables, tensors' wrappers) lives as long as the
            # process: frozen, the collector stops walking it at every full collection between steps.
            # Only in the core's own process: a core on a thread would freeze its host's objects too.
            gc.collect()
            gc.freeze()
        try:
            self._send_outputs([], force_stats=True)  # the frontend has a snapshot from the start
            self._busy_loop()
        except Exception as exc:
            if isinstance(exc, _Fatal):
                reason = str(exc)
            else:
                logger.exception("EngineCore loop failed")
                reason = f"the engine core loop failed: {_one_line(exc)}"
            logger.error("EngineCore died: %s", reason)
            self._outputs.put(Dead(reason))
            return 1
        return 0

    def close(self) -> None:
        """Send what is queued, close the output socket and shut the core down. The input thread
        blocks in recv; the caller's ctx.term() wakes it with ETERM, and it closes its own socket.
        It is a daemon, so a process exit never waits for it."""
        self._outputs.put(None)
        self._output_thread.join()
        for sock in self._out_socks:
            sock.close()
        if self._has_core:
            self._shutdown_core()

    def _shutdown_core(self) -> None:
        try:
            self.core.shutdown()
        except Exception:
            logger.exception("EngineCore shutdown failed")

    # --- the busy loop --------------------------------------------------------------------------

    def _busy_loop(self) -> None:
        while not self._stopping:
            was_idle = not self.core.has_unfinished_requests()
            self._process_inputs()
            if self._stopping:
                return
            if self.core.has_unfinished_requests():
                # Stats when due, and always on new work after idling: a long step (a prefill) then
                # starts from a snapshot that already shows its requests.
                self._send_outputs([], force_stats=was_idle)
                self._step()

    def _process_inputs(self) -> None:
        """Handle every queued input; block for one only while the core has nothing to do (and then
        publish the stats every IDLE_STATS_INTERVAL_S)."""
        if not self.core.has_unfinished_requests():
            try:
                self._handle(self._inputs.get(timeout=IDLE_STATS_INTERVAL_S))
            except queue.Empty:
                self._send_outputs([], force_stats=True)
                return
        while not self._stopping:
            try:
                msg = self._inputs.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _step(self) -> None:
        self._num_steps += 1
        self._step_started = time.monotonic()
        try:
            outputs = self.core.step()
        except Exception as exc:
            logger.exception("EngineCore step failed")
            raise _Fatal(f"step() failed: {_one_line(exc)}") from exc
        finally:
            self._step_started = None
        self._send_outputs(outputs)

    def liveness(self) -> dict[str, Any]:
        """A heartbeat's answer: the steps begun so far and how long the one under way has run (None
        between steps). The input thread sends it at once, so a long step (a prefill on a slow CPU)
        never silences the core; the frontend bounds one step by server.engine_step_timeout_s."""
        started = self._step_started
        return {
            "num_steps": self._num_steps,
            "step_running_s": None if started is None else time.monotonic() - started,
        }

    def _send_outputs(self, outputs: list[EngineOutput], force_stats: bool = False) -> None:
        """Queue one outputs message, with the scheduler stats when due (or when going idle), and
        with the block map too when that is due or the core is idle."""
        now = time.monotonic()
        stats = None
        idle = not self._has_work()
        if force_stats or idle or now - self._last_stats_time >= STATS_INTERVAL_S:
            with_map = force_stats or idle or now - self._last_block_map_time >= BLOCK_MAP_INTERVAL_S
            stats = self._make_stats(with_map)
            self._last_stats_time = now
            if with_map and stats is not None:
                # A map taken while idle shows no used blocks: the first busy stats after it carry a
                # fresh one, so a reader never pairs busy stats with an idle map.
                self._last_block_map_time = 0.0 if idle else now
        if outputs or stats is not None:
            self._outputs.put(EngineOutputs(outputs=outputs, timestamp=now, stats=stats))

    def _has_work(self) -> bool:
        try:
            return self.core.has_unfinished_requests()
        except Exception as exc:
            raise _Fatal(f"has_unfinished_requests() failed: {_one_line(exc)}") from exc

    def _make_stats(self, with_block_map: bool) -> SchedulerStats | None:
        try:
            stats = self.core.make_stats()
            if with_block_map:
                stats.kv_block_states = bytes(self.core.kv_block_states())
            return stats
        except Exception:
            # Stats are best effort: losing one message must not kill serving.
            logger.exception("EngineCore make_stats failed")
            return None

    # --- inputs ---------------------------------------------------------------------------------

    def _handle(self, msg: EngineInput | _InputClosed) -> None:
        if isinstance(msg, AddRequest):
            self._add_request(msg)
        elif isinstance(msg, Abort):
            self._send_outputs(self.core.abort_requests(msg.request_ids))
        elif isinstance(msg, Utility):
            self._outputs.put(_Targeted(msg.client_index, self._call_utility(msg)))
        elif isinstance(msg, Shutdown):
            logger.info("EngineCore shutting down")
            self._stopping = True
        else:
            # The frontend vanished: nobody is left to serve or to tell.
            logger.warning("EngineCore input closed (%s); exiting", msg.reason)
            self._stopping = True

    def _add_request(self, req: AddRequest) -> None:
        """Queue a request; one the core refuses fails alone, and the others go on.

        The frontend validated the request (izh.frontend.input_processor), so a refusal here is a
        bug upstream: the core's invariant checks raise an internal error (500) before touching
        any state. It is logged and reported to that request only; the core keeps serving."""
        try:
            self.core.add_request(req)
        except Exception as exc:
            code = exc.status_code if isinstance(exc, IzhError) else 500
            message = _one_line(exc)
            logger.error("request %s rejected by the core: %s", req.request_id, message, exc_info=code >= 500)
            failed = EngineOutput(
                request_id=req.request_id,
                new_token_ids=[],
                finish_reason="error",
                error=message,
                error_code=code,
                num_prompt_tokens=len(req.prompt_token_ids),
            )
            self._outputs.put(EngineOutputs(outputs=[failed], timestamp=time.monotonic()))

    def _call_utility(self, msg: Utility) -> UtilityResult:
        try:
            return UtilityResult(msg.call_id, result=self._utility_result(msg.method, msg.args))
        except Exception as exc:
            logger.warning("utility %s failed: %s", msg.method, _one_line(exc))
            return UtilityResult(msg.call_id, error=_one_line(exc))

    def _utility_result(self, method: str, args: list[Any]) -> Any:
        if method == "reset_prefix_cache":
            reset = self.core.reset_prefix_cache()
            self._send_outputs([], force_stats=True)  # the published block map changed
            return reset
        if method == "kv_block_states":
            return self.core.kv_block_states()
        if method == "load_lora_adapter":
            name, path = args
            return self.core.load_lora_adapter(str(name), str(path))
        if method == "unload_lora_adapter":
            (name,) = args
            return self.core.unload_lora_adapter(str(name))
        raise ValueError(
            f"unknown utility method {method!r} (ping, reset_prefix_cache, kv_block_states, "
            "load_lora_adapter, unload_lora_adapter)"
        )

    # --- I/O threads ----------------------------------------------------------------------------

    def _input_loop(self) -> None:
        """Receive and decode inputs into the queue until the context is terminated."""
        decoder = make_input_decoder()
        try:
            while True:
                frame = self._in_sock.recv(copy=False)
                try:
                    msg = decoder.decode(frame.buffer)
                except Exception as exc:  # SamplingParams' checks raise InvalidRequest while decoding
                    self._reject_undecodable(frame.buffer, exc)
                    continue
                if type(msg) is AddRequest and msg.client_index:
                    self._owners[msg.request_id] = msg.client_index
                elif type(msg) is Utility and msg.method == "ping":
                    # Answered here, not by the busy loop: a step may run for minutes.
                    answer = UtilityResult(msg.call_id, result=self.liveness())
                    self._outputs.put(_Targeted(msg.client_index, answer))
                    continue
                self._inputs.put(msg)
        except zmq.ContextTerminated:
            pass
        except zmq.ZMQError as exc:
            self._inputs.put(_InputClosed(str(exc)))
        finally:
            self._in_sock.close()

    def _reject_undecodable(self, buffer: memoryview, exc: Exception) -> None:
        """An AddRequest that fails validation (e.g. SamplingParams) fails alone, with a 400."""
        request_id, client_index = _peek_request_id(buffer)
        logger.warning("undecodable input (request %s): %s", request_id, _one_line(exc))
        if request_id is None:
            return
        if client_index:
            self._owners[request_id] = client_index
        failed = EngineOutput(
            request_id=request_id,
            new_token_ids=[],
            finish_reason="error",
            error=_one_line(exc),
            error_code=exc.status_code if isinstance(exc, IzhError) else 400,
        )
        self._outputs.put(EngineOutputs(outputs=[failed], timestamp=time.monotonic()))

    def _output_loop(self) -> None:
        """Encode and send queued messages until the None sentinel."""
        encoder = make_encoder()
        if len(self._out_socks) > 1:
            self._fanout_loop(encoder)
            return
        while True:
            msg = self._outputs.get()
            if msg is None:
                return
            if type(msg) is _Targeted:
                msg = msg.msg
            data = encoder.encode(msg)
            try:
                self._out_sock.send(data, 0, copy=len(data) < _ZERO_COPY_MIN_BYTES)
            except zmq.ZMQError as exc:
                logger.warning("EngineCore output send failed: %s", exc)
                return

    def _fanout_loop(self, encoder: msgspec.msgpack.Encoder) -> None:
        """Several frontends: each request's outputs to its own, stats, Ready and Dead to all."""
        socks = self._out_socks
        owners = self._owners
        dropped = [False] * len(socks)

        def send(index: int, msg: EngineMessage) -> None:
            data = encoder.encode(msg)
            try:
                socks[index].send(data, zmq.NOBLOCK, copy=len(data) < _ZERO_COPY_MIN_BYTES)
            except zmq.Again:  # no high-water mark: only if libzmq cannot queue at all
                if not dropped[index]:
                    dropped[index] = True
                    logger.warning("frontend %d cannot take its outputs; dropping them", index)
            except zmq.ZMQError as exc:
                logger.warning("EngineCore output send to frontend %d failed: %s", index, exc)

        while True:
            item = self._outputs.get()
            if item is None:
                return
            if type(item) is _Targeted:
                send(item.client_index, item.msg)
            elif type(item) is EngineOutputs:
                buckets: dict[int, list[EngineOutput]] = {}
                for eo in item.outputs:
                    index = owners.get(eo.request_id, 0)
                    if eo.finish_reason is not None and index:
                        del owners[eo.request_id]
                    buckets.setdefault(index, []).append(eo)
                for index in range(len(socks)):
                    outputs = buckets.get(index)
                    if outputs or item.stats is not None:
                        send(
                            index,
                            EngineOutputs(outputs=outputs or [], timestamp=item.timestamp, stats=item.stats),
                        )
            else:
                for index in range(len(socks)):
                    send(index, item)  # type: ignore[arg-type]  # Ready, Dead (UtilityResults are _Targeted)


def _peek_request_id(buffer: memoryview) -> tuple[str | None, int]:
    """An undecodable AddRequest's id and client_index, if they can be read at all."""
    try:
        raw = msgspec.msgpack.decode(buffer)
    except msgspec.DecodeError:
        return None, 0
    if not isinstance(raw, dict):
        return None, 0
    request_id, client_index = raw.get("request_id"), raw.get("client_index", 0)
    return (
        request_id if isinstance(request_id, str) else None,
        client_index if type(client_index) is int else 0,
    )
