"""Scheduler with hand-made sampled tokens: chunked prefill, policy order, preemption, abort, stops."""

from __future__ import annotations

import pytest

from izh.engine.kv_cache import KVCacheManager
from izh.engine.request import Request, RequestStatus
from izh.engine.scheduler import Scheduler, SchedulerOutput
from tests.unit.engine_params import Params

EOS = 2


def make_request(
    request_id: str,
    num_prompt_tokens: int = 6,
    *,
    arrival_time: float = 0.0,
    priority: int = 0,
    first_token: int = 100,
    **params: object,
) -> Request:
    return Request(
        request_id,
        list(range(first_token, first_token + num_prompt_tokens)),
        Params(**params),  # type: ignore[arg-type]
        eos_token_ids=frozenset({EOS}),
        arrival_time=arrival_time,
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        kv_cache_manager=KVCacheManager(num_blocks=num_blocks, block_size=block_size),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        policy=policy,
        block_size=block_size,
    )


def plan(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, scheduled tokens, computed before, samples) per scheduled request."""
    return [
        (s.request.request_id, s.num_scheduled_tokens, s.num_computed_tokens_before, s.samples)
        for s in output.scheduled
    ]


def step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """Schedule, sample `token` for every row that samples, update; check invariants around it."""
    output = scheduler.schedule()
    scheduler.check_invariants()
    sampled = {s.request.request_id: [token] for s in output.scheduled if s.samples}
    updated = scheduler.update_from_output(output, sampled)
    scheduler.check_invariants()
    return output, updated


def test_long_prompt_is_chunked_under_one_budget_then_decodes() -> None:
    scheduler = make_scheduler(num_blocks=400, block_size=16, max_num_batched_tokens=2048, max_model_len=6000)
    request = make_request("long", 5000, max_tokens=3)
    scheduler.add_request(request)
    plans = [plan(step(scheduler)[0]) for _ in range(5)]
    assert plans == [
        [("long", 2048, 0, False)],
        [("long", 2048, 2048, False)],
        [("long", 904, 4096, True)],
        [("long", 1, 5000, True)],
        [("long", 1, 5001, True)],
    ]
    assert request.output_token_ids == [7, 7, 7]
    assert request.status == RequestStatus.FINISHED_LENGTH and request.finish_reason == "length"
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 400


def test_budget_is_shared_between_decodes_and_a_chunked_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 6, arrival_time=0.0))
    scheduler.add_request(make_request("b", 20, arrival_time=1.0, first_token=300))
    assert plan(step(scheduler)[0]) == [("a", 6, 0, True), ("b", 4, 0, False)]
    assert plan(step(scheduler)[0]) == [("a", 1, 6, True), ("b", 9, 4, False)]
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 7, True), ("b", 7, 13, True)]
    assert output.total_num_scheduled_tokens == 8
    assert output.scheduled[1].block_ids == scheduler.kv_cache_manager.get_block_ids("b")


def test_fcfs_and_priority_order() -> None:
    def admitted(policy: str) -> list[str]:
        scheduler = make_scheduler(max_num_seqs=2, policy=policy)
        scheduler.add_request(make_request("a", priority=1, arrival_time=0.0))
        scheduler.add_request(make_request("b", priority=0, arrival_time=2.0))
        scheduler.add_request(make_request("c", priority=0, arrival_time=1.0))
        return [s.request.request_id for s in scheduler.schedule().scheduled]

    assert admitted("fcfs") == ["a", "b"]
    assert admitted("priority") == ["c", "b"]
    with pytest.raises(ValueError, match="fcfs, priority"):
        make_scheduler(policy="lifo")


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", arrival_time=float(i), max_tokens=2))
    assert [s[0] for s in plan(step(scheduler)[0])] == ["r0", "r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    step(scheduler)  # r0 and r1 finish (max_tokens=2)
    assert [s[0] for s in plan(step(scheduler)[0])] == ["r2"]


def test_preemption_frees_the_latest_arrival_and_resumes_with_the_same_state() -> None:
    # 4 blocks of 4 tokens: two 6-token prompts take 2 blocks each, then decodes run out of blocks.
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    a = make_request("a", 6, arrival_time=0.0, max_tokens=4)
    b = make_request("b", 6, arrival_time=1.0, max_tokens=5, first_token=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    kv = scheduler.kv_cache_manager
    for token in (11, 12, 13):  # 9 tokens each, 8 computed: both still fit in 2 blocks
        step(scheduler, token)
    assert (kv.get_block_ids("a"), kv.get_block_ids("b")) == ([0, 1], [2, 3])

    output, _ = step(scheduler, token=14)  # a's 9th token needs a third block: b is preempted
    assert output.preempted_request_ids == ["b"]
    assert plan(output) == [("a", 1, 8, True)]
    assert a.output_token_ids == [11, 12, 13, 14] and a.status == RequestStatus.FINISHED_LENGTH
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [11, 12, 13] and kv.get_block_ids("b") == []
    # a took block 3 (b's tail, freed first), then freed [3, 1, 0] tail first; block 2 kept b's prefix.
    assert [blk.block_id for blk in kv.block_pool.free_block_queue] == [2, 3, 1, 0]

    # b resumes: its first block (200..203) is still cached; the rest (prompt + outputs) is recomputed.
    output, _ = step(scheduler, token=15)
    assert plan(output) == [("b", 5, 4, True)]
    assert kv.get_block_ids("b") == [2, 3, 1]
    assert b.num_cached_tokens == 0  # set on the first schedule only
    assert b.all_token_ids == [*range(200, 206), 11, 12, 13, 15]
    step(scheduler, token=16)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [11, 12, 13, 15, 16]
    assert scheduler.make_stats()["num_preemptions"] == 1
    assert kv.num_free_blocks == 4


def test_a_request_that_is_its_own_victim_waits() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    c = make_request("c", 6, arrival_time=0.0, max_tokens=10)
    d = make_request("d", 8, arrival_time=1.0, first_token=200, max_tokens=8)
    scheduler.add_request(c)
    scheduler.add_request(d)
    step(scheduler)  # c: 7 tokens (2 blocks), d: 9 tokens (2 blocks, 8 computed)
    output, _ = step(scheduler)  # c's 7th token fits; d needs a third block and is the latest arrival
    assert plan(output) == [("c", 1, 6, True)]
    assert output.preempted_request_ids == ["d"]
    assert d.status == RequestStatus.PREEMPTED and scheduler.num_waiting == 1
    assert scheduler.kv_cache_manager.get_block_ids("c") == [0, 1]


def test_preempting_an_already_scheduled_victim_returns_its_budget() -> None:
    # Admission order differs from arrival order: x (arrival 5) runs before y (arrival 1).
    scheduler = make_scheduler(num_blocks=5, max_model_len=20)
    x = make_request("x", 11, arrival_time=5.0, max_tokens=9)
    y = make_request("y", 8, arrival_time=1.0, first_token=200, max_tokens=12)
    scheduler.add_request(x)
    scheduler.add_request(y)
    step(scheduler)  # x: 12 tokens in [0, 1, 2], y: 9 tokens in [3, 4]
    output, _ = step(scheduler)  # x is scheduled, then y needs a block and preempts x
    assert output.preempted_request_ids == ["x"]
    assert plan(output) == [("y", 1, 8, True)]
    assert output.total_num_scheduled_tokens == 1
    assert x.num_computed_tokens == 0 and x.output_token_ids == [7]
    kv = scheduler.kv_cache_manager
    assert kv.get_block_ids("y") == [3, 4, 2]
    blocks, num_hit = kv.get_computed_blocks(x)
    assert ([blk.block_id for blk in blocks], num_hit) == ([0, 1], 8)


def test_abort_in_every_state_frees_every_block() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=8, max_model_len=24)
    running = make_request("running", 6, arrival_time=0.0)
    prefilling = make_request("prefilling", 12, arrival_time=1.0, first_token=200, max_tokens=12)
    waiting = make_request("waiting", 4, arrival_time=2.0, first_token=300)
    for request in (running, prefilling, waiting):
        scheduler.add_request(request)
    assert plan(step(scheduler)[0]) == [("running", 6, 0, True), ("prefilling", 2, 0, False)]
    aborted = scheduler.abort_requests(["prefilling", "waiting", "nope"])
    assert aborted == [prefilling, waiting]
    assert all(r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort" for r in aborted)
    output, _ = step(scheduler)
    assert output.finished_request_ids == ["prefilling", "waiting"]
    assert plan(output) == [("running", 1, 6, True)]
    assert scheduler.abort_requests(["prefilling"]) == []  # already finished: ignored

    assert scheduler.abort_requests(["running"]) == [running]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    assert scheduler.schedule().finished_request_ids == ["running"]
    scheduler.check_invariants()


def test_abort_a_preempted_request() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    scheduler.add_request(make_request("a", 6, arrival_time=0.0, max_tokens=10))
    b = make_request("b", 6, arrival_time=1.0, first_token=200, max_tokens=10)
    scheduler.add_request(b)
    for _ in range(3):
        step(scheduler)
    assert step(scheduler)[0].preempted_request_ids == ["b"]
    assert scheduler.abort_requests(["b"]) == [b]
    assert scheduler.num_waiting == 0 and b.status == RequestStatus.FINISHED_ABORTED
    scheduler.abort_requests(["a"])
    assert scheduler.kv_cache_manager.num_free_blocks == 4
    scheduler.check_invariants()


def test_add_request_only_asserts_what_the_frontend_validated() -> None:
    # The user-facing refusals (their messages) are the frontend's: tests/engine/test_input_processor.py.
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("a", 32, max_tokens=10))
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("b", 0))
    with pytest.raises(AssertionError):  # the core takes a resolved int: max_tokens fits the room left
        scheduler.add_request(make_request("c", 31, max_tokens=2))
    with pytest.raises(AssertionError):
        make_request("c", 31, max_tokens=None)
    fits = make_request("c", 31, max_tokens=1)
    scheduler.add_request(fits)
    assert fits.max_tokens == 1
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("c", 3))
    assert scheduler.get_num_unfinished_requests() == 1
    assert scheduler.num_waiting == 1
    scheduler.check_invariants()


def run_one(request: Request, tokens: list[int], max_model_len: int = 64) -> Request:
    """Feed `tokens` one per step (until the request finishes) and return it."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(request)
    for token in tokens:
        if request.is_finished:
            break
        step(scheduler, token)
    return request


def test_stop_on_eos_and_stop_token_ids() -> None:
    eos = run_one(make_request("a"), [5, EOS, 6])
    assert (eos.output_token_ids, eos.status, eos.stop_reason) == (
        [5, EOS],
        RequestStatus.FINISHED_STOPPED,
        None,
    )
    assert eos.finish_reason == "stop"

    stop = run_one(make_request("b", stop_token_ids=[9]), [5, 9, 6])
    assert (stop.output_token_ids, stop.status, stop.stop_reason) == (
        [5, 9],
        RequestStatus.FINISHED_STOPPED,
        9,
    )


def test_min_tokens_and_ignore_eos_and_max_tokens() -> None:
    # EOS and stop tokens only count once min_tokens tokens came out before them.
    early = run_one(make_request("a", min_tokens=2, stop_token_ids=[9]), [EOS, 9, EOS])
    assert early.output_token_ids == [EOS, 9, EOS] and early.status == RequestStatus.FINISHED_STOPPED

    ignored = run_one(make_request("b", ignore_eos=True, max_tokens=3), [EOS, EOS, EOS, EOS])
    assert ignored.output_token_ids == [EOS, EOS, EOS] and ignored.status == RequestStatus.FINISHED_LENGTH

    # The last allowed token being EOS is a stop, not a length finish.
    last = run_one(make_request("c", max_tokens=2), [5, EOS])
    assert last.status == RequestStatus.FINISHED_STOPPED

    # All the room the prompt leaves (the frontend's resolution of max_tokens None) runs up to max_model_len.
    unbounded = run_one(make_request("d", 6, max_tokens=4), [5] * 20, max_model_len=10)
    assert unbounded.num_output_tokens == 4 and unbounded.status == RequestStatus.FINISHED_LENGTH


def test_several_tokens_in_one_step_stop_at_the_first_stop() -> None:
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=10)
    scheduler.add_request(request)
    output = scheduler.schedule()
    updated = scheduler.update_from_output(output, {"a": [5, EOS, 6]})
    assert updated == [request] and request.output_token_ids == [5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_finish_requests_from_outside_and_tokens_after_abort_are_dropped() -> None:
    scheduler = make_scheduler()
    a = make_request("a", arrival_time=0.0)
    b = make_request("b", arrival_time=1.0, first_token=300)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    output = scheduler.schedule()
    assert scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == [a]
    updated = scheduler.update_from_output(output, {"a": [5], "b": [6]})
    assert updated == [b] and a.output_token_ids == [7]
    assert a.finish_reason == "stop" and scheduler.num_running == 1
    with pytest.raises(ValueError, match="not a finished status"):
        scheduler.finish_requests(["b"], RequestStatus.RUNNING)


def test_prefix_hit_is_recorded_and_skipped() -> None:
    scheduler = make_scheduler()
    first = make_request("a", 10, arrival_time=0.0, max_tokens=1)
    scheduler.add_request(first)
    step(scheduler)
    second = make_request("b", 10, arrival_time=1.0, max_tokens=1)
    scheduler.add_request(second)
    output, _ = step(scheduler)
    assert plan(output) == [("b", 2, 8, True)]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 8)
    stats = scheduler.make_stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (20, 8)
    assert (stats["num_steps"], stats["num_scheduled_tokens_last_step"]) == (2, 2)
    assert (stats["num_prompt_tokens"], stats["num_generation_tokens"]) == (12, 2)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0.0)


def test_a_short_request_arriving_during_a_long_prompt_starts_at_the_next_step() -> None:
    """The prompt with fewer tokens left goes first: the long prompt's chunk leaves the waiting short request
    what it needs, so it is prefilled whole and decodes while the long prompt goes on (decodes are scheduled
    before chunks, so the long prompt, running first, never takes the decode's token)."""
    scheduler = make_scheduler(num_blocks=400, block_size=16, max_num_batched_tokens=64, max_model_len=2000)
    scheduler.add_request(make_request("long", 1000, max_tokens=1))
    assert plan(step(scheduler)[0]) == [("long", 64, 0, False)]
    scheduler.add_request(make_request("short", 20, first_token=3000, max_tokens=3))
    assert plan(step(scheduler)[0]) == [("long", 44, 64, False), ("short", 20, 0, True)]
    # only the long prompt prefills now: the decode goes first, the chunk takes what it leaves
    assert plan(step(scheduler)[0]) == [("short", 1, 20, True), ("long", 63, 108, False)]


def test_prompts_arriving_together_are_prefilled_one_after_another() -> None:
    """The first gets its first token after its own prefill, not after both (as equal shares would have it)."""
    scheduler = make_scheduler(num_blocks=400, block_size=16, max_num_batched_tokens=64, max_model_len=2000)
    scheduler.add_request(make_request("a", 200, max_tokens=1))
    scheduler.add_request(make_request("b", 200, first_token=3000, max_tokens=1))
    rows = [plan(step(scheduler)[0]) for _ in range(7)]
    assert rows[:4] == [
        [("a", 64, 0, False)],
        [("a", 64, 64, False)],
        [("a", 64, 128, False)],
        [("a", 8, 192, True), ("b", 56, 0, False)],
    ]
    assert rows[4:] == [[("b", 64, 56, False)], [("b", 64, 120, False)], [("b", 16, 184, True)]]


def test_the_oldest_prompt_keeps_a_quarter_of_the_budget_against_shorter_ones() -> None:
    """A stream of shorter prompts never starves the one in progress longest."""
    scheduler = make_scheduler(num_blocks=400, block_size=16, max_num_batched_tokens=64, max_model_len=2000)
    scheduler.add_request(make_request("long", 1000, max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("short", 60, first_token=3000, max_tokens=1))
    assert plan(step(scheduler)[0]) == [("long", 16, 64, False), ("short", 48, 0, False)]
    # "short" has fewer tokens left than "long" and keeps what it needs; "long" the rest
    assert plan(step(scheduler)[0]) == [("long", 52, 80, False), ("short", 12, 48, True)]


def test_a_waiting_request_that_cannot_start_takes_no_share() -> None:
    """At max_num_seqs the waiting head cannot start, so the running prompt keeps the whole budget."""
    scheduler = make_scheduler(
        num_blocks=400, block_size=16, max_num_batched_tokens=64, max_model_len=2000, max_num_seqs=1
    )
    scheduler.add_request(make_request("long", 500, max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("next", 20, first_token=3000, max_tokens=1))
    assert plan(step(scheduler)[0]) == [("long", 64, 64, False)]
