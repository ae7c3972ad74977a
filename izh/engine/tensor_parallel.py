"""Tensor-parallel ranks at run time: joining the group, starting a node's other ranks, the step plan
rank 0 broadcasts (and the workers receive), and reporting a rank that died; the worker loop itself is
izh.engine.tp_worker.

Rank 0 runs the whole engine (scheduler, sampler, the API behind it); every rank holds its shard of the
model (izh.model.parallel) and its KV heads. Each step, rank 0's `ModelRunner` broadcasts the plan (what
the forward needs: token ids, positions, query starts, sequence lengths, slot mapping, block tables and
the rows to compute logits for; nothing about sampling), every rank runs the forward (all-reducing twice
per layer) and the LM head on its vocabulary slice, and rank 0 gathers the logits and samples. The
other ranks run `serve_worker`: receive a plan, run it, until rank 0 sends the shutdown plan.

Joining, torchrun's way: one host (no dist_init_addr) has rank 0 open a TCP store on a free loopback port
and start ranks 1..N-1 itself (`python -m izh.engine.tp_worker`, the config on stdin); several hosts have
each node's first process (`izh serve --nnodes M --node-rank R --dist-init-addr HOST:PORT`) take ranks
R*N/M.. and start its node's others the same way; under torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK, read by izh.settings) each process is exactly its rank (env://). gloo on CPU,
NCCL on CUDA (device = the local rank).

Failure: a collective waits at most `dist_timeout_s`; a rank that dies closes its sockets, so the others'
next collective fails at once. Rank 0 then raises EngineDead naming the rank (and a local rank's exit
status), which ends the engine (and `izh serve`) with that reason. While rank 0 is idle it broadcasts a
heartbeat plan every few seconds, so that idle workers never time out and a dead one is noticed (logged
at once, raised by the next step). Workers exit when rank 0 stops (the shutdown plan), when its sockets
close, or, for the ones it started, when their stdin (a pipe from it) closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from izh.config import EngineConfig
from izh.errors import EngineDead, ModelLoadError, describe_exit
from izh.model.attention import AttentionMetadata
from izh.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

PLAN_HEARTBEAT = 0
PLAN_STEP = 1
PLAN_SHUTDOWN = 2
_HEADER_LEN = 8
_MAX_HEARTBEAT_S = 5.0
_WORKER_EXIT_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this process sits: its rank, local rank (its CUDA device), the world size, how it joins and
    which ranks it starts (global rank, local rank)."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    port: int
    """0 on one host: rank 0's store picks a free port."""
    spawn: tuple[tuple[int, int], ...]
    torchrun: bool


def placement(config: EngineConfig) -> Placement:
    """This process's place from the config; ModelLoadError for an impossible layout."""
    n, nodes = config.tensor_parallel_size, config.nnodes
    if config.dist_rank is not None:
        if not 0 <= config.dist_rank < n:
            raise ModelLoadError(f"torchrun RANK {config.dist_rank} is outside WORLD_SIZE {n}")
        host, port = _split_addr(config.dist_init_addr or "127.0.0.1:29500")
        local = config.dist_local_rank or 0
        return Placement(config.dist_rank, local, n, host, port, (), torchrun=True)
    if n % nodes or not 0 <= config.node_rank < nodes:
        raise ModelLoadError(
            f"tensor_parallel_size {n} over nnodes {nodes} (node_rank {config.node_rank}): the size must be "
            "a multiple of nnodes, and node_rank below nnodes"
        )
    if nodes > 1 and config.dist_init_addr is None:
        raise ModelLoadError("nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's host and a free port)")
    per_node = n // nodes
    first = config.node_rank * per_node
    host, port = _split_addr(config.dist_init_addr) if config.dist_init_addr else ("127.0.0.1", 0)
    spawn = tuple((first + i, i) for i in range(1, per_node))
    return Placement(first, 0, n, host, port, spawn, torchrun=False)


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ModelLoadError(f"dist_init_addr must look like HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


class TensorParallelRuntime:
    """One rank's membership of the group: the collectives' `TensorParallel`, the local ranks this
    process started, and (rank 0) the plan broadcast under one lock with the heartbeat."""

    def __init__(
        self,
        tp: TensorParallel,
        local_rank: int,
        comm_device: torch.device,
        timeout_s: float,
        procs: list[tuple[int, subprocess.Popen[bytes]]],
    ) -> None:
        self.tp = tp
        self.local_rank = local_rank
        self.comm_device = comm_device
        self.timeout_s = timeout_s
        self.procs = procs
        """(global rank, process) of the ranks this process started."""
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._last_comm = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self.tp.rank

    # --- rank 0 -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the group for one step's collectives (plan, forward, logits): the heartbeat waits, and
        a failed collective becomes EngineDead naming the rank that is gone."""
        if self.failure is not None:
            raise EngineDead(self.failure)
        with self._lock:
            try:
                yield
            except RuntimeError as exc:
                if not _is_comm_error(exc):
                    raise
                self.failure = self.describe_failure(exc)
                logger.error("%s", self.failure)
                raise EngineDead(self.failure) from exc
            finally:
                self._last_comm = time.monotonic()

    def send_plan(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
    ) -> None:
        """Broadcast one step's plan (inside `step()`)."""
        num_seqs, max_blocks = meta.block_tables.shape
        header = [
            PLAN_STEP,
            input_ids.shape[0],
            num_seqs,
            max_blocks,
            logits_index.shape[0],
            meta.max_query_len,
            meta.max_seq_len,
            0,
        ]
        dev = self.comm_device
        payload = torch.cat(
            [
                input_ids.to(dev, torch.int64),
                positions.to(dev, torch.int64),
                meta.query_start_loc.to(dev, torch.int64),
                meta.seq_lens.to(dev, torch.int64),
                meta.slot_mapping.to(dev, torch.int64),
                meta.block_tables.to(dev, torch.int64).reshape(-1),
                logits_index.to(dev, torch.int64),
            ]
        )
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=dev), src=0)
        dist.broadcast(payload, src=0)

    def start_heartbeat(self) -> None:
        """Rank 0: keep idle workers' waits short of the timeout, and notice a dead rank while idle."""
        interval = min(_MAX_HEARTBEAT_S, self.timeout_s / 4)
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, args=(interval,), name="TPHeartbeat", daemon=True
        )
        self._heartbeat.start()

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop.wait(interval / 2):
            if time.monotonic() - self._last_comm < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if self._stop.is_set() or self.failure is not None:
                    return
                self._broadcast_header(PLAN_HEARTBEAT)
            except RuntimeError as exc:
                self.failure = self.describe_failure(exc)
                logger.error("%s (noticed while idle; the next step fails)", self.failure)
                return
            finally:
                self._last_comm = time.monotonic()
                self._lock.release()

    def _broadcast_header(self, kind: int) -> None:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.comm_device)
        header[0] = kind
        dist.broadcast(header, src=0)

    def describe_failure(self, exc: BaseException) -> str:
        """Which rank is gone, as precisely as this process knows: a local rank's exit status, else the
        collective's error."""
        dead = []
        for rank, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            if proc.returncode is not None:
                dead.append(f"rank {rank} (pid {proc.pid}) ended ({describe_exit(proc.returncode)})")
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if dead:
            return f"tensor-parallel worker {', '.join(dead)}; the engine cannot continue ({detail})"
        return (
            f"a tensor-parallel collective failed: a rank died, hung past dist_timeout_s "
            f"({self.timeout_s:g} s) or became unreachable ({detail})"
        )

    # --- workers ----------------------------------------------------------------------------------

    def receive_plan(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor] | None:
        """The next step's (input ids, positions, attention metadata, logits rows); None at shutdown.
        Heartbeats are consumed here."""
        dev = self.comm_device
        while True:
            header_t = torch.empty(_HEADER_LEN, dtype=torch.int64, device=dev)
            dist.broadcast(header_t, src=0)
            header = header_t.tolist()
            if header[0] == PLAN_SHUTDOWN:
                return None
            if header[0] == PLAN_STEP:
                break
        _, num_tokens, num_seqs, max_blocks, num_logits, max_query_len, max_seq_len, _ = header
        sizes = [
            num_tokens,
            num_tokens,
            num_seqs + 1,
            num_seqs,
            num_tokens,
            num_seqs * max_blocks,
            num_logits,
        ]
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=dev)
        dist.broadcast(payload, src=0)
        ids, pos, qsl, seq_lens, slots, tables, index = torch.split(payload, sizes)
        qsl_list = qsl.tolist()
        meta = AttentionMetadata(
            query_start_loc=qsl.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            slot_mapping=slots.contiguous(),
            block_tables=tables.reshape(num_seqs, max_blocks).to(torch.int32),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_lens_list=[b - a for a, b in itertools.pairwise(qsl_list)],
            seq_lens_list=seq_lens.tolist(),
        )
        return ids.contiguous(), pos.contiguous(), meta, index.contiguous()

    # --- both -------------------------------------------------------------------------------------

    def agree(self, values: list[int], what: str) -> None:
        """Check every rank has the same `values` (e.g. the model's shape); ModelLoadError otherwise."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        low, high = mine.clone(), mine.clone()
        with self._start_up_collective():
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise ModelLoadError(
                f"the tensor-parallel ranks disagree on {what}: {low.tolist()} vs {high.tolist()}"
            )

    def minimum(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.comm_device)
        with self._start_up_collective():
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @contextlib.contextmanager
    def _start_up_collective(self) -> Iterator[None]:
        """A rank that failed to load (and exited) makes the start-up's collectives fail: say so."""
        try:
            yield
        except RuntimeError as exc:
            if not _is_comm_error(exc):
                raise
            raise ModelLoadError(
                f"a tensor-parallel rank failed to start: {self.describe_failure(exc)}"
            ) from exc

    def abort(self) -> None:
        """Leave at once (a start-up that failed): kill the ranks this process started, leave the group."""
        self._closed = True
        self._stop.set()
        self.failure = self.failure or "tensor-parallel start-up failed"
        for _, proc in self.procs:
            proc.kill()
            proc.wait()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def shutdown(self) -> None:
        """Rank 0: send the shutdown plan (unless a rank is gone), wait for the ranks it started, leave
        the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.rank == 0 and self.failure is None:
            acquired = self._lock.acquire(timeout=self.timeout_s)
            try:
                self._broadcast_header(PLAN_SHUTDOWN)
            except RuntimeError as exc:
                logger.warning("could not tell the tensor-parallel workers to stop: %s", exc)
            finally:
                if acquired:
                    self._lock.release()
        for rank, proc in self.procs:
            try:
                proc.wait(timeout=_WORKER_EXIT_WAIT_S if self.failure is None else 0.5)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d (pid %d) did not exit; killing it", rank, proc.pid)
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        with contextlib.suppress(Exception):  # a broken group may not tear down cleanly
            dist.destroy_process_group()


def _is_comm_error(exc: RuntimeError) -> bool:
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        word in text for word in ("gloo", "Gloo", "NCCL", "Connection", "Timed out", "timed out")
    )


def start(config: EngineConfig, device_type: str) -> TensorParallelRuntime:
    """Join the group as this process's rank (`placement`), after starting the node's other local ranks
    as `python -m izh.engine.tp_worker` processes; returns the runtime."""
    where = placement(config)
    if dist.is_initialized():
        raise ModelLoadError("a tensor-parallel engine is already running in this process (one per process)")
    procs: list[tuple[int, subprocess.Popen[bytes]]] = []
    store = None
    timeout = timedelta(seconds=config.dist_timeout_s)
    port = where.port
    if not where.torchrun and where.rank == 0:
        try:
            store = dist.TCPStore(
                where.host,
                where.port,
                where.world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
            )
        except RuntimeError as exc:  # the port is taken, the address is not this host's
            raise ModelLoadError(
                f"tensor-parallel rank 0 cannot open its rendezvous on port {where.port}: {exc}"
            ) from exc
        port = store.port
    try:
        for rank, local_rank in where.spawn:
            procs.append((rank, _spawn_rank(config, rank, local_rank, where.host, port)))
        return join(config, device_type, where, port, store, procs)
    except BaseException:
        for _, proc in procs:
            proc.kill()
        raise


def _spawn_rank(
    config: EngineConfig, rank: int, local_rank: int, host: str, port: int
) -> subprocess.Popen[bytes]:
    """A local rank as a child process; its stdin stays open while this process lives."""
    proc = subprocess.Popen([sys.executable, "-m", "izh.engine.tp_worker"], stdin=subprocess.PIPE)
    message = {
        "config": dataclasses.asdict(config),
        "rank": rank,
        "local_rank": local_rank,
        "host": host,
        "port": port,
    }
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()
    logger.info("started tensor-parallel rank %d (pid %d)", rank, proc.pid)
    return proc


def join(
    config: EngineConfig,
    device_type: str,
    where: Placement,
    port: int,
    store: Any,
    procs: list[tuple[int, subprocess.Popen[bytes]]],
) -> TensorParallelRuntime:
    """Join the process group as `where.rank` (rank 0 passes the store it opened; the others connect to
    host:port, or env:// under torchrun); ModelLoadError when the group does not form in time."""
    timeout = timedelta(seconds=config.dist_timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(where.local_rank)
        comm_device = torch.device("cuda", where.local_rank)
    else:
        comm_device = torch.device("cpu")
    try:
        if where.torchrun:
            dist.init_process_group(
                backend, init_method="env://", rank=where.rank, world_size=where.world_size, timeout=timeout
            )
        else:
            if store is None:
                store = dist.TCPStore(where.host, port, where.world_size, is_master=False, timeout=timeout)
            dist.init_process_group(
                backend, store=store, rank=where.rank, world_size=where.world_size, timeout=timeout
            )
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"tensor-parallel rank {where.rank} of {where.world_size} could not join the group at "
            f"{where.host}:{port} within {config.dist_timeout_s:g} s: {exc}"
        ) from exc
    logger.info(
        "tensor-parallel rank %d of %d joined (%s, %s:%d)",
        where.rank,
        where.world_size,
        backend,
        where.host,
        port,
    )
    tp = TensorParallel(where.rank, where.world_size)
    return TensorParallelRuntime(tp, where.local_rank, comm_device, config.dist_timeout_s, procs)
