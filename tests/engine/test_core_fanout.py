"""One core, several frontends (attached EngineCoreClients), and the DataParallelClient over several
cores: run_engine_core in threads with the FakeEngineCore, real ZMQ sockets.

Every wait is on an event the code under test sets, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from izh.config import EngineConfig
from izh.engine.core_proc import run_engine_core
from izh.engine_messages import Abort, EngineOutput, EngineOutputs, Shutdown, make_encoder
from izh.errors import EngineDead
from izh.frontend.client import AttachedCore, EngineCoreClient
from izh.frontend.dp_client import DataParallelClient
from izh.frontend.dp_router import ROUTE_AFFINITY
from tests.engine.fake_core import CRASH_TOKEN, FOREVER_TOKEN, write_options
from tests.engine.test_core_proc import FAKE, Recorder, add, run


def _run_core(config: EngineConfig, input_addr: str, output_addrs: list[str]) -> None:
    with contextlib.suppress(SystemExit):  # a core that dies exits 1 (a thread just ends)
        run_engine_core(config, input_addr, output_addrs, FAKE)


class Cores:
    """`num_cores` fake cores in threads, each with `num_frontends` output addresses."""

    def __init__(self, tmp_path: Path, num_cores: int, num_frontends: int, **options: object) -> None:
        write_options(tmp_path, **options)
        self.config = EngineConfig(model=str(tmp_path))
        self.dir = tempfile.mkdtemp(prefix="izh-fanout-")
        self.inputs = [f"ipc://{self.dir}/core{k}-in" for k in range(num_cores)]
        self.outputs = [
            [f"ipc://{self.dir}/core{k}-out{a}" for a in range(num_frontends)] for k in range(num_cores)
        ]
        self.threads = [
            threading.Thread(
                target=_run_core, args=(self.config, self.inputs[k], self.outputs[k]), daemon=True
            )
            for k in range(num_cores)
        ]
        for thread in self.threads:
            thread.start()

    def attach(self, k: int, a: int) -> AttachedCore:
        return AttachedCore(self.inputs[k], self.outputs[k][a], client_index=a)

    def stop(self) -> None:
        ctx = zmq.Context()
        for addr in self.inputs:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            sock.send(make_encoder().encode(Shutdown()))
            sock.close()
        ctx.term()
        for thread in self.threads:
            thread.join(10)


MakeCores = Callable[..., Cores]


@pytest.fixture
def cores_factory(tmp_path: Path) -> Iterator[MakeCores]:
    made: list[Cores] = []

    def make(num_cores: int, num_frontends: int, **options: object) -> Cores:
        made.append(Cores(tmp_path, num_cores, num_frontends, **options))
        return made[-1]

    yield make
    for cores in made:
        cores.stop()


async def attach(cores: Cores, k: int, a: int, recorder: Recorder) -> EngineCoreClient:
    return await EngineCoreClient.start(
        cores.config,
        on_outputs=recorder.on_outputs,
        on_dead=recorder.on_dead,
        attach=cores.attach(k, a),
        ready_timeout_s=30,
    )


def test_each_frontend_gets_its_own_outputs_and_everyone_the_stats(cores_factory: MakeCores) -> None:
    cores = cores_factory(1, 2)

    async def body() -> None:
        recorders = [Recorder(), Recorder()]
        clients = [await attach(cores, 0, a, recorders[a]) for a in range(2)]
        try:
            # The same request id from both frontends: each gets back only its own request's tokens.
            clients[0].send(add("r0", [5, 6, 7]))
            clients[1].send(add("r1", [8, 9]))
            await recorders[0].until(lambda: recorders[0].finished("r0") is not None)
            await recorders[1].until(lambda: recorders[1].finished("r1") is not None)
            assert recorders[0].tokens("r0") == [5, 6, 7] and "r1" not in recorders[0].outputs
            assert recorders[1].tokens("r1") == [8, 9] and "r0" not in recorders[1].outputs
            # Utility answers go to their caller only (call ids collide across frontends).
            answers = await asyncio.gather(*(c.call_utility("ping") for c in clients))
            assert [answer["step_running_s"] for answer in answers] == [None, None]
            for recorder in recorders:  # each wakes on its own core's messages
                await recorder.until(lambda recorder=recorder: bool(recorder.stats))
            # An abort from frontend 1 ends its request there.
            clients[1].send(add("long", [FOREVER_TOKEN, 3], max_tokens=10_000))
            await recorders[1].until(lambda: bool(recorders[1].outputs.get("long")))
            clients[1].send(Abort(["long"]))
            await recorders[1].until(lambda: recorders[1].finished("long") is not None)
            assert "long" not in recorders[0].outputs
        finally:
            for client in clients:
                await client.shutdown()

    run(body())


def test_data_parallel_routes_by_load_and_affinity_and_survives_a_dead_core(
    cores_factory: MakeCores,
) -> None:
    cores = cores_factory(2, 1, step_delay_s=0.002)

    async def body() -> None:
        received: list[EngineOutputs] = []
        dead: list[str] = []
        changed = asyncio.Event()

        def on_outputs(msg: EngineOutputs) -> None:
            received.append(msg)
            changed.set()

        dp: DataParallelClient | None = None
        per_core = [Recorder(), Recorder()]

        def forward(k: int) -> tuple[Callable[[EngineOutputs], None], Callable[[str], None]]:
            def outputs(msg: EngineOutputs) -> None:
                per_core[k].on_outputs(msg)
                if dp is not None:
                    dp.core_outputs(k, msg)

            def core_dead(reason: str) -> None:
                if dp is not None:
                    dp.core_dead(k, reason)

            return outputs, core_dead

        clients = []
        for k in range(2):
            outputs, core_dead = forward(k)
            clients.append(
                await EngineCoreClient.start(
                    cores.config,
                    on_outputs=outputs,
                    on_dead=core_dead,
                    attach=cores.attach(k, 0),
                    ready_timeout_s=30,
                )
            )
        dp = DataParallelClient(clients, on_outputs=on_outputs, on_dead=dead.append)

        async def until(condition: Callable[[], bool]) -> None:
            async def wait() -> None:
                while not condition():
                    changed.clear()
                    await changed.wait()

            await asyncio.wait_for(wait(), 20)

        def finished(rid: str) -> list[EngineOutput]:
            return [eo for m in received for eo in m.outputs if eo.request_id == rid and eo.finish_reason]

        try:
            # Long-running requests without a prefix key (shorter than a block) alternate by load.
            for i in range(4):
                dp.send(add(f"long{i}", [FOREVER_TOKEN, i], max_tokens=100_000))
            assert sorted(dp.loads()) == [2, 2]  # type: ignore[type-var]
            await until(lambda: all(per_core[k].outputs for k in range(2)))
            # A prompt prefix goes back to the core it went to while that core is not much busier.
            prefix = list(range(10, 42))  # two full blocks of 16
            dp.send(add("p0", [*prefix, 1]))
            home = dp._owner["p0"]
            dp.send(add("p1", [*prefix, 2]))
            assert dp._owner["p1"] == home
            assert dp.router.choose([], [0, 0]).engine in (0, 1)
            await until(lambda: bool(finished("p0") and finished("p1")))
            # The core that dies fails its own requests (503); the other's go on.
            doomed = 1 - home
            on_doomed = sorted(rid for rid, k in dp._owner.items() if k == doomed)
            assert on_doomed
            clients[doomed].send(add("crash", [CRASH_TOKEN]))
            await until(lambda: all(finished(rid) for rid in on_doomed))
            for rid in on_doomed:
                (eo,) = finished(rid)
                assert eo.finish_reason == "error" and eo.error_code == 503
                assert f"engine core {doomed} died" in (eo.error or "")
            assert not dead and not dp.is_dead and dp.dead_engines.keys() == {doomed}
            assert [e["alive"] for e in dp.engine_states()] == [k != doomed for k in range(2)]
            # New requests go to the live core; aborts reach it.
            dp.send(add("after", [*prefix, 3]))
            assert dp._owner["after"] == home
            survivors = sorted(rid for rid, k in dp._owner.items() if rid.startswith("long"))
            dp.send(Abort(survivors))
            assert set(dp._owner) <= {"after"}
        finally:
            await dp.shutdown()

    run(body())


def test_every_core_dead_is_dead(cores_factory: MakeCores) -> None:
    cores = cores_factory(2, 1)

    async def body() -> None:
        dead: list[str] = []
        recorders = [Recorder(), Recorder()]
        dp: DataParallelClient | None = None
        clients = []
        for k in range(2):

            def core_dead(reason: str, k: int = k) -> None:
                recorders[k].on_dead(reason)
                assert dp is not None
                dp.core_dead(k, reason)

            clients.append(
                await EngineCoreClient.start(
                    cores.config,
                    on_outputs=recorders[k].on_outputs,
                    on_dead=core_dead,
                    attach=cores.attach(k, 0),
                    ready_timeout_s=30,
                )
            )
        dp = DataParallelClient(clients, on_outputs=lambda msg: None, on_dead=dead.append)
        try:
            for k in range(2):
                clients[k].send(add(f"crash{k}", [CRASH_TOKEN]))
            # Each recorder wakes on its own core's events: wait on each (the cores die in either order).
            for recorder in recorders:
                await recorder.until(lambda recorder=recorder: bool(recorder.dead))
            assert dp.is_dead and len(dead) == 1
            assert "core 0" in (dp.dead_reason or "") and "core 1" in (dp.dead_reason or "")
            with pytest.raises(EngineDead):
                dp.send(add("late", [1, 2]))
        finally:
            await dp.shutdown()

    run(body())


def test_affinity_route_kind_is_reported(cores_factory: MakeCores) -> None:
    cores = cores_factory(2, 1)

    async def body() -> None:
        clients = [
            await EngineCoreClient.start(
                cores.config, on_outputs=lambda m: None, on_dead=lambda r: None, attach=cores.attach(k, 0)
            )
            for k in range(2)
        ]
        dp = DataParallelClient(clients, on_outputs=lambda m: None, on_dead=lambda r: None)
        routes: list[tuple[int, str]] = []

        class Observer:
            def on_route(self, engine: int, kind: str) -> None:
                routes.append((engine, kind))

        dp.route_observers = [Observer()]  # type: ignore[list-item]
        try:
            prompt = list(range(100, 140))
            dp.send(add("a", prompt, max_tokens=1))
            dp.send(add("b", prompt, max_tokens=1))
            assert routes[1] == (routes[0][0], ROUTE_AFFINITY)
        finally:
            await dp.shutdown()

    run(body())
