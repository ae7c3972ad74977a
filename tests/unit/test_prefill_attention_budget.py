"""The scheduler's prefill attention budget: while a request decodes, a long prompt's chunks shrink as its
context grows, so that the steps the decoding streams wait for stay short; alone, a prompt is not held back."""

from __future__ import annotations

import pytest

from izh.config import CPU_DPBF16_PREFILL_ATTENTION_BUDGET, default_prefill_attention_budget
from izh.engine.kv_cache import KVCacheManager
from izh.engine.scheduler import (
    PREFILL_TOKEN_PAIRS,
    Scheduler,
    prefill_attention_pairs,
    prefill_chunk_cost,
)
from tests.unit.test_scheduler import make_request, plan, step


def scheduler_with(
    budget: int, *, tokens: int = 128, max_model_len: int = 4096, token_pairs: int = 0
) -> Scheduler:
    """A scheduler under `budget`; its chunks' tokens cost `token_pairs` each besides their attention (0 in
    most tests here: the pairs alone)."""
    return Scheduler(
        kv_cache_manager=KVCacheManager(num_blocks=600, block_size=16),
        max_num_batched_tokens=tokens,
        max_num_seqs=8,
        max_model_len=max_model_len,
        prefill_attention_budget=budget,
        prefill_token_pairs=token_pairs,
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


def test_every_chunk_progresses_and_a_quarter_of_the_budget_is_each_chunks_floor() -> None:
    scheduler = scheduler_with(100, max_model_len=8192)
    scheduler.add_request(make_request("chat", 10, max_tokens=400, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("a", 600, first_token=1000, max_tokens=1, arrival_time=1.0))
    scheduler.add_request(make_request("b", 600, first_token=3000, max_tokens=1, arrival_time=2.0))
    rows = plan(step(scheduler)[0])
    # "a" takes 13 tokens (91 pairs); 9 are left, but "b" may take up to 25 (a quarter): 6 tokens, 21 pairs
    assert rows == [("chat", 1, 10, True), ("a", 13, 0, False), ("b", 6, 0, False)]
    for _ in range(200):  # run "a" and "b" past the budget: one token of either then passes it
        step(scheduler)
    rows = plan(step(scheduler)[0])
    assert min(before for _, _, before, _ in rows[1:]) > 100
    assert [(rid, n) for rid, n, _, _ in rows] == [("chat", 1), ("a", 1), ("b", 1)]  # both still move


def test_a_short_prompt_arriving_during_a_long_one_is_not_held_behind_it() -> None:
    scheduler = scheduler_with(4096, max_model_len=8000)
    scheduler.add_request(make_request("chat", 10, max_tokens=4000, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("long", 7000, first_token=1000, max_tokens=1))
    while scheduler.requests["long"].num_computed_tokens < 5000:
        step(scheduler)
    rows = plan(step(scheduler)[0])
    assert [(rid, n) for rid, n, _, _ in rows] == [("chat", 1), ("long", 1)]  # 5,001+ pairs: one token
    scheduler.add_request(make_request("short", 40, first_token=9000, max_tokens=1))
    rows = plan(step(scheduler)[0])
    # the step's budget is spent by "long", yet "short" (820 pairs, under a quarter of 4,096) goes whole
    assert [(rid, n) for rid, n, _, _ in rows] == [("chat", 1), ("long", 1), ("short", 40)]


def test_a_chunks_tokens_also_count_their_own_layers() -> None:
    """With each token's layers counted as PREFILL_TOKEN_PAIRS pairs, a chunk at a short context (mostly
    matmuls) is bounded too, and the step still takes the most that fits."""
    budget = 131_072
    assert (
        prefill_chunk_cost(100, 3, PREFILL_TOKEN_PAIRS)
        == prefill_attention_pairs(100, 3) + 3 * PREFILL_TOKEN_PAIRS
    )
    scheduler = scheduler_with(budget, token_pairs=PREFILL_TOKEN_PAIRS)
    scheduler.add_request(make_request("chat", 10, max_tokens=400, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("long", 3000, first_token=1000, max_tokens=1))
    rows = {rid: (n, before) for rid, n, before, _ in plan(step(scheduler)[0])}
    n, before = rows["long"]
    assert before == 0 and n < 127  # the token budget no longer binds first
    cost = [prefill_chunk_cost(0, t, PREFILL_TOKEN_PAIRS) for t in (n, n + 1)]
    assert cost[0] <= budget < cost[1]


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_attention_budget"):
        scheduler_with(-1)


def test_the_default_limits_cpu_steps_only() -> None:
    assert default_prefill_attention_budget("cpu") == 32768
    assert default_prefill_attention_budget("cpu", "float32") == 32768
    assert default_prefill_attention_budget("cpu", "dpbf16") == CPU_DPBF16_PREFILL_ATTENTION_BUDGET
    assert default_prefill_attention_budget("cpu", "tiles") == 196608
    assert default_prefill_attention_budget("cuda") == 0
    assert default_prefill_attention_budget("cuda", "tiles") == 0
