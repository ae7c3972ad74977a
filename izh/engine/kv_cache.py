"""Paged KV cache bookkeeping: blocks, the LRU free queue, the prefix cache and the manager (pure Python).

A block holds the KV of `block_size` consecutive tokens of one sequence. A full block is named by a chain
hash, sha256(parent hash, its token ids, extra keys), so equal hashes mean equal prefixes and a new
request can reuse every leading block another request already computed. Freed blocks keep their hash
until the pool hands them out again, so a later request can still hit them; the free queue is LRU, and a
request frees its blocks tail first so that the ends of sequences are evicted before shared prefixes.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import msgspec

from izh.engine.request import Request

logger = logging.getLogger(__name__)


class BlockState(enum.IntEnum):
    """One block's state, as `KVCacheManager.block_states` reports it."""

    FREE = 0
    """In the free queue, no prefix-cache entry."""
    CACHED = 1
    """In the free queue but still a prefix-cache entry: reusable until evicted."""
    USED = 2
    """Held by at least one request."""


class KVCacheStats(TypedDict):
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    """Prefix-cache entries, in use or free."""
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. `prev_free`/`next_free` link it into the free queue while ref_cnt is 0."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str | None, ...] | None
) -> bytes:
    """The chain hash of one full block: sha256 over msgpack of (parent hash, token ids, extra keys)."""
    payload = msgspec.msgpack.encode((parent_hash or b"", token_ids, extra_keys))
    return hashlib.sha256(payload).digest()


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend `request.block_hashes` to cover every full block of its known tokens.

    Only blocks that became full since the last call are hashed. The extra keys (LoRA adapter, cache salt)
    go into the first block only: every later hash chains from it, so they carry the salt too. A block
    that overlaps an image's placeholders also mixes in that image's content hash (the placeholder token
    ids are the same for every image), so the same image hits and another one misses from there on.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    if len(hashes) >= num_full_blocks:
        return
    token_ids = request.all_token_ids
    images = request.images
    for index in range(len(hashes), num_full_blocks):
        parent = hashes[-1] if hashes else None
        extra_keys: tuple[str | None, ...] | None = (
            None if parent is not None else (request.lora_key, request.cache_salt)
        )
        start = index * block_size
        if images:
            end = start + block_size
            overlapping = tuple(
                image.content_hash
                for image in images
                if image.offset < end and start < image.offset + image.length
            )
            if overlapping:
                extra_keys = (*(extra_keys or ()), *overlapping)
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys))


class FreeBlockQueue:
    """Doubly-linked list of free blocks, least recently freed first: O(1) popleft, append and remove.

    The links live in the blocks themselves (no node objects), between two sentinel blocks.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix hit revives a free block)."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add a block at the most-recently-freed end."""
        last = self._tail.prev_free
        assert last is not None  # the tail sentinel always has a predecessor
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1


class BlockPool:
    """All blocks, their reference counts, the free queue and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the front of the free queue, evicting their cache entries."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def evict(self, block: KVCacheBlock) -> None:
        """Drop the block's prefix-cache entry, if it has one."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free one (a prefix hit) leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the free queue in the given order,
        so the first given is the first evicted."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], start: int, end: int
    ) -> None:
        """Make blocks[start:end] (now full) prefix-cache entries under block_hashes[start:end].

        A hash already cached by another block (two requests computed the same prefix at once) keeps
        its first block; the duplicate stays uncached and is simply freed later.
        """
        if not self.enable_caching:
            return
        for index in range(start, end):
            block = blocks[index]
            if block.block_hash is not None or block.block_id < 0:
                continue  # a prefix hit (already cached), or a sliding window's null block
            block_hash = block_hashes[index]
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cache entry. Refused (False, nothing changed) while any block is in use: after a
        weight update the running requests' KV would be stale anyway."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True


def _check(condition: bool, message: str) -> None:
    # An explicit raise, not `assert`: invariant checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)


def blocks_per_request(
    group_windows: Sequence[int | None], block_size: int, num_tokens: int, max_chunk: int
) -> int:
    """The most blocks one request of `num_tokens` tokens holds at once when at most `max_chunk` of them
    are computed in one step: a full-attention group a block per block_size tokens, a sliding group at
    most its window plus one step's tokens (the blocks wholly before the window go before each step)."""
    whole = -(-num_tokens // block_size)
    total = 0
    for window in group_windows:
        if window is None:
            total += whole
        else:
            total += min(whole, -(-(window - 1 + max_chunk) // block_size) + 1)
    return total


NULL_BLOCK = KVCacheBlock(block_id=-1)
"""Stands in a sliding-window group's block table for a block freed (or never taken) because it lies
wholly before the window: never in the pool, never read, id -1 in the table the runner builds."""


def _group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of KV cache group `group`: each group keeps its own blocks for the
    same tokens. Group 0 uses the hash itself (a one-group manager is unchanged); another group's key is
    one byte longer than any hash, so keys never collide."""
    return block_hash if group == 0 else block_hash + bytes((group,))


class KVCacheManager:
    """Gives requests block tables, shares prefix-cache hits between them, and frees their blocks.

    With several KV cache groups (`group_windows`, one entry per group: None for full attention, else the
    group's sliding window; izh.model.sliding_window.KVCacheLayout) every request has one block table per
    group, all drawn from the one pool and all as long as its token count (a sliding group's leading
    entries are NULL_BLOCK). A sliding group frees each block as soon as it lies wholly before the window
    of the next token to compute (as vLLM's SlidingWindowManager), so it holds about window / block_size
    blocks however long the sequence grows. A prefix-cache hit must hold in every group: the full groups'
    blocks from the start, a sliding group's only those the window of the first token to compute needs.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"need one window (None or >= 1) per KV cache group, got {group_windows}")
        if len(group_windows) > 255:
            raise ValueError(f"at most 255 KV cache groups, got {len(group_windows)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.full_groups = [g for g, w in enumerate(self.group_windows) if w is None]
        self.sliding_groups = [(g, w) for g, w in enumerate(self.group_windows) if w is not None]
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        """Per request, per group, its block table (NULL_BLOCK where a sliding group dropped a block)."""
        # Kept in step with req_to_blocks so the scheduler can hand out block tables without a copy.
        self.req_to_block_ids: dict[str, list[list[int]]] = {}
        # How many leading blocks of each request are already cached (or were tried): only the blocks
        # past it get hashed and cached, so a decode step does O(1) cache work.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache (cumulative)."""
        self.prefix_cache_hits = 0
        """Tokens served from the prefix cache (cumulative)."""

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached but free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """`blocks_per_request` for this manager's groups."""
        return blocks_per_request(self.group_windows, self.block_size, num_tokens, max_chunk)

    def group_hit_blocks(self, computed_blocks: list[KVCacheBlock], group: int) -> list[KVCacheBlock]:
        """Group `group`'s share of `get_computed_blocks`' list (every group hits as many blocks)."""
        share = len(computed_blocks) // self.num_groups
        return computed_blocks[group * share : (group + 1) * share]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        At most `(num_tokens - 1) // block_size` blocks: the last token is always left to compute, so
        the step that computes it can sample. The blocks come group after group, each group's hit as
        long (`group_hit_blocks`), a sliding group's with NULL_BLOCK before its window. Touches nothing;
        `allocate_slots` takes the references and counts the lookup in prefix_cache_queries /
        prefix_cache_hits once it succeeds, so a request that keeps waiting for blocks is counted once,
        not every step.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        update_block_hashes(request, self.block_size)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        cached = self.block_pool.cached_block_hash_to_block
        end = len(hashes)
        if self.full_groups:
            end = 0
            for block_hash in hashes:
                if any(_group_key(block_hash, g) not in cached for g in self.full_groups):
                    break
                end += 1
        # Each sliding group: the last end at or before `end` where the blocks its window needs are
        # cached; the groups agree once none moves it further back.
        moved = True
        while moved and end > 0:
            moved = False
            for group, window in self.sliding_groups:
                group_end = self._sliding_hit_end(hashes, group, window, end)
                if group_end < end:
                    end, moved = group_end, True
        if end == 0:
            return [], 0
        blocks: list[KVCacheBlock] = []
        for group, group_window in enumerate(self.group_windows):
            first = 0 if group_window is None else max(0, end - self._window_blocks(group_window))
            blocks.extend([NULL_BLOCK] * first)
            blocks.extend(cached[_group_key(block_hash, group)] for block_hash in hashes[first:end])
        return blocks, end * self.block_size

    def _window_blocks(self, window: int) -> int:
        """Blocks before a block boundary that the window of the token right after it can reach."""
        return -(-(window - 1) // self.block_size)

    def _sliding_hit_end(self, hashes: list[bytes], group: int, window: int, end: int) -> int:
        """The largest e <= end such that group `group` has cached the blocks before e that the window of
        position e * block_size reaches (vLLM's right-to-left scan for a run of cached blocks)."""
        cached = self.block_pool.cached_block_hash_to_block
        need = self._window_blocks(window)
        run = 0
        for index in range(end - 1, -1, -1):
            if _group_key(hashes[index], group) in cached:
                run += 1
                if run >= need:
                    return index + run
            else:
                run = 0
        return run  # blocks [0, run) are cached, and the window at run reaches no further back

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's block tables to hold its computed tokens, the prefix hit and
        `num_new_tokens` more; return the newly allocated blocks.

        First a sliding group drops the blocks wholly before the window of the next token to compute.
        All or nothing: None, and nothing else changed, when the free queue cannot supply the blocks. On
        success the prefix-hit blocks gain a reference, and every block that the scheduled tokens fill
        becomes a prefix-cache entry.
        """
        request_id = request.request_id
        computed = new_computed_blocks or []
        tables = self.req_to_blocks.get(request_id)
        if tables is not None and self.sliding_groups:
            self._drop_blocks_before_window(request_id, tables, request.num_computed_tokens)
        num_held = 0 if tables is None else len(tables[0])
        num_hit = len(computed) // self.num_groups
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = -(-num_tokens_after // self.block_size) - num_held - num_hit
        if num_new_blocks > 0:
            # Free prefix hits sit in the free queue too, but must not be handed out as new blocks.
            num_free_hits = sum(1 for block in computed if block.ref_cnt == 0 and block is not NULL_BLOCK)
            if num_new_blocks * self.num_groups > self.block_pool.num_free_blocks - num_free_hits:
                return None

        if tables is None:
            tables = self.req_to_blocks[request_id] = [[] for _ in range(self.num_groups)]
            self.req_to_block_ids[request_id] = [[] for _ in range(self.num_groups)]
            self.num_cached_blocks[request_id] = 0
        id_tables = self.req_to_block_ids[request_id]
        if computed:
            self.block_pool.touch(block for block in computed if block is not NULL_BLOCK)
            for group in range(self.num_groups):
                hits = computed[group * num_hit : (group + 1) * num_hit]
                tables[group].extend(hits)
                id_tables[group].extend([block.block_id for block in hits])
            self.num_cached_blocks[request_id] = len(tables[0])
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks * self.num_groups)
            for group in range(self.num_groups):
                mine = new_blocks[group * num_new_blocks : (group + 1) * num_new_blocks]
                tables[group].extend(mine)
                id_tables[group].extend([block.block_id for block in mine])

        if self.enable_caching:
            if new_computed_blocks is not None and not request.skips_prefix_cache:
                # The result of a lookup: count it now that it is used.
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
            num_full_blocks = min(num_tokens_after, request.num_tokens) // self.block_size
            if num_full_blocks > self.num_cached_blocks[request_id] and not request.skips_prefix_cache:
                self._cache_full_blocks(request, tables, num_full_blocks)
        return new_blocks

    def _drop_blocks_before_window(
        self, request_id: str, tables: list[list[KVCacheBlock]], num_computed_tokens: int
    ) -> None:
        """Each sliding group gives back the blocks wholly before the window of position
        num_computed_tokens (the next token to compute): oldest first into the free queue, keeping their
        prefix-cache entries; NULL_BLOCK takes their place in the table."""
        id_tables = self.req_to_block_ids[request_id]
        for group, window in self.sliding_groups:
            end = max(0, num_computed_tokens - window + 1) // self.block_size
            table = tables[group]
            start = end
            while start > 0 and table[start - 1] is not NULL_BLOCK:
                start -= 1
            if start == end:
                continue
            dropped = table[start:end]
            table[start:end] = [NULL_BLOCK] * (end - start)
            id_tables[group][start:end] = [NULL_BLOCK.block_id] * (end - start)
            self.block_pool.free_blocks(dropped)

    def _cache_full_blocks(
        self, request: Request, tables: list[list[KVCacheBlock]], num_full_blocks: int
    ) -> None:
        # Cached now, before the step runs: a request scheduled later in the same step may hit these
        # blocks, which is sound because each layer writes the whole batch's KV before attending.
        update_block_hashes(request, self.block_size)
        num_cached = self.num_cached_blocks[request.request_id]
        hashes = request.block_hashes
        if self.num_groups == 1:
            self.block_pool.cache_full_blocks(tables[0], hashes, num_cached, num_full_blocks)
        else:
            for group, table in enumerate(tables):
                keys = [_group_key(h, group) for h in hashes[num_cached:num_full_blocks]]
                self.block_pool.cache_full_blocks(table[num_cached:num_full_blocks], keys, 0, len(keys))
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so that sequence ends are evicted before prefixes
        (the groups' blocks interleaved by position)."""
        tables = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not tables or not tables[0]:
            return
        # allocate_slots caches blocks before the step computes them. A request preempted in the step
        # that scheduled it never computes them, so their entries must go: a hit would read garbage.
        first_uncomputed = request.num_computed_tokens // self.block_size
        for table in tables:
            for block in table[first_uncomputed:]:
                self.block_pool.evict(block)
        if self.num_groups == 1 and not self.sliding_groups:
            self.block_pool.free_blocks(reversed(tables[0]))
            return
        self.block_pool.free_blocks(
            table[index]
            for index in range(len(tables[0]) - 1, -1, -1)
            for table in tables
            if table[index] is not NULL_BLOCK
        )

    def trim(self, request: Request) -> None:
        """Free the blocks past those `request.num_tokens` needs: a speculative step allocated slots for
        its draft tokens, and the rejected ones' blocks hold nothing the request will keep. They were
        never prefix-cache entries (a block is cached only once known tokens fill it, and draft tokens
        are not known tokens); any entry is dropped all the same before the block goes back."""
        tables = self.req_to_blocks.get(request.request_id)
        if not tables:
            return
        keep = -(-request.num_tokens // self.block_size)
        if len(tables[0]) <= keep:
            return
        self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], keep)
        for table, ids in zip(tables, self.req_to_block_ids[request.request_id], strict=True):
            unused = table[keep:]
            del table[keep:]
            del ids[keep:]
            for block in unused:
                self.block_pool.evict(block)
            self.block_pool.free_blocks(reversed(unused))

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of every group (live lists, not copies: read them, never mutate)."""
        return self.req_to_block_ids.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table of group 0: the live list, not a copy. Read it; never mutate it."""
        tables = self.req_to_block_ids.get(request_id)
        return tables[0] if tables else []

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry; False (and nothing changed) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            logger.warning(
                "prefix cache not reset: %d blocks still in use", self.num_blocks - self.num_free_blocks
            )
            return False
        # Hashes are of token content, so the requests' hash lists stay valid; nothing else to undo.
        logger.info("prefix cache reset")
        return True

    def block_states(self) -> list[int]:
        """One BlockState per block id (O(num_blocks): for dashboards, never for the step loop)."""
        return [
            BlockState.USED
            if block.ref_cnt > 0
            else BlockState.CACHED
            if block.block_hash is not None
            else BlockState.FREE
            for block in self.block_pool.blocks
        ]

    def make_stats(self) -> KVCacheStats:
        num_cached = len(self.block_pool.cached_block_hash_to_block)
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_blocks - self.num_free_blocks,
            "num_cached_blocks": num_cached,
            "kv_cache_usage": self.usage,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (O(num_blocks); tests call it)."""
        pool = self.block_pool
        free_ids: set[int] = set()
        for block in pool.free_block_queue:
            _check(block.block_id not in free_ids, f"block {block.block_id} twice in the free queue")
            _check(block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
            free_ids.add(block.block_id)
        _check(len(free_ids) == pool.num_free_blocks, "free queue length differs from its counter")

        ref_cnts = [0] * self.num_blocks
        for request_id, tables in self.req_to_blocks.items():
            _check(len(tables) == self.num_groups, f"request {request_id}: {len(tables)} block tables")
            _check(
                len({len(t) for t in tables}) == 1, f"request {request_id}: block tables of unequal length"
            )
            all_ids = [block.block_id for table in tables for block in table if block is not NULL_BLOCK]
            _check(len(set(all_ids)) == len(all_ids), f"request {request_id} holds a block twice: {all_ids}")
            for group, table in enumerate(tables):
                ids = [block.block_id for block in table]
                _check(
                    ids == self.req_to_block_ids[request_id][group], f"request {request_id}: stale block ids"
                )
                nulls = sum(1 for block in table if block is NULL_BLOCK)
                _check(
                    nulls == 0
                    or (
                        self.group_windows[group] is not None
                        and all(block is NULL_BLOCK for block in table[:nulls])
                    ),
                    f"request {request_id}: group {group} has a null block that is not a leading one",
                )
            for block_id in all_ids:
                ref_cnts[block_id] += 1
        for block in pool.blocks:
            _check(block.ref_cnt >= 0, f"block {block.block_id} has negative ref_cnt {block.ref_cnt}")
            _check(
                block.ref_cnt == ref_cnts[block.block_id],
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {ref_cnts[block.block_id]} requests",
            )
            _check(
                (block.ref_cnt == 0) == (block.block_id in free_ids),
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block.block_id in free_ids}",
            )
            if block.block_hash is not None:
                _check(
                    pool.cached_block_hash_to_block.get(block.block_hash) is block,
                    f"block {block.block_id} has a hash the cache maps elsewhere",
                )
        num_used = sum(1 for count in ref_cnts if count > 0)
        _check(num_used + pool.num_free_blocks == self.num_blocks, "free + used != total")
        for block_hash, block in pool.cached_block_hash_to_block.items():
            _check(
                block.block_hash == block_hash,
                f"cache entry maps to block {block.block_id} with another hash",
            )
