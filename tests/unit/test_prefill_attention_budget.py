"""The scheduler's prefill attention budget: while a request decodes, a long prompt's chunks shrink as its
context grows, so that the steps the decoding streams wait for stay short; alone, a prompt is not held back."""

from __future__ import annotations

import pytest

from izh.config import default_prefill_attention_budget
from izh.engine.kv_cache import KVCacheManager
from izh.engine.scheduler import Scheduler, prefill_attention_pairs
from tests.unit.test_scheduler import make_request, plan, step


def scheduler_with(budget: int, *, tokens: int = 128, max_model_len: int = 4096) -> Scheduler:
    return Scheduler(
        kv_cache_manager=KVCacheManager(num_blocks=600, block_size=16),
        max_num_batched_tokens=tokens,
        max_num_seqs=8,
        max_model_len=max_model_len,
        prefill_attention_budget=budget,
    )


def test_a_chunk_counts_every_query_against_every_position_before_it() -> None:
    # token i of a chunk from position c sees c + i + 1 positions
    assert prefill_attention_pairs(0, 1) == 1
    assert prefill_attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert prefill_attention_pairs(100, 3) == 101 + 102 + 103
    assert prefill_attention_pairs(7, 0) == 0


def test_while_a_stream_decodes_a_long_prompts_chunks_shrink_with_its_context() -> None:
    budget = 20_000
    scheduler = scheduler_with(budget)
    scheduler.add_request(make_request("chat", 10, max_tokens=400, ignore_eos=True))
    step(scheduler)  # the short prompt, alone: now it decodes
    scheduler.add_request(make_request("long", 3000, first_token=1000, max_tokens=1))
    chunks: list[tuple[int, int]] = []  # (context, tokens) of each of the long prompt's chunks
    while len(chunks) < 400:
        output, _ = step(scheduler)
        rows = {rid: (n, before) for rid, n, before, _ in plan(output)}
        assert rows["chat"][0] == 1  # the decode gets its token at every step
        if "long" not in rows:
            break
        n, before = rows["long"]
        chunks.append((before, n))
        if before + n == 3000:
            break
    assert sum(n for _, n in chunks) == 3000  # the whole prompt, in order, nothing skipped
    assert all(before == sum(n for _, n in chunks[:i]) for i, (before, _) in enumerate(chunks))
    for context, n in chunks:
        # each chunk is the most that fits: one more token would pass the budget (or the token budget)
        assert prefill_attention_pairs(context, n) <= budget or n == 1
        assert n == 127 or context + n == 3000 or prefill_attention_pairs(context, n + 1) > budget
    sizes = [n for _, n in chunks]
    assert sizes[0] == 127  # at context 0 the token budget binds first (one token goes to the decode)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 10


def test_a_prompt_alone_is_not_held_back() -> None:
    scheduler = scheduler_with(1_000)
    scheduler.add_request(make_request("long", 1000, max_tokens=1))
    sizes = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        sizes += [n for _, n, _, _ in plan(output)]
    assert sizes == [128] * 7 + [104]


def test_budget_zero_is_no_limit() -> None:
    scheduler = scheduler_with(0)
    scheduler.add_request(make_request("chat", 10, max_tokens=50, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("long", 1000, first_token=1000, max_tokens=1))
    sizes = [dict((r, n) for r, n, _, _ in plan(step(scheduler)[0]))["long"] for _ in range(3)]
    assert sizes == [127, 127, 127]


def test_the_steps_first_chunk_always_progresses_and_the_others_share_what_is_left() -> None:
    scheduler = scheduler_with(100, max_model_len=8192)
    scheduler.add_request(make_request("chat", 10, max_tokens=400, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("a", 600, first_token=1000, max_tokens=1, arrival_time=1.0))
    scheduler.add_request(make_request("b", 600, first_token=3000, max_tokens=1, arrival_time=2.0))
    rows = plan(step(scheduler)[0])
    # "a" takes 13 tokens (91 pairs); "b" from 0 gets the largest n with n (n + 1) / 2 <= 9: 3
    assert rows == [("chat", 1, 10, True), ("a", 13, 0, False), ("b", 3, 0, False)]
    for _ in range(200):  # run "a" and "b" far in: one token of "a" then passes the whole budget
        step(scheduler)
    rows = plan(step(scheduler)[0])
    contexts = {rid: before for rid, _, before, _ in rows}
    assert contexts["a"] > 100
    assert [(rid, n) for rid, n, _, _ in rows] == [("chat", 1), ("a", 1)]  # "a" still moves; "b" waits


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_attention_budget"):
        scheduler_with(-1)


def test_the_default_limits_cpu_steps_only() -> None:
    assert default_prefill_attention_budget("cpu") == 32768
    assert default_prefill_attention_budget("cuda") == 0
