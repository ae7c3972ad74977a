"""KVCacheManager, BlockPool and FreeBlockQueue: exact block ids, ref counts, LRU eviction, hash chain."""

from __future__ import annotations

import pytest

from izh.engine.kv_cache import (
    BlockState,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    blocks_per_request,
    hash_block_tokens,
    update_block_hashes,
)
from izh.engine.request import Request
from tests.unit.engine_params import Params

BLOCK_SIZE = 4


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    return Request(
        request_id,
        prompt_token_ids,
        Params(prompt_logprobs=prompt_logprobs),  # type: ignore[arg-type]
        arrival_time=0.0,
        cache_salt=cache_salt,
        lora_name=lora_name,
    )


def schedule_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """Look the prompt up, allocate the rest and mark it computed, as the scheduler would."""
    blocks, num_hit = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit, blocks, num_hit)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return [block.block_id for block in new_blocks]


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue]


def test_free_block_queue_is_lru_with_o1_remove() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 0, 2]
    assert len(queue) == 5
    with pytest.raises(ValueError):
        queue.remove(KVCacheBlock(block_id=9))
    for _ in range(5):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_allocate_gives_exact_block_ids_and_caches_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    assert schedule_prompt(manager, request) == [0, 1, 2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)
    # Two full blocks are prefix-cache entries; the partial third is not.
    assert [b.block_hash is not None for b in manager.block_pool.blocks[:3]] == [True, True, False]
    assert len(request.block_hashes) == 2

    # Decode: 2 more tokens fill block 2 (no new block), the 13th token needs block 3.
    request.append_output_token_ids([10, 11])
    assert manager.allocate_slots(request, 2) == []
    request.num_computed_tokens = 12
    assert manager.block_pool.blocks[2].block_hash == request.block_hashes[2]
    request.append_output_token_ids(12)
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None and [b.block_id for b in new_blocks] == [3]
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    manager.check_invariants()


def test_shared_prefix_is_ref_counted_and_capped_before_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    schedule_prompt(manager, make_request("a", list(range(10))))

    b = make_request("b", [*range(8), 50, 51, 52])
    blocks, num_hit = manager.get_computed_blocks(b)
    assert ([x.block_id for x in blocks], num_hit) == ([0, 1], 8)
    new_blocks = manager.allocate_slots(b, b.num_tokens - num_hit, blocks, num_hit)
    assert new_blocks is not None and [x.block_id for x in new_blocks] == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(manager)[:4] == [2, 2, 1, 1]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10 + 11, 8)
    manager.check_invariants()

    # An 8-token prompt equal to two cached blocks only hits the first: its last token must be computed.
    c = make_request("c", list(range(8)))
    blocks, num_hit = manager.get_computed_blocks(c)
    assert ([x.block_id for x in blocks], num_hit) == ([0], 4)

    manager.free(b)
    assert ref_cnts(manager)[:4] == [1, 1, 1, 0]
    manager.check_invariants()


def test_free_evicts_tail_first_then_lru() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    assert schedule_prompt(manager, a) == [0, 1, 2]
    manager.free(a)
    # Freed tail first: block 2 (the sequence's end) is evicted before the shared-prefix blocks 1, 0.
    assert free_queue_ids(manager) == [3, 4, 5, 2, 1, 0]
    assert manager.block_states() == [BlockState.CACHED] * 3 + [BlockState.FREE] * 3
    manager.check_invariants()

    assert schedule_prompt(manager, make_request("c", [100 + i for i in range(8)])) == [3, 4]
    d = make_request("d", [200 + i for i in range(8)])
    assert schedule_prompt(manager, d) == [5, 2]
    # Reusing block 2 evicted a's entry for it (it now caches d's block); blocks 0 and 1 are still hits.
    assert a.block_hashes[2] not in manager.block_pool.cached_block_hash_to_block
    assert manager.block_pool.blocks[2].block_hash == d.block_hashes[1]
    e = make_request("e", list(range(9)))
    blocks, num_hit = manager.get_computed_blocks(e)
    assert ([x.block_id for x in blocks], num_hit) == ([0, 1], 8)
    # The only free blocks are the hits themselves: they cannot double as e's third block.
    assert free_queue_ids(manager) == [1, 0]
    assert manager.allocate_slots(e, 1, blocks, num_hit) is None
    manager.check_invariants()


def test_prefix_hit_takes_free_blocks_out_of_the_queue() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    schedule_prompt(manager, a)
    manager.free(a)
    assert free_queue_ids(manager) == [3, 4, 5, 2, 1, 0]
    e = make_request("e", list(range(9)))
    assert schedule_prompt(manager, e) == [3]
    assert manager.get_block_ids("e") == [0, 1, 3]
    assert free_queue_ids(manager) == [4, 5, 2]
    assert ref_cnts(manager) == [1, 1, 0, 1, 0, 0]


def test_uncomputed_blocks_lose_their_hash_on_free() -> None:
    # allocate_slots caches blocks before the step computes them; a request freed before the step
    # ran (preempted in the step that scheduled it) must not leave hits on garbage.
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    schedule_prompt(manager, a)
    a.num_computed_tokens = 4  # only block 0 was really computed
    manager.free(a)
    assert [b.block_hash is not None for b in manager.block_pool.blocks[:3]] == [True, False, False]
    blocks, num_hit = manager.get_computed_blocks(make_request("b", list(range(12))))
    assert ([x.block_id for x in blocks], num_hit) == ([0], 4)
    manager.check_invariants()


def test_hash_chain_and_salt_isolation() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    schedule_prompt(manager, make_request("a", list(range(9)), cache_salt="tenant-1"))

    for other in (
        make_request("b", list(range(9))),
        make_request("c", list(range(9)), cache_salt="tenant-2"),
        make_request("d", list(range(9)), cache_salt="tenant-1", lora_name="adapter"),
    ):
        assert manager.get_computed_blocks(other) == ([], 0)
    same = make_request("e", list(range(9)), cache_salt="tenant-1")
    blocks, num_hit = manager.get_computed_blocks(same)
    assert ([x.block_id for x in blocks], num_hit) == ([0, 1], 8)

    # Equal second blocks under different first blocks hash differently: the chain carries the prefix.
    x = make_request("x", [1, 2, 3, 4, 9, 9, 9, 9])
    y = make_request("y", [5, 6, 7, 8, 9, 9, 9, 9])
    update_block_hashes(x, BLOCK_SIZE)
    update_block_hashes(y, BLOCK_SIZE)
    assert x.block_hashes[1] != y.block_hashes[1]
    assert x.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4], (None, None))
    assert x.block_hashes[1] == hash_block_tokens(x.block_hashes[0], [9, 9, 9, 9], None)


def test_allocate_is_all_or_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    schedule_prompt(manager, a)
    manager.free(a)
    assert free_queue_ids(manager) == [2, 3, 1, 0]

    # b hits blocks 0 and 1 (both free) and needs 3 more: only 2 others are free, so nothing changes.
    b = make_request("b", list(range(20)))
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, 12, blocks, num_hit) is None
    assert free_queue_ids(manager) == [2, 3, 1, 0]
    assert ref_cnts(manager) == [0, 0, 0, 0]
    assert manager.get_block_ids("b") == []
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (8, 0)
    assert all(block.block_hash is not None for block in manager.block_pool.blocks[:2])
    manager.check_invariants()

    # A smaller chunk fits: the hits are touched, the new blocks come from the rest of the queue.
    new_blocks = manager.allocate_slots(b, 8, blocks, num_hit)
    assert new_blocks is not None and [x.block_id for x in new_blocks] == [2, 3]
    assert manager.get_block_ids("b") == [0, 1, 2, 3]
    assert manager.num_free_blocks == 0
    manager.check_invariants()


def test_reset_prefix_cache_refused_while_blocks_in_use() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    schedule_prompt(manager, a)
    assert manager.reset_prefix_cache() is False
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.block_states() == [BlockState.FREE] * 4
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    manager.check_invariants()


def test_prompt_logprobs_and_disabled_caching_skip_the_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    schedule_prompt(manager, make_request("a", list(range(9))))
    wants_logprobs = make_request("b", list(range(9)), prompt_logprobs=1)
    assert manager.get_computed_blocks(wants_logprobs) == ([], 0)

    disabled = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    schedule_prompt(disabled, make_request("a", list(range(9))))
    assert disabled.block_pool.cached_block_hash_to_block == {}
    assert disabled.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert disabled.prefix_cache_queries == 0


def test_stats_and_block_states() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(6)))
    schedule_prompt(manager, a)
    assert manager.block_states() == [BlockState.USED, BlockState.USED, BlockState.FREE, BlockState.FREE]
    stats = manager.make_stats()
    assert stats["num_used_blocks"] == 2 and stats["num_cached_blocks"] == 1
    assert stats["kv_cache_usage"] == pytest.approx(0.5)
    assert stats["prefix_cache_queries"] == 6


def test_check_invariants_catches_corruption() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    schedule_prompt(manager, make_request("a", list(range(6))))
    manager.block_pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match="block 0"):
        manager.check_invariants()
    manager.block_pool.blocks[0].ref_cnt = 1
    manager.block_pool.blocks[3].block_hash = b"stale"
    with pytest.raises(AssertionError, match="block 3"):
        manager.check_invariants()


def test_blocks_overlapping_an_image_carry_its_content_hash() -> None:
    from izh.engine_messages import ImageInput

    def with_image(content_hash: str) -> Request:
        # Placeholders at positions 5..10: blocks 1 and 2 (of 4 tokens) overlap the image, block 0 does not.
        request = make_request(content_hash, [1, 2, 3, 4, 5, 7, 7, 7, 7, 7, 7, 8, 9, 10])
        image = ImageInput(
            pixel_values=b"", shape=(1, 3, 8, 8), offset=5, length=6, content_hash=content_hash
        )
        request.images = [image]
        update_block_hashes(request, BLOCK_SIZE)
        return request

    plain = make_request("plain", [1, 2, 3, 4, 5, 7, 7, 7, 7, 7, 7, 8, 9, 10])
    update_block_hashes(plain, BLOCK_SIZE)
    cat, cat_again, dog = with_image("cat"), with_image("cat"), with_image("dog")
    assert cat.block_hashes == cat_again.block_hashes
    assert cat.block_hashes[0] == dog.block_hashes[0] == plain.block_hashes[0]
    assert cat.block_hashes[1] == hash_block_tokens(cat.block_hashes[0], [5, 7, 7, 7], ("cat",))
    assert cat.block_hashes[2] == hash_block_tokens(cat.block_hashes[1], [7, 7, 7, 8], ("cat",))
    assert all(c != d for c, d in zip(cat.block_hashes[1:], dog.block_hashes[1:], strict=True))
    assert all(c != p for c, p in zip(cat.block_hashes[1:], plain.block_hashes[1:], strict=True))

    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    schedule_prompt(manager, with_image("cat"))
    assert manager.get_computed_blocks(with_image("cat"))[1] == 12
    assert manager.get_computed_blocks(with_image("dog"))[1] == 4  # the block before the image only


def test_draft_slots_are_never_cached_and_trim_frees_the_unused_blocks() -> None:
    """A speculative step allocates slots for the last known token and its drafts: blocks that only the
    drafts fill are not prefix-cache entries; after verification `trim` frees the blocks past the
    request's tokens, and the blocks full of known tokens become entries only once those tokens are."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    request = make_request("r", [1, 2, 3, 4, 5, 6])
    schedule_prompt(manager, request)
    request.append_output_token_ids(7)  # 7 known tokens, 6 computed
    # Decode of token 7 plus 6 drafts: slots up to 13 tokens, 4 blocks.
    assert manager.allocate_slots(request, 1 + 6) is not None
    assert len(manager.get_block_ids("r")) == 4
    cached = manager.block_pool.cached_block_hash_to_block
    assert len(cached) == 1  # only block 0 is full of known tokens ([1, 2, 3, 4])
    # One draft accepted (token 8), then the model's own token 9: 9 known tokens, 8 computed.
    request.append_output_token_ids([8, 9])
    request.num_computed_tokens = 8
    manager.trim(request)
    assert len(manager.get_block_ids("r")) == 3  # ceil(9 / 4): the fourth held only rejected drafts
    assert len(cached) == 1
    manager.check_invariants()
    assert manager.num_free_blocks == 7
    # The next step computes token 9 and caches block 1 ([5, 6, 7, 8]), whose KV is all known tokens'.
    assert manager.allocate_slots(request, 1) == []
    assert len(cached) == 2
    manager.free(request)
    manager.check_invariants()


# --- KV cache groups: sliding-window groups free the blocks their window has left --------------------


def _decode(manager: KVCacheManager, request: Request, tokens: int) -> None:
    """Append and compute `tokens` tokens one step each, as decode steps would."""
    for t in range(tokens):
        request.append_output_token_ids(1000 + t)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_invariants()


def _live(ids: list[int]) -> int:
    return sum(1 for block_id in ids if block_id >= 0)


def test_sliding_groups_hold_their_window_while_the_full_group_grows() -> None:
    # One full group and two sliding groups of window 8 (a Gemma-3-like layout), blocks of 4 tokens.
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, group_windows=(None, 8, 8))
    request = make_request("a", list(range(10)))
    schedule_prompt(manager, request)
    assert [len(t) for t in manager.get_group_block_ids("a")] == [3, 3, 3]
    counts = []
    for _ in range(8):
        _decode(manager, request, 4)
        counts.append([_live(t) for t in manager.get_group_block_ids("a")])
    full, sliding = [c[0] for c in counts], [c[1] for c in counts]
    assert full == [-(-(14 + 4 * i) // BLOCK_SIZE) for i in range(8)]  # grows with the sequence
    assert max(sliding) <= 3 and sliding[-1] == sliding[-2] == sliding[-3]  # stops at the window
    assert all(c[1] == c[2] for c in counts)
    full_table, sliding_table, _ = manager.get_group_block_ids("a")
    assert len(sliding_table) == len(full_table) and sliding_table[0] == -1  # dropped: null entries
    assert manager.num_free_blocks == 64 - sum(counts[-1])
    # Every block a sliding group holds lies within the window of the next token to compute.
    first_needed = (request.num_computed_tokens - 8 + 1) // BLOCK_SIZE
    assert all(block_id == -1 for block_id in sliding_table[:first_needed])
    assert all(block_id >= 0 for block_id in sliding_table[first_needed:])
    manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 64


def test_a_sliding_hit_needs_the_blocks_of_its_window() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, group_windows=(None, 8))
    a = make_request("a", list(range(40)))
    schedule_prompt(manager, a)
    _decode(manager, a, 2)  # the blocks before the window of position 42 go back (cached still)
    dropped = [i for i, block_id in enumerate(manager.get_group_block_ids("a")[1]) if block_id < 0]
    assert dropped == list(range(8))

    # A longer prompt sharing a's 40 tokens hits all 10 blocks: the sliding group's last 2 blocks cover
    # the window of position 40; its earlier entries are null, none of a's freed blocks is revived.
    b = make_request("b", [*range(40), 77, 78])
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 40
    full_hit, sliding_hit = manager.group_hit_blocks(blocks, 0), manager.group_hit_blocks(blocks, 1)
    assert [x.block_id for x in full_hit] == manager.get_group_block_ids("a")[0][:10]
    assert [x.block_id for x in sliding_hit[:8]] == [-1] * 8
    assert [x.block_id for x in sliding_hit[8:]] == manager.get_group_block_ids("a")[1][8:10]
    assert manager.allocate_slots(b, 2, blocks, num_hit) is not None
    b.num_computed_tokens = b.num_tokens
    manager.check_invariants()

    # Once the sliding group's blocks 8 and 9 are gone from the cache, the hit falls back to the last
    # point whose window's blocks are still cached (a's dropped blocks 6 and 7: end 8 blocks).
    manager.free(a)
    manager.free(b)
    for group_key in [k for k, blk in manager.block_pool.cached_block_hash_to_block.items() if len(k) > 32]:
        block = manager.block_pool.cached_block_hash_to_block[group_key]
        index = a.block_hashes.index(group_key[:32])
        if index >= 8:
            manager.block_pool.evict(block)
    c = make_request("c", [*range(40), 5])
    blocks, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 32
    assert [x.block_id for x in manager.group_hit_blocks(blocks, 1)][:6] == [-1] * 6
    manager.check_invariants()


def test_a_mistral_like_single_sliding_group() -> None:
    # Every layer windowed: one group, which still frees its blocks and hits only with its window.
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, group_windows=(8,))
    a = make_request("a", list(range(12)))
    schedule_prompt(manager, a)
    _decode(manager, a, 20)
    assert _live(manager.get_block_ids("a")) <= 3
    b = make_request("b", [*a.all_token_ids, 1])
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == len(a.all_token_ids) // BLOCK_SIZE * BLOCK_SIZE
    assert [x.block_id for x in blocks][:-2] == [-1] * (len(blocks) - 2)
    assert manager.allocate_slots(b, b.num_tokens - num_hit, blocks, num_hit) is not None
    manager.check_invariants()


def test_blocks_per_request_counts_the_window_savings() -> None:
    # 1000 tokens in blocks of 16, steps of at most 64 tokens, window 512: 63 blocks per full group,
    # ceil((511 + 64) / 16) + 1 = 37 per sliding group.
    assert blocks_per_request((None,), 16, 1000, 64) == 63
    assert blocks_per_request((None, 512, 512), 16, 1000, 64) == 63 + 2 * 37
    assert blocks_per_request((512,), 16, 100, 64) == 7  # shorter than the window: every block
    manager = KVCacheManager(num_blocks=8, block_size=16, group_windows=(None, 512))
    assert manager.max_blocks_per_request(1000, 64) == 100
