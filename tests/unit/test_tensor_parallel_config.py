"""Where a tensor-parallel process sits (izh.engine.tensor_parallel.placement) for one host, several
hosts and torchrun, and torchrun's environment read by izh.settings."""

from __future__ import annotations

import pytest

from izh.config import EngineConfig, with_torchrun_env
from izh.engine.tensor_parallel import placement
from izh.errors import ModelLoadError
from izh.settings import SettingsError, load_settings, torchrun_env


def test_one_host_rank_0_starts_the_others_on_a_free_loopback_port() -> None:
    where = placement(EngineConfig(model="m", tensor_parallel_size=4))
    assert (where.rank, where.world_size, where.host, where.port) == (0, 4, "127.0.0.1", 0)
    assert where.spawn == ((1, 1), (2, 2), (3, 3))
    assert EngineConfig(model="m", tensor_parallel_size=4).serves


def test_two_hosts_each_take_their_half() -> None:
    base = EngineConfig(model="m", tensor_parallel_size=4, nnodes=2, dist_init_addr="10.0.0.1:29500")
    first = placement(base)
    assert (first.rank, first.spawn, first.host, first.port) == (0, ((1, 1),), "10.0.0.1", 29500)
    second_config = EngineConfig(
        model="m", tensor_parallel_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500"
    )
    second = placement(second_config)
    assert (second.rank, second.spawn) == (2, ((3, 1),))
    assert not second_config.serves


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tensor_parallel_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple of nnodes"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "--dist-init-addr"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
        ({"tensor_parallel_size": 2, "dist_init_addr": "no-port"}, "HOST:PORT"),
    ],
)
def test_impossible_layouts_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ModelLoadError, match=words):
        placement(EngineConfig(model="m", **kwargs))  # type: ignore[arg-type]


def test_torchrun_env_makes_each_process_exactly_its_rank() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    found = torchrun_env(env)
    config = with_torchrun_env(EngineConfig(model="m"), found)
    assert (config.tensor_parallel_size, config.dist_rank, config.dist_local_rank) == (2, 1, 1)
    assert config.dist_init_addr == "10.0.0.1:29500" and not config.serves
    where = placement(config)
    assert (where.rank, where.local_rank, where.spawn, where.torchrun) == (1, 1, (), True)
    assert torchrun_env({"PATH": "/bin"}) is None
    with pytest.raises(SettingsError, match="MASTER_ADDR"):
        torchrun_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE 2"):
        with_torchrun_env(EngineConfig(model="m", tensor_parallel_size=4), found)


def test_settings_carry_the_distributed_fields_to_the_engine_config() -> None:
    settings = load_settings(
        overrides={
            "engine.tensor_parallel_size": 2,
            "engine.nnodes": 2,
            "engine.node_rank": 1,
            "engine.dist_init_addr": "127.0.0.1:29500",
            "engine.dist_timeout_s": 30,
        },
        env={},
    )
    config = settings.to_engine_config("m")
    assert (config.tensor_parallel_size, config.nnodes, config.node_rank) == (2, 2, 1)
    assert (config.dist_init_addr, config.dist_timeout_s) == ("127.0.0.1:29500", 30)
    with pytest.raises(SettingsError, match="dist_init_addr"):
        load_settings(overrides={"engine.dist_init_addr": "nohost"}, env={})
