"""The data-parallel routing policy: which engine core gets a request (pure Python, no I/O).

Load: each core's published `num_running + num_waiting` (every API process sees every core's stats)
plus the requests this frontend sent it since those stats (they may not show in them yet).

Prefix affinity: a prompt's keys are chained hashes (blake2b, stable across processes) of its cache
salt and its first 1, 2, ... full KV blocks, up to AFFINITY_BLOCKS blocks: the same chain the cores'
prefix caches key their blocks by, coarsened. The table maps keys to the core they were last routed
to. A request goes to the core of its deepest known key (an *affinity* route: that core holds at least
that many of its blocks in its prefix cache), unless that core is dead or its load exceeds the least
loaded live core's by more than the margin (`load > AFFINITY_LOAD_FACTOR * least + AFFINITY_LOAD_SLACK`);
then it is *rebalanced* to the least loaded live core. A prompt none of whose keys is known goes to its
home core, `first key % num_engines` (so that every API process, each with its own table, sends a new
prefix to the same core), under the same margin, else to the least loaded one; a prompt shorter than a
block to the least loaded core (ties rotate). Every key of the routed prompt then points to the chosen
core. The table keeps the AFFINITY_TABLE_SIZE most recently routed keys.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

AFFINITY_BLOCKS = 8
"""Keys cover at most this many leading KV blocks of the prompt."""
AFFINITY_LOAD_FACTOR = 1.5
AFFINITY_LOAD_SLACK = 4
"""Affinity is kept while the core's load is at most FACTOR x the least loaded core's + SLACK."""
AFFINITY_TABLE_SIZE = 1 << 18

ROUTE_AFFINITY = "affinity"
"""Went to the core its deepest known prefix key was last routed to."""
ROUTE_REBALANCED = "rebalanced"
"""That core was too busy (or dead): went to the least loaded one instead."""
ROUTE_LOAD = "load"
"""No known prefix: a new one went to its home core (or, that one busy, the least loaded); a prompt
shorter than a block to the least loaded core."""
ROUTES = (ROUTE_AFFINITY, ROUTE_REBALANCED, ROUTE_LOAD)


def affinity_keys(prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
    """The prompt's chained prefix keys, one per full leading block (at most AFFINITY_BLOCKS); empty
    when it has no full block (it caches nothing)."""
    num_blocks = min(len(prompt_token_ids) // block_size, AFFINITY_BLOCKS)
    if num_blocks == 0:
        return []
    digest = hashlib.blake2b(digest_size=8)
    if cache_salt is not None:
        digest.update(cache_salt.encode())
    digest.update(b"\0")
    ids = array("q", prompt_token_ids[: num_blocks * block_size]).tobytes()
    step = block_size * 8
    keys = []
    for i in range(num_blocks):
        digest.update(ids[i * step : (i + 1) * step])
        keys.append(int.from_bytes(digest.digest(), "little"))
    return keys


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

    def choose(self, keys: Sequence[int], loads: Sequence[int | None]) -> Route:
        """The core for a request with these prefix keys; raises ValueError when every core is dead."""
        least = self._least_loaded(loads)
        if not keys:
            return Route(least, ROUTE_LOAD)
        least_load = loads[least]
        assert least_load is not None
        table = self._table
        known = next((table[key] for key in reversed(keys) if key in table), None)
        if known is not None:
            route = Route(known, ROUTE_AFFINITY)
            if not _within_margin(loads[known], least_load):
                route = Route(least, ROUTE_REBALANCED)
        else:
            home = keys[0] % self.num_engines
            route = Route(home if _within_margin(loads[home], least_load) else least, ROUTE_LOAD)
        for key in keys:
            table[key] = route.engine
            table.move_to_end(key)
        while len(table) > AFFINITY_TABLE_SIZE:
            table.popitem(last=False)
        return route

    def _least_loaded(self, loads: Sequence[int | None]) -> int:
        best: int | None = None
        best_load = 0
        n = len(loads)
        start = self._next
        for offset in range(n):
            i = (start + offset) % n
            load = loads[i]
            if load is not None and (best is None or load < best_load):
                best, best_load = i, load
        if best is None:
            raise ValueError("every engine core is dead")
        self._next = (best + 1) % n
        return best


def _within_margin(load: int | None, least_load: int) -> bool:
    return load is not None and load <= AFFINITY_LOAD_FACTOR * least_load + AFFINITY_LOAD_SLACK
