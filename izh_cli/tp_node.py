"""The tensor-parallel side of `izh serve`: torchrun's environment, and a process that does not serve
(`--node-rank R` with R > 0, or a torchrun rank > 0) running its ranks as workers of node 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from izh_cli._common import stderr_console

if TYPE_CHECKING:
    from izh.config import EngineConfig


def with_rendezvous_env(config: EngineConfig) -> EngineConfig:
    """`config` with torchrun's rank, world size and MASTER_ADDR:MASTER_PORT when torchrun started this
    process; SettingsError when they contradict --tensor-parallel-size."""
    from izh.config import with_torchrun_env
    from izh.settings import SettingsError, torchrun_env

    try:
        return with_torchrun_env(config, torchrun_env())
    except ValueError as exc:
        raise SettingsError(f"engine.tensor_parallel_size: {exc}") from None


def run_worker_node(config: EngineConfig) -> int:
    """Run this process's tensor-parallel ranks until rank 0 stops; the exit code (0 after rank 0's
    shutdown, 1 when rank 0 went away)."""
    from izh.engine.tp_worker import run_node

    first = config.first_rank()
    per_node = 1 if config.dist_rank is not None else config.tensor_parallel_size // config.nnodes
    ranks = f"rank {first}" if per_node == 1 else f"ranks {first}-{first + per_node - 1}"
    stderr_console().print(
        f"[bold green]izh[/] tensor-parallel worker: {ranks} of {config.tensor_parallel_size}, "
        f"joining rank 0 at {config.dist_init_addr}",
        highlight=False,
    )
    return run_node(config)
