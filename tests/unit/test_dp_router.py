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
    Route,
    Router,
    affinity_keys,
)

BLOCK = 16


def test_keys_chain_the_leading_full_blocks_and_the_salt() -> None:
    assert affinity_keys(list(range(BLOCK - 1)), BLOCK, None) == []  # no full block: caches nothing
    prompt = list(range(3 * BLOCK + 5))
    keys = affinity_keys(prompt, BLOCK, None)
    assert len(keys) == 3 and len(set(keys)) == 3
    # Another prompt sharing the first two blocks shares the first two keys only.
    other = affinity_keys([*prompt[: 2 * BLOCK], *[7] * BLOCK], BLOCK, None)
    assert other[:2] == keys[:2] and other[2] != keys[2]
    assert len(affinity_keys(list(range(100 * BLOCK)), BLOCK, None)) == AFFINITY_BLOCKS
    assert affinity_keys(prompt, BLOCK, "tenant")[0] != keys[0]  # another salt never shares a cache
    # Stable across processes (each API process routes on its own; str hashes differ per process).
    code = f"from izh.frontend.dp_router import affinity_keys; print(affinity_keys({prompt!r}, {BLOCK}, 't'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == affinity_keys(prompt, BLOCK, "t")


def test_a_new_prefix_goes_home_then_its_extensions_follow_within_the_margin() -> None:
    router = Router(2)
    keys = [12345, 7, 8]  # home: 12345 % 2 == 1
    assert router.choose(keys, [0, 0]) == Route(1, ROUTE_LOAD)
    # A prompt sharing the first two blocks: its deepest known key (7) says core 1.
    assert router.choose([12345, 7, 99], [0, 3]) == Route(1, ROUTE_AFFINITY)
    # Margin: load <= 1.5 x least + 4.
    assert router.choose(keys, [10, 19]) == Route(1, ROUTE_AFFINITY)
    assert router.choose(keys, [10, 20]) == Route(0, ROUTE_REBALANCED)
    assert router.choose(keys, [10, 20]) == Route(0, ROUTE_AFFINITY)  # its keys moved
    # Its third block (99) was last routed to core 1: the deepest known key wins.
    assert router.choose([12345, 7, 99], [0, 0]) == Route(1, ROUTE_AFFINITY)


def test_the_deepest_known_key_wins() -> None:
    router = Router(2)
    router.choose([10, 20], [0, 0])  # home 0
    router.choose([11, 21, 31], [0, 0])  # home 1
    table = router._table
    table[20] = 1  # as if block 2 of prefix 10 were routed to core 1 later
    assert router.choose([10, 20, 30], [0, 0]) == Route(1, ROUTE_AFFINITY)


def test_a_new_prefix_whose_home_is_busy_goes_to_the_least_loaded() -> None:
    router = Router(2)
    assert router.choose([12345], [0, 10]) == Route(0, ROUTE_LOAD)
    assert router.choose([12345], [0, 0]) == Route(0, ROUTE_AFFINITY)


def test_no_key_goes_to_the_least_loaded_and_ties_rotate() -> None:
    router = Router(3)
    assert router.choose([], [5, 1, 3]) == Route(1, ROUTE_LOAD)
    picks = [router.choose([], [0, 0, 0]).engine for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_dead_cores_are_skipped() -> None:
    router = Router(2)
    assert router.choose([12345], [0, 0]).engine == 1
    assert router.choose([12345], [0, None]) == Route(0, ROUTE_REBALANCED)
    assert router.choose([2], [None, 7]) == Route(1, ROUTE_LOAD)  # home 0 is dead
    with pytest.raises(ValueError, match="dead"):
        router.choose([], [None, None])


def test_the_table_forgets_the_least_recently_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_router, "AFFINITY_TABLE_SIZE", 2)
    router = Router(2)
    for key in (1, 2, 3):
        router.choose([key], [0, 0])
    assert router.choose([1], [0, 0]).kind == ROUTE_LOAD  # forgotten: new again
    assert router.choose([3], [0, 0]).kind == ROUTE_AFFINITY
