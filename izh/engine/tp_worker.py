"""The worker side of tensor parallelism: a rank other than 0 loads its shard and runs rank 0's step plans
(izh.engine.tensor_parallel has the group, the plan and the failure handling). Entry points:
`run_node` for `izh serve --node-rank R` (R > 0) and torchrun ranks > 0, and `python -m
izh.engine.tp_worker` for the local ranks a node's first process starts (start message on stdin)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from izh.config import EngineConfig
from izh.engine.model_runner import ModelRunner, resolve_device
from izh.engine.tensor_parallel import Placement, TensorParallelRuntime, join, start
from izh.errors import ModelLoadError

logger = logging.getLogger(__name__)


def serve_worker(config: EngineConfig, runtime: TensorParallelRuntime) -> int:
    """A worker rank's life: load its shard, then run rank 0's plans until the shutdown plan (0) or until
    rank 0 is gone (1)."""
    runner = ModelRunner(config, tp_runtime=runtime)
    logger.info("tensor-parallel rank %d ready", runtime.rank)
    try:
        while True:
            try:
                plan = runtime.receive_plan()
            except RuntimeError as exc:
                logger.error("tensor-parallel rank %d: rank 0 is gone (%s); exiting", runtime.rank, exc)
                return 1
            if plan is None:
                logger.info("tensor-parallel rank %d: shutdown from rank 0", runtime.rank)
                return 0
            runner.run_plan(*plan)
    finally:
        runtime.shutdown()


def run_node(config: EngineConfig) -> int:
    """A process that does not serve (node_rank > 0, or a torchrun rank > 0): start the node's other
    ranks, join, and work until rank 0 stops."""
    runtime = start(config, resolve_device(config.device).type)
    return serve_worker(config, runtime)


def _watch_parent_pipe() -> None:
    """A rank this process's parent started exits when the parent does (its stdin pipe closes)."""
    # os.read, not sys.stdin: a daemon thread blocked in a buffered read would hold its lock at exit.
    while os.read(0, 4096):
        pass
    logger.warning("the process that started this tensor-parallel rank is gone; exiting")
    logging.shutdown()
    os._exit(1)


def main() -> int:
    """`python -m izh.engine.tp_worker`: one local rank, its start message (JSON) on stdin."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s TPWorker[%(process)d] %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; rank 0 stops us
    message = json.loads(sys.stdin.buffer.readline())
    config = EngineConfig(**message["config"])
    threading.Thread(target=_watch_parent_pipe, name="TPParentWatch", daemon=True).start()
    where = Placement(
        message["rank"],
        message["local_rank"],
        config.tensor_parallel_size,
        message["host"],
        message["port"],
        (),
        False,
    )
    try:
        runtime = join(config, resolve_device(config.device).type, where, where.port, None, [])
    except ModelLoadError as exc:
        logger.error("%s", exc.message)
        return 1
    code = serve_worker(config, runtime)
    logging.shutdown()
    os._exit(code)  # not a normal exit: the parent-watch thread is blocked reading stdin


if __name__ == "__main__":
    raise SystemExit(main())
