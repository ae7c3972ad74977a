"""The data-parallel routing policy: which engine core gets a request (pure Python, no I/O).

Each core's load is its published `num_running + num_waiting` (every API process sees every core's
stats) plus the requests this frontend sent it since those stats (they may not show in them yet).
A prompt's affinity key is a stable hash (blake2b) of its cache salt and its first full KV blocks, up
to AFFINITY_BLOCKS of them (shorter than one block: no key, it caches nothing). A request goes to the
core its key was last routed to (an *affinity hit*: that core holds the prefix in its prefix cache),
unless that core is dead or its load exceeds the least loaded live core's by more than the margin
(`load > AFFINITY_LOAD_FACTOR * least + AFFINITY_LOAD_SLACK`); then it goes to the least loaded live
core (ties rotate) and the key now points there. A key seen for the first time goes to its home core,
`key % num_engines`, under the same margin (so that every API process, each with its own table, sends
a new prefix to the same core), else to the least loaded one. A request without a key goes to the
least loaded core. The table remembers the AFFINITY_TABLE_SIZE most recently routed keys.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

AFFINITY_BLOCKS = 4
"""The affinity key covers at most this many leading KV blocks of the prompt."""
AFFINITY_LOAD_FACTOR = 1.5
AFFINITY_LOAD_SLACK = 4
"""Affinity is kept while the core's load is at most FACTOR x the least loaded core's + SLACK."""
AFFINITY_TABLE_SIZE = 65536

ROUTE_AFFINITY = "affinity"
"""Went to the core its prefix was last routed to."""
ROUTE_REBALANCED = "rebalanced"
"""Its prefix's core was too busy (or dead): went to the least loaded one instead."""
ROUTE_LOAD = "load"
"""No known prefix: a new one went to its home core (or, that one busy, the least loaded); one shorter
than a block to the least loaded core."""
ROUTES = (ROUTE_AFFINITY, ROUTE_REBALANCED, ROUTE_LOAD)


def affinity_key(prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> int | None:
    """The prompt's prefix key (its first full blocks, up to AFFINITY_BLOCKS), or None when it has
    no full block."""
    num_blocks = min(len(prompt_token_ids) // block_size, AFFINITY_BLOCKS)
    if num_blocks == 0:
        return None
    digest = hashlib.blake2b(digest_size=8)
    if cache_salt is not None:
        digest.update(cache_salt.encode())
    digest.update(b"\0")
    digest.update(array("q", prompt_token_ids[: num_blocks * block_size]).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass(slots=True)
class Route:
    engine: int
    kind: str
    """ROUTE_AFFINITY, ROUTE_REBALANCED or ROUTE_LOAD."""


class Router:
    """Chooses a core per request; `loads[i]` is core i's load, None when it is dead."""

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self._table: OrderedDict[int, int] = OrderedDict()
        self._next = 0

    def choose(self, key: int | None, loads: Sequence[int | None]) -> Route:
        """The core for a request with affinity `key`; raises ValueError when every core is dead."""
        least = self._least_loaded(loads)
        if key is None:
            return Route(least, ROUTE_LOAD)
        table = self._table
        engine = table.get(key)
        least_load = loads[least]
        assert least_load is not None
        if engine is not None and _within_margin(loads[engine], least_load):
            table.move_to_end(key)
            return Route(engine, ROUTE_AFFINITY)
        chosen = least
        if engine is None:
            home = key % self.num_engines
            if _within_margin(loads[home], least_load):
                chosen = home
        table[key] = chosen
        table.move_to_end(key)
        if len(table) > AFFINITY_TABLE_SIZE:
            table.popitem(last=False)
        return Route(chosen, ROUTE_LOAD if engine is None else ROUTE_REBALANCED)

    def _least_loaded(self, loads: Sequence[int | None]) -> int:
        best: int | None = None
        n = len(loads)
        start = self._next
        for offset in range(n):
            i = (start + offset) % n
            load = loads[i]
            if load is not None and (best is None or load < loads[best]):  # type: ignore[operator]
                best = i
        if best is None:
            raise ValueError("every engine core is dead")
        self._next = (best + 1) % n
        return best


def _within_margin(load: int | None, least_load: int) -> bool:
    return load is not None and load <= AFFINITY_LOAD_FACTOR * least_load + AFFINITY_LOAD_SLACK
