"""The API process's end of cores that `izh serve` started: one attached core, or data parallel.

`start_attached_llm` builds an AsyncLLM over cores the server's supervisor (izh_cli/serve_multi.py)
started: with one core, an attached EngineCoreClient; with several, a DataParallelClient, which
looks like one EngineCoreClient to AsyncLLM (send, call_utility, stats, is_dead, shutdown) and routes
each AddRequest to a core by load and prefix affinity (izh.frontend.dp_router), each Abort to the
core that runs the request. A core that dies fails only its own requests (an error output with
code 503, as if the core had sent it); the others keep serving, and the client is dead only when
every core is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from izh.config import EngineConfig
from izh.engine_messages import (
    Abort,
    AddRequest,
    EngineInput,
    EngineOutput,
    EngineOutputs,
    Ready,
    SchedulerStats,
)
from izh.errors import EngineDead
from izh.frontend.async_llm import AsyncLLM, ForwardToLLM, load_tokenizer_beside
from izh.frontend.client import AttachedCore, EngineCoreClient, engine_state
from izh.frontend.dp_router import Router, affinity_keys
from izh.frontend.stats import StatLogger

logger = logging.getLogger(__name__)

_SUMMED_STATS = (
    "num_running",
    "num_waiting",
    "num_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_steps",
    "num_prompt_tokens",
    "num_generation_tokens",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


class DataParallelClient:
    """Several attached cores behind EngineCoreClient's interface, with the routing."""

    def __init__(
        self,
        clients: list[EngineCoreClient],
        *,
        on_outputs: Callable[[EngineOutputs], None],
        on_dead: Callable[[str], None],
    ) -> None:
        self.clients = clients
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self.router = Router(len(clients))
        self._owner: dict[str, int] = {}
        """request id -> the core running it."""
        self._in_flight = [0] * len(clients)
        self._sent_since_stats = [0] * len(clients)
        self._dead: dict[int, str] = {}
        self.route_observers: list[StatLogger] = []
        """Stat loggers; those with an `on_route(engine, kind)` method hear of every routing."""
        ready = clients[0].ready
        assert ready is not None
        self.ready: Ready | None = ready
        self._block_size = ready.block_size

    # --- callbacks from the per-core clients ----------------------------------------------------

    def core_outputs(self, index: int, msg: EngineOutputs) -> None:
        """One core's outputs: mark its stats, forget finished requests, pass on."""
        if msg.stats is not None:
            msg.stats.engine_index = index
            self._sent_since_stats[index] = 0
        owner = self._owner
        for eo in msg.outputs:
            if eo.finish_reason is not None and owner.pop(eo.request_id, None) is not None:
                self._in_flight[index] -= 1
        self._on_outputs(msg)

    def core_dead(self, index: int, reason: str) -> None:
        """One core died: its requests fail (503), the others go on; dead when every core is."""
        if index in self._dead:
            return
        self._dead[index] = reason
        lost = [rid for rid, k in self._owner.items() if k == index]
        for rid in lost:
            del self._owner[rid]
        self._in_flight[index] = 0
        alive = len(self.clients) - len(self._dead)
        logger.error(
            "engine core %d is dead (%s): failing its %d requests; %d of %d cores left",
            index,
            reason,
            len(lost),
            alive,
            len(self.clients),
        )
        if lost:
            message = f"engine core {index} died while running this request: {reason}"
            failed = [
                EngineOutput(
                    request_id=rid, new_token_ids=[], finish_reason="error", error=message, error_code=503
                )
                for rid in lost
            ]
            self._on_outputs(EngineOutputs(outputs=failed, timestamp=time.monotonic()))
        if alive == 0:
            self._on_dead(self.dead_reason or reason)

    # --- state (EngineCoreClient's) -------------------------------------------------------------

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    @property
    def dead_engines(self) -> dict[int, str]:
        """Dead cores' indexes and reasons."""
        return dict(self._dead)

    @property
    def is_dead(self) -> bool:
        return len(self._dead) == len(self.clients)

    @property
    def dead_reason(self) -> str | None:
        if not self.is_dead:
            return None
        return "; ".join(f"core {k}: {reason}" for k, reason in sorted(self._dead.items()))

    def _live(self) -> list[EngineCoreClient]:
        return [c for k, c in enumerate(self.clients) if k not in self._dead]

    @property
    def is_responsive(self) -> bool:
        return all(c.is_responsive for c in self._live())

    @property
    def seconds_since_alive(self) -> float:
        return max((c.seconds_since_alive for c in self._live()), default=0.0)

    @property
    def core_pid(self) -> int | None:
        return self.clients[0].core_pid

    def latest_stats(self) -> tuple[SchedulerStats | None, float | None]:
        """The live cores' stats summed (KV usage: the mean over cores), the oldest age."""
        snapshots = [c.latest_stats() for c in self._live()]
        known = [(s, age) for s, age in snapshots if s is not None and age is not None]
        if not known:
            return None, None
        total = SchedulerStats()
        for stats, _ in known:
            for name in _SUMMED_STATS:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
        total.kv_cache_usage = sum(s.kv_cache_usage for s, _ in known) / len(known)
        # Every core loads the same adapters: their running and waiting sets are unions.
        total.running_lora_adapters = sorted({n for s, _ in known for n in s.running_lora_adapters})
        total.waiting_lora_adapters = sorted({n for s, _ in known for n in s.waiting_lora_adapters})
        total.max_loras = known[0][0].max_loras
        return total, max(age for _, age in known)

    def latest_block_map(self) -> tuple[list[int], float | None]:
        """Every live core's block map, one after the other (core 0's blocks first)."""
        blocks: list[int] = []
        ages: list[float] = []
        for client in self._live():
            states, age = client.latest_block_map()
            blocks.extend(states)
            if age is not None:
                ages.append(age)
        return blocks, (max(ages) if ages else None)

    def engine_states(self) -> list[dict[str, Any]]:
        """Per core: index, pid, alive, dead reason, this frontend's requests on it, its stats."""
        result = []
        for k, client in enumerate(self.clients):
            entry = engine_state(client, k, self._dead.get(k))
            entry["num_requests_in_flight"] = self._in_flight[k]
            result.append(entry)
        return result

    # --- talking to the cores -------------------------------------------------------------------

    def loads(self) -> list[int | None]:
        """Per core: published running + waiting, plus what this frontend sent since; None if dead."""
        loads: list[int | None] = []
        for k, client in enumerate(self.clients):
            if k in self._dead or client.is_dead:
                loads.append(None)
                continue
            stats, _ = client.latest_stats()
            published = stats.num_running + stats.num_waiting if stats is not None else 0
            loads.append(published + self._sent_since_stats[k])
        return loads

    def send(self, msg: EngineInput) -> None:
        if type(msg) is AddRequest:
            self._add(msg)
        elif type(msg) is Abort:
            by_core: dict[int, list[str]] = {}
            for rid in msg.request_ids:
                k = self._owner.pop(rid, None)
                if k is not None:
                    self._in_flight[k] -= 1
                    by_core.setdefault(k, []).append(rid)
            for k, ids in by_core.items():
                if k not in self._dead:
                    self.clients[k].send(Abort(ids))
        else:
            for client in self._live():
                client.send(msg)

    def _add(self, msg: AddRequest) -> None:
        if self.is_dead:
            raise EngineDead(f"the engine core is dead: {self.dead_reason}")
        keys = affinity_keys(msg.prompt_token_ids, self._block_size, msg.cache_salt)
        try:
            route = self.router.choose(keys, self.loads())
        except ValueError:
            raise EngineDead("every engine core is dead") from None
        k = route.engine
        self.clients[k].send(msg)
        self._owner[msg.request_id] = k
        self._in_flight[k] += 1
        self._sent_since_stats[k] += 1
        for observer in self.route_observers:
            on_route = getattr(observer, "on_route", None)
            if on_route is not None:
                on_route(k, route.kind)

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = 30.0) -> Any:
        """Call every live core: reset_prefix_cache is True when all reset; kv_block_states the maps
        one after the other; other methods a list of the answers."""
        answers = await asyncio.gather(
            *(c.call_utility(method, *args, timeout_s=timeout_s) for c in self._live())
        )
        if method == "reset_prefix_cache":
            return all(answers)
        if method == "kv_block_states":
            return [state for answer in answers for state in answer]
        return answers

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients))


async def start_attached_llm(
    config: EngineConfig,
    cores: Sequence[AttachedCore],
    *,
    max_requests_in_flight: int,
    max_waiting_requests: int,
    request_timeout_s: float | None,
    max_buffered_outputs: int,
    heartbeat_timeout_s: float,
    step_timeout_s: float | None = None,
    ready_timeout_s: float = 600.0,
) -> AsyncLLM:
    """An AsyncLLM over running cores (one per entry of `cores`, each with this frontend's place at
    it); loads the tokenizer while they load the model. Raises ModelLoadError / EngineDead as
    AsyncLLM.start does."""
    forward = ForwardToLLM()
    dp: DataParallelClient | None = None

    def core_callbacks(k: int) -> dict[str, Any]:
        if len(cores) == 1:
            return {"on_outputs": forward.on_outputs, "on_dead": forward.on_dead}

        def outputs(msg: EngineOutputs) -> None:
            if dp is not None:
                dp.core_outputs(k, msg)

        def dead(reason: str) -> None:
            if dp is not None:
                dp.core_dead(k, reason)

        return {"on_outputs": outputs, "on_dead": dead}

    options: dict[str, Any] = {
        "ready_timeout_s": ready_timeout_s,
        "heartbeat_interval_s": min(5.0, heartbeat_timeout_s / 3),
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "step_timeout_s": step_timeout_s,
    }
    starts = [
        asyncio.ensure_future(EngineCoreClient.start(config, attach=core, **core_callbacks(k), **options))
        for k, core in enumerate(cores)
    ]
    all_started = asyncio.ensure_future(_all_started(starts))
    tokenizer = await load_tokenizer_beside(config.model, all_started)  # type: ignore[arg-type]
    clients = (await all_started).clients
    client: EngineCoreClient | DataParallelClient = clients[0]
    if len(clients) > 1:
        dp = DataParallelClient(clients, on_outputs=forward.on_outputs, on_dead=forward.on_dead)
        client = dp
    llm = forward.llm = AsyncLLM(
        config,
        tokenizer,
        max_requests_in_flight=max_requests_in_flight,
        max_waiting_requests=max_waiting_requests,
        request_timeout_s=request_timeout_s,
        max_buffered_outputs=max_buffered_outputs,
        stat_loggers=(),
    )
    llm.bind_client(client)  # type: ignore[arg-type]
    if dp is not None:
        dp.route_observers = llm.stat_loggers.loggers
        for k, c in enumerate(clients):
            if c.is_dead:
                dp.core_dead(k, c.dead_reason or "unknown")
    elif client.is_dead:
        llm._on_dead(client.dead_reason or "unknown")
    return llm


class _Started:
    """All the per-core clients, shut down together when one fails to start."""

    def __init__(self, clients: list[EngineCoreClient]) -> None:
        self.clients = clients

    async def shutdown(self, timeout_s: float = 1.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients))


async def _all_started(starts: Sequence[asyncio.Future[EngineCoreClient]]) -> _Started:
    """Every core's client once all are ready; if one fails, the others are closed and it raises."""
    await asyncio.wait(starts)
    errors = [f.exception() for f in starts if f.exception() is not None]
    if errors:
        for f in starts:
            if f.exception() is None:
                await f.result().shutdown(timeout_s=1.0)
        raise errors[0]  # type: ignore[misc]
    return _Started([f.result() for f in starts])
