"""Prompt-only requests (max_tokens 0) in the scheduler: prefilled in chunks like any prompt, never
sampled, finished with "length" once the prompt is computed, and no disturbance to their batch."""

from __future__ import annotations

import pytest

from izh.engine.request import RequestStatus
from tests.unit.test_scheduler import make_request, make_scheduler, plan, step


def test_a_prompt_only_request_is_chunked_never_samples_and_finishes_with_length() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("score", 20, max_tokens=0)
    scheduler.add_request(request)
    assert request.is_prompt_only and request.max_tokens == 0
    assert plan(step(scheduler)[0]) == [("score", 8, 0, False)]
    assert plan(step(scheduler)[0]) == [("score", 8, 8, False)]
    output, updated = step(scheduler)
    assert plan(output) == [("score", 4, 16, False)]
    assert updated == [request]
    assert request.status == RequestStatus.FINISHED_LENGTH and request.finish_reason == "length"
    assert request.output_token_ids == [] and request.num_computed_tokens == 20
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert scheduler.make_stats()["num_prompt_tokens"] == 20
    assert scheduler.make_stats()["num_generation_tokens"] == 0
    # The next schedule reports it finished, so the runner drops its per-request state.
    assert scheduler.schedule().finished_request_ids == ["score"]


def test_a_short_prompt_only_request_finishes_in_its_first_step() -> None:
    scheduler = make_scheduler()
    request = make_request("one", 1, max_tokens=0)
    scheduler.add_request(request)
    output, updated = step(scheduler)
    assert plan(output) == [("one", 1, 0, False)]
    assert updated == [request] and request.is_finished and request.output_token_ids == []


def test_prompt_only_requests_leave_the_rest_of_their_batch_as_it_would_run_alone() -> None:
    def run(with_scoring: bool) -> list[list[tuple[str, int, int, bool]]]:
        scheduler = make_scheduler(max_num_batched_tokens=64)
        scheduler.add_request(make_request("gen", 6, max_tokens=4))
        if with_scoring:
            scheduler.add_request(make_request("score", 10, max_tokens=0, first_token=300))
        plans = []
        while scheduler.has_unfinished_requests():
            plans.append([p for p in plan(step(scheduler)[0]) if p[0] == "gen"])
        return plans

    assert run(with_scoring=True) == run(with_scoring=False)


def test_a_prompt_only_request_may_fill_the_whole_context() -> None:
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("full", 16, max_tokens=0))
    # The frontend refuses these (tests/engine/test_input_processor.py); the scheduler asserts.
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("gen", 16, max_tokens=1, first_token=300))
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("long", 17, max_tokens=0, first_token=300))
    output, updated = step(scheduler)
    assert plan(output) == [("full", 16, 0, False)]
    assert [r.request_id for r in updated] == ["full"] and updated[0].is_finished


def test_a_prompt_only_prefill_fills_the_prefix_cache_for_later_requests() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("score", 10, max_tokens=0))
    step(scheduler)
    later = make_request("gen", 10, max_tokens=2)
    scheduler.add_request(later)
    # Two full blocks of the same prompt are cached; the last token is always recomputed.
    assert plan(step(scheduler)[0]) == [("gen", 2, 8, True)]
    assert later.num_cached_tokens == 8


def test_a_sampled_token_for_a_prompt_only_request_is_refused() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("score", 4, max_tokens=0))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="prompt-only"):
        scheduler.update_from_output(output, {"score": [7]})
