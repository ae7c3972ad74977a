"""run_engine_core + EngineCoreClient with the FakeEngineCore, in process and thread mode.

Every wait is on an event the code under test sets (an output, a death report), bounded by a
timeout so that a bug fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from izh.config import EngineConfig
from izh.engine_messages import Abort, AddRequest, EngineOutput, EngineOutputs
from izh.errors import EngineDead, IzhError, ModelLoadError
from izh.frontend.client import EngineCoreClient
from izh.sampling_params import SamplingParams
from tests.engine.fake_core import (
    ASSERT_TOKEN,
    BAD_TOKEN,
    CRASH_TOKEN,
    FOREVER_TOKEN,
    GATE_TOKEN,
    HANG_TOKEN,
    FakeEngineCore,
    write_options,
)

FAKE = "tests.engine.fake_core:FakeEngineCore"
ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run(coro: Awaitable[T], timeout_s: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


class Recorder:
    """Collects what the client dispatches; tests await conditions on it."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[EngineOutput]] = {}
        self.stats: list[Any] = []
        self.dead: list[str] = []
        self._changed = asyncio.Event()

    def on_outputs(self, msg: EngineOutputs) -> None:
        for eo in msg.outputs:
            self.outputs.setdefault(eo.request_id, []).append(eo)
        if msg.stats is not None:
            self.stats.append(msg.stats)
        self._changed.set()

    def on_dead(self, reason: str) -> None:
        self.dead.append(reason)
        self._changed.set()

    async def until(self, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
        async def wait() -> None:
            while not condition():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), timeout_s)

    def finished(self, request_id: str) -> EngineOutput | None:
        outputs = self.outputs.get(request_id, [])
        return outputs[-1] if outputs and outputs[-1].finish_reason is not None else None

    def tokens(self, request_id: str) -> list[int]:
        return [t for eo in self.outputs.get(request_id, []) for t in eo.new_token_ids]


def model_dir(tmp_path: Path, **options: object) -> str:
    write_options(tmp_path, **options)
    return str(tmp_path)


async def start(
    tmp_path: Path, mode: str, recorder: Recorder, *, factory: str = FAKE, **options: Any
) -> EngineCoreClient:
    watch = ("heartbeat_interval_s", "heartbeat_timeout_s", "step_timeout_s")
    heartbeat = {k: options.pop(k) for k in watch if k in options}
    config = EngineConfig(model=model_dir(tmp_path, **options))
    return await EngineCoreClient.start(
        config,
        on_outputs=recorder.on_outputs,
        on_dead=recorder.on_dead,
        core_mode=mode,
        core_factory=factory,
        ready_timeout_s=60.0,
        **heartbeat,
    )


def add(request_id: str, prompt: list[int], **params: Any) -> AddRequest:
    return AddRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        arrival_time=time.time(),
    )


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


modes = pytest.mark.parametrize("mode", ["process", "thread"])


@modes
def test_ready_outputs_and_utilities(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, mode, recorder, max_model_len=128)
        try:
            assert client.ready is not None
            assert (client.ready.max_model_len, client.ready.vocab_size) == (128, 1000)
            client.send(add("a", [5, 6, 7]))
            client.send(add("b", [8, 9], max_tokens=1))
            await recorder.until(lambda: bool(recorder.finished("a") and recorder.finished("b")))
            assert recorder.tokens("a") == [5, 6, 7] and recorder.tokens("b") == [8]
            assert recorder.finished("a").finish_reason == "length"  # type: ignore[union-attr]
            first = recorder.outputs["a"][0]
            assert first.num_prompt_tokens == 3 and first.queued_ts > 0
            liveness = await client.call_utility("ping")  # answered between steps: none under way
            assert liveness["step_running_s"] is None and liveness["num_steps"] >= 3
            stats, age_s = client.latest_stats()  # published with the last outputs: the core is idle
            assert stats is not None and age_s is not None and age_s >= 0
            assert stats.num_running == 0 and stats.num_generation_tokens == 4
            assert await client.call_utility("reset_prefix_cache") is True
            assert await client.call_utility("kv_block_states") == [0] * 64
            with pytest.raises(IzhError, match="unknown utility method"):
                await client.call_utility("no_such_method")
            # Going idle always attaches the scheduler stats.
            assert recorder.stats and recorder.stats[-1].num_running == 0
        finally:
            await client.shutdown()
        assert not client.is_dead and recorder.dead == []

    run(body())


@modes
def test_the_core_publishes_its_stats_busy_and_idle(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, mode, recorder, step_delay_s=0.005)
        try:
            # A snapshot from the start, before any request: the frontend never has to ask.
            await recorder.until(lambda: client.latest_stats()[0] is not None)
            assert client.latest_block_map()[0] == [0] * 64
            client.send(add("forever", [FOREVER_TOKEN, 1], max_tokens=None))
            # The fake holds one "block" per running request: the published map shows it in use.
            await recorder.until(lambda: client.latest_block_map()[0][:1] == [1])
            stats, _ = client.latest_stats()
            assert stats is not None and stats.num_running == 1 and stats.num_blocks == 64
            client.send(Abort(["forever"]))
            await recorder.until(lambda: recorder.finished("forever") is not None)
            # Going idle publishes at once, block map included.
            stats, _ = client.latest_stats()
            assert stats is not None and stats.num_running == 0
            assert stats.kv_block_states == bytes(64) and client.latest_block_map()[0] == [0] * 64
            # An idle core keeps publishing, unasked (every IDLE_STATS_INTERVAL_S).
            seen = len(recorder.stats)
            await recorder.until(lambda: len(recorder.stats) > seen)
            assert recorder.stats[-1].num_running == 0 and recorder.stats[-1].kv_block_states == bytes(64)
        finally:
            await client.shutdown()

    run(body())


@modes
def test_abort_frees_the_request(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, mode, recorder, step_delay_s=0.005)
        try:
            client.send(add("forever", [FOREVER_TOKEN, 1], max_tokens=None))
            await recorder.until(lambda: len(recorder.tokens("forever")) >= 3)
            assert await client.call_utility("kv_block_states") != [0] * 64
            client.send(Abort(["forever", "unknown"]))
            await recorder.until(lambda: recorder.finished("forever") is not None)
            assert recorder.finished("forever").finish_reason == "abort"  # type: ignore[union-attr]
            assert await client.call_utility("kv_block_states") == [0] * 64
        finally:
            await client.shutdown()

    run(body())


@modes
def test_a_bad_request_fails_alone(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, mode, recorder)
        try:
            client.send(add("good", [1, 2, 3, 4]))
            client.send(add("bad", [1, BAD_TOKEN]))
            client.send(add("assert", [1, ASSERT_TOKEN]))
            invalid = add("invalid", [1, 2])
            invalid.sampling_params.temperature = -1.0  # rejected when the core decodes it
            client.send(invalid)
            names = ("good", "bad", "assert", "invalid")
            await recorder.until(lambda: all(recorder.finished(r) for r in names))
            # The frontend validates requests: one the core refuses is a bug, an internal error.
            bad = recorder.finished("bad")
            assert bad is not None and bad.finish_reason == "error" and bad.error_code == 500
            assert bad.error is not None and "forbidden token" in bad.error
            failed = recorder.finished("assert")
            assert failed is not None and failed.finish_reason == "error" and failed.error_code == 500
            assert failed.error is not None and "ASSERT_TOKEN" in failed.error
            rejected = recorder.finished("invalid")
            assert rejected is not None and rejected.finish_reason == "error" and rejected.error_code == 400
            assert rejected.error is not None and "temperature" in rejected.error
            assert recorder.tokens("good") == [1, 2, 3, 4]
            assert not client.is_dead
        finally:
            await client.shutdown()

    run(body())


@modes
def test_step_exception_sends_dead_and_fails_calls(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, mode, recorder)
        try:
            client.send(add("crash", [1, CRASH_TOKEN]))
            await recorder.until(lambda: bool(recorder.dead))
            assert client.is_dead
            assert recorder.dead == [client.dead_reason]
            assert "step() failed" in recorder.dead[0] and "fake CUDA error" in recorder.dead[0]
            with pytest.raises(EngineDead):
                client.send(add("after", [1]))
            with pytest.raises(EngineDead):
                await client.call_utility("ping")
            exit_code = await client._core_exited
            assert exit_code == 1
        finally:
            await client.shutdown()

    run(body())


def test_sigkill_is_detected_by_the_sentinel(tmp_path: Path) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, "process", recorder)
        try:
            assert client.core_pid is not None
            os.kill(client.core_pid, signal.SIGKILL)
            await recorder.until(lambda: bool(recorder.dead))
            assert client.is_dead and "SIGKILL" in (client.dead_reason or "")
        finally:
            await client.shutdown()

    run(body())


def test_sigterm_ends_the_core_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, "process", recorder)
        try:
            assert client.core_pid is not None
            os.kill(client.core_pid, signal.SIGTERM)
            await recorder.until(lambda: bool(recorder.dead))
            assert "exit code 143" in (client.dead_reason or "")
        finally:
            await client.shutdown()

    run(body())


def test_sigterm_at_any_moment_of_start_up_ends_the_core(tmp_path: Path) -> None:
    """A SIGTERM that lands while the core is starting (interpreter, imports, sockets, the build,
    Ready, the loop's first steps) ends it: never a process that waits forever on a socket."""
    import zmq

    from izh.engine.core_proc import run_engine_core

    config = EngineConfig(model=model_dir(tmp_path))
    spawn = multiprocessing.get_context("spawn")
    ctx = zmq.Context()
    try:
        for i, delay_s in enumerate([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0]):
            output_addr = f"ipc://{tmp_path}/out{i}"
            pull = ctx.socket(zmq.PULL)
            pull.bind(output_addr)
            args = (config, f"ipc://{tmp_path}/in{i}", output_addr, FAKE, None)
            proc = spawn.Process(target=run_engine_core, args=args, daemon=True)
            proc.start()
            time.sleep(delay_s)
            os.kill(proc.pid, signal.SIGTERM)
            proc.join(15)
            alive = proc.is_alive()
            if alive:
                proc.kill()
                proc.join()
            pull.close(linger=0)
            assert not alive, f"the core ignored a SIGTERM sent {delay_s} s after its start"
            # 143: our handler ran; -15: the signal came before Python set it up
            assert proc.exitcode in (143, -signal.SIGTERM), proc.exitcode
    finally:
        ctx.destroy(linger=0)


def interrupted_factory(config: EngineConfig) -> Any:
    """A build that a SIGTERM interrupted in a class body: Python hands the SystemExit back wrapped."""
    try:
        raise SystemExit(143)
    except SystemExit as exc:
        raise RuntimeError("Error calling __set_name__ on 'Field' instance 'x' in 'Options'") from exc


def test_a_sigterm_wrapped_by_python_during_the_build_still_ends_the_core(tmp_path: Path) -> None:
    """The SystemExit is not swallowed as a start-up failure (a Dead, then exit code 0)."""
    from izh.engine.core_proc import _build_core

    sent: list[object] = []
    factory = f"{__name__}:interrupted_factory"
    with pytest.raises(SystemExit) as raised:
        _build_core(EngineConfig(model=model_dir(tmp_path)), factory, sent.append)
    assert raised.value.code == 143
    assert sent == []


def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_hung_core(tmp_path: Path) -> None:
    """Each step takes 1 s, the heartbeat timeout is 0.3 s: the core's input thread answers the pings
    during the steps, so the request finishes and the core lives."""

    async def body() -> None:
        recorder = Recorder()
        client = await start(
            tmp_path,
            "process",
            recorder,
            step_delay_s=1.0,
            heartbeat_interval_s=0.05,
            heartbeat_timeout_s=0.3,
        )
        try:
            client.send(add("slow", [5, 6]))
            await recorder.until(lambda: recorder.finished("slow") is not None)
            assert recorder.tokens("slow") == [5, 6]
            assert not recorder.dead and not client.is_dead and client.is_responsive
            assert await client.call_utility("ping") == {"num_steps": 2, "step_running_s": None}
        finally:
            await client.shutdown()

    run(body())


def test_a_heartbeat_during_a_step_says_how_long_it_has_run(tmp_path: Path) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, "thread", recorder)
        gate = FakeEngineCore.gates[client.config.model]
        try:
            client.send(add("held", [GATE_TOKEN, 3], max_tokens=1))
            await asyncio.to_thread(gate.entered.wait, 20)
            liveness = await client.call_utility("ping")  # the busy loop is inside the step
            assert liveness["num_steps"] == 1 and liveness["step_running_s"] >= 0
            gate.release.set()
            await recorder.until(lambda: recorder.finished("held") is not None)
            assert await client.call_utility("ping") == {"num_steps": 1, "step_running_s": None}
        finally:
            gate.release.set()
            await client.shutdown()

    run(body())


def test_hung_step_is_caught_by_the_step_timeout(tmp_path: Path) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(
            tmp_path,
            "process",
            recorder,
            heartbeat_interval_s=0.05,
            heartbeat_timeout_s=0.5,
            step_timeout_s=0.5,
        )
        try:
            client.send(add("hang", [1, HANG_TOKEN]))
            await recorder.until(lambda: bool(recorder.dead))
            assert "one engine step has run for" in (client.dead_reason or "")
            pid = client.core_pid
        finally:
            await client.shutdown(timeout_s=0.5)  # it cannot read Shutdown: terminated
        assert pid is not None
        assert_gone(pid)

    run(body())


@modes
def test_failed_startup_raises_the_reason(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        with pytest.raises(ModelLoadError, match="no weights in /nowhere"):
            await start(tmp_path, mode, Recorder(), fail_load="no weights in /nowhere")
        with pytest.raises(ModelLoadError, match="ModuleNotFoundError"):
            await start(tmp_path, mode, Recorder(), factory="tests.engine.no_such_module:Core")

    run(body())
    assert multiprocessing.active_children() == []


def test_shutdown_leaves_no_process_and_no_files(tmp_path: Path) -> None:
    async def body() -> None:
        recorder = Recorder()
        client = await start(tmp_path, "process", recorder)
        pid = client.core_pid
        ipc_dir = Path(client.input_addr.removeprefix("ipc://")).parent
        assert pid is not None and ipc_dir.is_dir()
        client.send(add("a", [1, 2]))
        await client.shutdown()
        await client.shutdown()  # idempotent
        assert_gone(pid)
        assert not ipc_dir.exists()
        assert not client.is_dead and recorder.dead == []
        with pytest.raises(EngineDead):
            client.send(add("b", [1]))

    run(body())
    assert multiprocessing.active_children() == []


def test_core_exits_when_the_frontend_is_killed(tmp_path: Path) -> None:
    """A frontend killed with SIGKILL cannot shut its core down: the core must notice and exit."""
    script = textwrap.dedent(
        f"""
        import asyncio, os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from izh.config import EngineConfig
        from izh.frontend.client import EngineCoreClient

        async def main():
            client = await EngineCoreClient.start(
                EngineConfig(model={str(tmp_path)!r}), on_outputs=print, on_dead=print,
                core_factory={FAKE!r})
            print(client.input_addr, client.core_pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
        """
    )
    write_options(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    input_addr, pid_text = proc.stdout.strip().splitlines()[-1].split()
    core_pid = int(pid_text)
    ipc_dir = Path(input_addr.removeprefix("ipc://")).parent
    try:
        pidfd = os.pidfd_open(core_pid)
    except ProcessLookupError:
        pidfd = None  # already gone
    if pidfd is not None:
        try:
            readable, _, _ = select.select([pidfd], [], [], 20.0)
            assert readable, f"EngineCore {core_pid} outlived its frontend"
        finally:
            os.close(pidfd)
            if not readable:
                os.kill(core_pid, signal.SIGKILL)
    assert not ipc_dir.exists()  # the core removed the frontend's socket dir on its way out


def test_options_file_round_trip(tmp_path: Path) -> None:
    write_options(tmp_path, step_delay_s=0.5)
    assert json.loads((tmp_path / "fake_core.json").read_text()) == {"step_delay_s": 0.5}


def test_a_burst_of_outputs_queued_before_the_frontend_reads_all_arrive_in_order(tmp_path: Path) -> None:
    """The output reader drains what is queued in batches (zmq's FD signals edges, so what a batch
    leaves must be read without a new edge): 3 batches' worth sent at once, then one more later."""
    import zmq

    from izh.engine_messages import Ready, make_encoder
    from izh.frontend.client import _DRAIN_BATCH, AttachedCore

    burst = 3 * _DRAIN_BATCH + 5
    encoder = make_encoder()
    ctx = zmq.Context()
    core_out = ctx.socket(zmq.PUSH)
    core_out.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/out.sock"

    def tokens(rec: Recorder) -> list[int]:
        return [t for eo in rec.outputs.get("r", []) for t in eo.new_token_ids]

    async def scenario() -> None:
        rec = Recorder()
        start = asyncio.ensure_future(
            EngineCoreClient.start(
                EngineConfig(model=str(tmp_path)),
                on_outputs=rec.on_outputs,
                on_dead=rec.on_dead,
                attach=AttachedCore(f"ipc://{tmp_path}/in.sock", addr, client_index=0),
            )
        )
        await asyncio.sleep(0.2)  # the client binds its output address
        core_out.connect(addr)
        ready = Ready(
            max_model_len=64,
            num_blocks=4,
            block_size=16,
            vocab_size=8,
            eos_token_ids=[],
            device="cpu",
            dtype="float32",
        )
        core_out.send(encoder.encode(ready))
        for i in range(burst):
            core_out.send(encoder.encode(EngineOutputs(outputs=[EngineOutput("r", [i])], timestamp=0.0)))
        client = await start
        try:
            await rec.until(lambda: len(tokens(rec)) >= burst)
            assert tokens(rec) == list(range(burst))
            core_out.send(encoder.encode(EngineOutputs(outputs=[EngineOutput("r", [burst])], timestamp=0.0)))
            await rec.until(lambda: len(tokens(rec)) > burst)
            assert tokens(rec) == list(range(burst + 1))
            assert not rec.dead
        finally:
            await client.shutdown()

    try:
        run(scenario())
    finally:
        core_out.close()
        ctx.term()
