"""Pooling (embedding) requests in the scheduler: scheduled whole, never chunked; finished in their
one step without a sample; waiting while the budget left is too small, except as a step's first
admission (then over the budget, so that a prompt longer than the budget is never starved); and no
prefix-cache reads or writes."""

from __future__ import annotations

from izh.engine.request import Request, RequestStatus
from izh.pooling_params import PoolingParams
from tests.unit.test_scheduler import make_request, make_scheduler, plan, step

POOLING = PoolingParams(pooling_type="mean", normalize=True)


def pooling_request(request_id: str, num_tokens: int, first_token: int = 100) -> Request:
    request = make_request(request_id, num_tokens, max_tokens=0, first_token=first_token)
    request.pooling_params = POOLING
    return request


def test_a_pooling_request_longer_than_the_budget_runs_whole_in_one_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = pooling_request("embed", 20)
    scheduler.add_request(request)
    output, updated = step(scheduler)
    assert plan(output) == [("embed", 20, 0, False)]
    assert output.total_num_scheduled_tokens == 20
    assert updated == [request] and request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == []
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_a_pooling_request_waits_when_the_budget_left_is_too_small_then_goes_whole() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("gen", 10, max_tokens=1))
    scheduler.add_request(pooling_request("embed", 12, first_token=300))
    first, _ = step(scheduler)
    # 10 prompt tokens leave 6: the 12-token embedding is not split, it waits.
    assert plan(first) == [("gen", 10, 0, True)]
    second, updated = step(scheduler)
    assert plan(second) == [("embed", 12, 0, False)]
    assert [r.request_id for r in updated] == ["embed"]


def test_pooling_requests_share_a_step_up_to_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    for i in range(4):
        scheduler.add_request(pooling_request(f"e{i}", 6, first_token=100 + 10 * i))
    plans = [plan(step(scheduler)[0]) for _ in range(2)]
    assert plans == [
        [("e0", 6, 0, False), ("e1", 6, 0, False)],
        [("e2", 6, 0, False), ("e3", 6, 0, False)],
    ]
    assert not scheduler.has_unfinished_requests()


def test_pooling_requests_neither_read_nor_fill_the_prefix_cache() -> None:
    scheduler = make_scheduler()
    kv = scheduler.kv_cache_manager
    scheduler.add_request(pooling_request("a", 16))
    step(scheduler)
    scheduler.add_request(pooling_request("b", 16))
    output, _ = step(scheduler)
    assert plan(output) == [("b", 16, 0, False)]  # nothing reused
    assert kv.prefix_cache_hits == 0
    # A generation request with the same prompt finds no block that the embeddings left behind.
    scheduler.add_request(make_request("gen", 16, max_tokens=1))
    output, _ = step(scheduler)
    assert plan(output) == [("gen", 16, 0, True)]
