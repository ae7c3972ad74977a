"""The data-parallel routing policy (izh.frontend.dp_router): prefix keys, load, affinity, margin."""

from __future__ import annotations

import subprocess
import sys

import pytest

from izh.frontend import dp_router
from izh.frontend.dp_router import (
    AFFINITY_BLOCKS,
    ROUTE_AFFINITY,
    ROUTE_LOAD,
    ROUTE_REBALANCED,
    Router,
    affinity_key,
)

BLOCK = 16


def test_the_key_covers_the_first_full_blocks_and_the_salt() -> None:
    assert affinity_key(list(range(BLOCK - 1)), BLOCK, None) is None  # no full block: caches nothing
    prefix = list(range(AFFINITY_BLOCKS * BLOCK))
    key = affinity_key([*prefix, 1, 2, 3], BLOCK, None)
    assert key is not None
    assert affinity_key([*prefix, *[9] * 40], BLOCK, None) == key  # past the covered blocks: same key
    assert affinity_key([7, *prefix[1:]], BLOCK, None) != key
    assert affinity_key(prefix, BLOCK, "tenant") != key  # another salt never shares a cache
    # Stable across processes (each API process routes on its own; string hashes are per process).
    code = (
        f"from izh.frontend.dp_router import affinity_key; print(affinity_key({prefix!r}, {BLOCK}, 'tenant'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == affinity_key(prefix, BLOCK, "tenant")


def test_a_new_key_goes_home_then_sticks_within_the_margin() -> None:
    router = Router(2)
    key = 12345  # home: key % 2 == 1
    assert router.choose(key, [0, 0]).engine == 1
    assert router.choose(key, [0, 3]) == dp_router.Route(1, ROUTE_AFFINITY)
    # Margin: load <= 1.5 x least + 4.
    assert router.choose(key, [10, 19]) == dp_router.Route(1, ROUTE_AFFINITY)
    assert router.choose(key, [10, 20]) == dp_router.Route(0, ROUTE_REBALANCED)
    assert router.choose(key, [10, 20]) == dp_router.Route(0, ROUTE_AFFINITY)  # the key moved


def test_a_new_key_whose_home_is_busy_goes_to_the_least_loaded() -> None:
    router = Router(2)
    assert router.choose(12345, [0, 10]) == dp_router.Route(0, ROUTE_LOAD)
    assert router.choose(12345, [0, 0]) == dp_router.Route(0, ROUTE_AFFINITY)


def test_no_key_goes_to_the_least_loaded_and_ties_rotate() -> None:
    router = Router(3)
    assert router.choose(None, [5, 1, 3]) == dp_router.Route(1, ROUTE_LOAD)
    picks = [router.choose(None, [0, 0, 0]).engine for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_dead_cores_are_skipped() -> None:
    router = Router(2)
    key = 12345
    assert router.choose(key, [0, 0]).engine == 1
    assert router.choose(key, [0, None]) == dp_router.Route(0, ROUTE_REBALANCED)
    assert router.choose(2, [None, 7]) == dp_router.Route(1, ROUTE_LOAD)  # home 0 is dead
    with pytest.raises(ValueError, match="dead"):
        router.choose(None, [None, None])


def test_the_table_forgets_the_least_recently_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_router, "AFFINITY_TABLE_SIZE", 2)
    router = Router(2)
    for key in (1, 2, 3):
        router.choose(key, [0, 0])
    assert router.choose(1, [0, 0]).kind == ROUTE_LOAD  # forgotten: new again
    assert router.choose(3, [0, 0]).kind == ROUTE_AFFINITY
