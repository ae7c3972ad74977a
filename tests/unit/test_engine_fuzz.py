"""Random add / step / abort / finish sequences over a small KV pool.

Besides the invariants, a simulated KV cache checks what the blocks would hold: every step writes, for
each scheduled position, the token prefix that position's KV depends on, into the slot the block table
names; then every position a scheduled request attends to must hold its own prefix. That catches a bad
prefix hit, a block shared while written, a preempted request resuming on someone else's KV, and leaks.
With KV cache groups (sliding-window ones among them) each group's table is checked alike, a sliding
group over the positions its window reaches: those must be there and right, the rest may be freed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from izh.engine.kv_cache import KVCacheManager, blocks_per_request
from izh.engine.request import Request, RequestStatus
from izh.engine.scheduler import Scheduler, SchedulerOutput
from tests.unit.engine_params import Params

BLOCK_SIZE = 4
EOS = 2


WINDOWS: list[tuple[int | None, ...]] = [(None,), (None, 6), (5,), (None, 6, 6)]
"""KV cache groups to fuzz: one full group; a full and a sliding group; every layer windowed; two sliding."""


class SimulatedKV:
    """What each slot of each block would hold: the token prefix its KV was computed from (a block
    belongs to one group at a time, so one simulated pool serves every group)."""

    def __init__(self, num_blocks: int, windows: tuple[int | None, ...]) -> None:
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * BLOCK_SIZE for _ in range(num_blocks)]
        self.windows = windows

    def run(self, output: SchedulerOutput) -> None:
        # Like a model layer: write the whole batch's KV first, then attend.
        for s in output.scheduled:
            tokens = s.request.all_token_ids
            assert s.group_block_ids[0] is s.block_ids and len(s.group_block_ids) == len(self.windows)
            for table in s.group_block_ids:
                for pos in range(
                    s.num_computed_tokens_before, s.num_computed_tokens_before + s.num_scheduled_tokens
                ):
                    block = table[pos // BLOCK_SIZE]
                    assert block >= 0, (s.request.request_id, pos, "written into a freed block")
                    self.slots[block][pos % BLOCK_SIZE] = tuple(tokens[: pos + 1])
        for s in output.scheduled:
            tokens = s.request.all_token_ids
            end = s.num_computed_tokens_before + s.num_scheduled_tokens
            for window, table in zip(self.windows, s.group_block_ids, strict=True):
                assert len(table) * BLOCK_SIZE >= end
                first = 0 if window is None else max(0, s.num_computed_tokens_before - window + 1)
                for pos in range(first, end):
                    block = table[pos // BLOCK_SIZE]
                    assert block >= 0, (s.request.request_id, pos, window, "a block in the window was freed")
                    held = self.slots[block][pos % BLOCK_SIZE]
                    assert held == tuple(tokens[: pos + 1]), (s.request.request_id, pos, window, held)


class Driver:
    def __init__(
        self,
        num_blocks: int,
        budget: int,
        max_num_seqs: int,
        policy: str,
        caching: bool,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        # The longest context (up to 24) one request can hold in the pool, as the runner sizes it.
        self.max_model_len = max(
            (n for n in range(2, 25) if blocks_per_request(windows, BLOCK_SIZE, n, budget) <= num_blocks),
            default=2,
        )
        self.scheduler = Scheduler(
            kv_cache_manager=KVCacheManager(
                num_blocks, BLOCK_SIZE, enable_caching=caching, group_windows=windows
            ),
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            policy=policy,
        )
        self.kv = SimulatedKV(num_blocks, windows)
        self.num_added = 0
        self.finished: list[Request] = []

    def add(
        self,
        length: int,
        prefix: int,
        max_tokens: int | None,
        min_tokens: int,
        ignore_eos: bool,
        priority: int,
        salt: str | None,
    ) -> None:
        prompt = [(prefix * 5 + i) % 7 for i in range(length)]
        if (
            max_tokens is None
        ):  # the frontend resolves it to the room the prompt leaves (the core takes an int)
            max_tokens = max(self.max_model_len - length, 1)
        elif length < self.max_model_len:  # an explicit value the frontend would refuse is not sent
            max_tokens = min(max_tokens, self.max_model_len - length)
        params = Params(
            max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=[5]
        )
        request = Request(
            f"r{self.num_added}",
            prompt,
            params,  # type: ignore[arg-type]
            eos_token_ids=frozenset({EOS}),
            arrival_time=float(self.num_added),
            priority=priority,
            cache_salt=salt,
        )
        self.num_added += 1
        if length >= self.max_model_len:
            # The frontend refuses it (input_processor.process_request); the scheduler only asserts,
            # and is left as it was.
            num_unfinished = self.scheduler.get_num_unfinished_requests()
            with pytest.raises(AssertionError):
                self.scheduler.add_request(request)
            assert self.scheduler.get_num_unfinished_requests() == num_unfinished
            return
        self.scheduler.add_request(request)

    def step(self, seed: int) -> None:
        rng = random.Random(seed)
        output = self.scheduler.schedule()
        self.scheduler.check_invariants()
        assert output.total_num_scheduled_tokens == sum(s.num_scheduled_tokens for s in output.scheduled)
        assert output.total_num_scheduled_tokens <= self.scheduler.max_num_batched_tokens
        assert len({s.request.request_id for s in output.scheduled}) == len(output.scheduled)
        assert all(s.num_scheduled_tokens >= 1 for s in output.scheduled)
        self.kv.run(output)
        sampled = {s.request.request_id: [rng.randrange(7)] for s in output.scheduled if s.samples}
        for request in self.scheduler.update_from_output(output, sampled):
            assert request.num_computed_tokens == request.num_tokens - 1
            if request.is_finished:
                self.finished.append(request)
                assert request.num_output_tokens <= request.max_tokens
        self.scheduler.check_invariants()

    def pick(self, index: int) -> list[str]:
        ids = list(self.scheduler.requests)
        return [ids[index % len(ids)]] if ids else []


def random_operations(rng: random.Random, num_ops: int, max_model_len: int) -> list[tuple[Any, ...]]:
    """A workload: mostly adds and steps, so that the pool fills up, blocks are shared and requests
    are preempted; prompts draw on two shared prefixes; some are too long, which the scheduler asserts against."""
    ops: list[tuple[Any, ...]] = []
    for _ in range(num_ops):
        roll = rng.random()
        if roll < 0.3:
            length = rng.randint(1, max_model_len + 2)
            max_tokens = rng.choice([None, *range(1, 9)])
            ignore_eos = rng.random() < 0.2
            salt = "tenant" if rng.random() < 0.2 else None
            ops.append(
                (
                    "add",
                    length,
                    rng.randrange(2),
                    max_tokens,
                    rng.randrange(3),
                    ignore_eos,
                    rng.randrange(3),
                    salt,
                )
            )
        elif roll < 0.85:
            ops.append(("step", rng.randrange(2**16)))
        elif roll < 0.95:
            ops.append(("abort", rng.randrange(50)))
        else:
            ops.append(("finish", rng.randrange(50)))
    return ops


@settings(max_examples=400, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_ops=st.integers(1, 80),
    num_blocks=st.integers(4, 10),
    budget=st.integers(1, 16),
    max_num_seqs=st.integers(1, 5),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    windows=st.sampled_from(WINDOWS),
)
def test_random_workloads_keep_invariants_and_leak_nothing(
    seed: int,
    num_ops: int,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    policy: str,
    caching: bool,
    windows: tuple[int | None, ...],
) -> None:
    # A pool of num_blocks per group: the same room per group as with one.
    num_blocks *= len(windows)
    if blocks_per_request(windows, BLOCK_SIZE, 2, budget) > num_blocks:
        return  # not even a 2-token context fits: the engine refuses such a pool at start
    driver = Driver(num_blocks, budget, max_num_seqs, policy, caching, windows)
    scheduler = driver.scheduler
    for op in random_operations(random.Random(seed), num_ops, driver.max_model_len):
        if op[0] == "add":
            driver.add(*op[1:])
        elif op[0] == "step":
            driver.step(op[1])
        elif op[0] == "abort":
            for request in scheduler.abort_requests(driver.pick(op[1])):
                assert request.status == RequestStatus.FINISHED_ABORTED
        else:
            scheduler.finish_requests(driver.pick(op[1]), RequestStatus.FINISHED_STOPPED)
        scheduler.check_invariants()

    # Everything left runs to completion: no livelock, however small the pool.
    for seed in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        driver.step(seed)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in scheduler.kv_cache_manager.block_pool.blocks)
    assert scheduler.num_running == scheduler.num_waiting == 0
    for request in driver.finished:
        assert request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        assert request.num_tokens <= driver.max_model_len
