"""Scheduler: picks each step's tokens under one token budget (pure Python).

There is no prefill or decode phase. Each step the running requests go first (their decodes, then their
prompts' chunks, as "Prompts in the step" below orders them), then the waiting ones by policy, and each takes
min(tokens still to compute, budget left): a long prompt is prefilled in chunks, a prefix-cache hit skips its
cached tokens, a decode takes one token, all from the same loop. When blocks run out, the lowest-priority,
latest-arrival running request is preempted: its blocks are freed and it is recomputed later (prompt + outputs
so far), usually cheaply thanks to the prefix cache.

A pooling (embedding) request is the one exception to chunking: it is scheduled whole, so that it is
computed, pooled and finished in one step (mean pooling needs every token's hidden state at once, and
an encoder must see its whole input). It waits while the step's budget left is too small, unless it is
the first waiting request admitted in the step: then the step runs over its budget by what it needs
(at most max_model_len tokens), so a prompt longer than the budget is never starved.

Long prompts while others decode: a prefill chunk's attention grows with its context (each of its T
tokens attends to every position before it), so at 4,000 tokens of context a 128-token chunk costs a CPU
several decode steps' time, and every decoding stream waits for it. With `prefill_attention_budget` > 0,
while any running request is past its prompt, the prefill chunks of a step together attend to at most that
many (query token, context position) pairs: a chunk of T tokens from position c counts T * c + T (T + 1) / 2,
plus, where attention runs in bfloat16 (the AMX tiles or vdpbf16ps: the engine's `prefill_token_pairs`,
PREFILL_TOKEN_PAIRS_BY_PATH), a number of pairs for each token's own layers (so that a chunk at a short
context, mostly matmuls, is bounded too).
Every chunk still gets at least one token, and as many as fit in a quarter of the budget even when the
step's is spent, so that every prompt progresses and a short prompt arriving during a long one is not held
back behind it; when nothing decodes there is no limit (a prompt alone goes as fast as the token budget
allows).

Prompts in the step: what the decodes leave of the budget goes to the prompts with the fewest tokens left
first (the running ones still prefilling, and the waiting queue's head when it could start; ties to the
earlier admitted). A short request arriving during a long prompt starts at the next step instead of waiting
for the whole long prompt (on a CPU a 32,000-token prompt takes minutes), and prompts arriving together are
prefilled one after another, so that the first gets its first token after its own prefill rather than after
all of theirs (as a fair share of every step would have it). The oldest prompt in progress still takes at
least a quarter of the budget each step, so that a stream of shorter prompts never starves it. Decodes are
not capped.

With LoRA (`max_loras` > 0), the running requests use at most `max_loras` distinct adapters, as many as
the model holds at once (izh.engine.lora_manager): a waiting request on another adapter waits at the
head of the queue until one of those adapters has no running request left.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypedDict

from izh.engine.kv_cache import KVCacheManager
from izh.engine.request import Request, RequestStatus
from izh.sampling_params import context_room

logger = logging.getLogger(__name__)

POLICIES = ("fcfs", "priority")


class SchedulerStatsDict(TypedDict):
    """make_stats(): SchedulerStats' names (cumulative counters) plus the last step's token count."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_scheduled_tokens_last_step: int
    running_lora_adapters: list[str]
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: list[int]
    waiting_lora_adapters: list[str]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_scheduled_tokens: int
    num_computed_tokens_before: int
    """The request's num_computed_tokens when scheduled: the scheduled tokens sit at positions
    [num_computed_tokens_before, num_computed_tokens_before + num_scheduled_tokens)."""
    block_ids: list[int]
    """The request's whole block table (the KV manager's live list: read it, never mutate it); with
    several KV cache groups, group 0's."""
    samples: bool
    """True when this step computes the last known token, so the step samples a new one (never for a
    prompt-only request: its step that computes the last prompt token finishes it instead)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens verified in this step: they follow the last known token, so the step computes
    1 + len(spec_token_ids) tokens (num_scheduled_tokens) and samples at each of those positions."""
    group_block_ids: list[list[int]] = field(default_factory=list)
    """Every KV cache group's block table (live lists; block_ids is the first), -1 where a sliding
    window's group dropped a block."""


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes, in batch order, and what changed since the last step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests finished or aborted since the previous schedule(): their per-request state can go."""
    running_lora_ids: set[int] = field(default_factory=set)
    """The LoRA adapters of every running request after this schedule (their slots must stay)."""


class _WaitingQueue:
    """Waiting requests: FCFS (a deque; preempted ones go back to the front) or priority (a heap on
    (priority, arrival_time, admission order), where a preempted request keeps its original place)."""

    __slots__ = ("_counter", "_deque", "_heap", "_policy")

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._deque) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        if self._policy == "fcfs":
            return iter(self._deque)
        return (entry[3] for entry in self._heap)

    def add(self, request: Request) -> None:
        if self._policy == "fcfs":
            self._deque.append(request)
        else:
            self._push(request)

    def add_front(self, request: Request) -> None:
        if self._policy == "fcfs":
            self._deque.appendleft(request)
        else:
            self._push(request)

    def _push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def peek(self) -> Request:
        return self._deque[0] if self._policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._deque.popleft() if self._policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """O(len): aborts are rare next to steps."""
        if self._policy == "fcfs":
            self._deque.remove(request)
            return
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)


PREFILL_TOKEN_PAIRS = 4096
"""What one token of a prefill chunk costs in its own layers (the linear layers, norms, the LM head's share),
counted against `prefill_attention_budget` as that many attention pairs where attention runs on the AMX tiles
(PREFILL_TOKEN_PAIRS_BY_PATH): about a token's matmuls over Qwen2.5-0.5B's weights (~1 ms on 2 AMX cores)
against one pair's attention on the tiles (~0.2-0.25 us) (bench_results/README.md, "A 32,000-token prompt while
4 streams decode"). Without it a chunk at a short context (up to the whole token budget of 128 tokens) made the
few steps that stretched the streams' ITL p99."""

PREFILL_TOKEN_PAIRS_BY_PATH = {"float32": 0, "dpbf16": 8192, "tiles": PREFILL_TOKEN_PAIRS}
"""The engine's `prefill_token_pairs` by the kernel attention runs (`ModelRunner.attention_path`): 0 on the
float32 path (its budget bounds attention alone); on vdpbf16ps (the avx512 variant) 8,192, a token's matmuls on
two Zen 4 cores (~4 ms: AVX-512 VNNI, no tiles) against a pair's attention there (~0.35-0.6 us)
(bench_results/README.md, "A 32,000-token prompt on AVX512-BF16")."""


def _in_prompt(request: Request) -> bool:
    """Still prefilling its prompt (or recomputing it after a preemption)."""
    return request.num_computed_tokens < request.num_prompt_tokens


def _left(request: Request) -> int:
    """Tokens it still has to compute."""
    return request.num_tokens - request.num_computed_tokens


def prefill_attention_pairs(context: int, num_tokens: int) -> int:
    """The (query token, context position) pairs a prefill chunk of `num_tokens` tokens from position
    `context` attends to: token i (0-based) sees context + i + 1 positions."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


def prefill_chunk_cost(context: int, num_tokens: int, token_pairs: int) -> int:
    """What a prefill chunk counts against `prefill_attention_budget`: its attention pairs, and
    `token_pairs` for each of its tokens' own layers."""
    return prefill_attention_pairs(context, num_tokens) + num_tokens * token_pairs


class Scheduler:
    """Continuous batching over a KVCacheManager under one token budget per step."""

    def __init__(
        self,
        *,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fcfs",
        block_size: int | None = None,
        is_ready: Callable[[Request], bool] | None = None,
        max_loras: int = 0,
        prefill_attention_budget: int = 0,
        prefill_token_pairs: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; supported: {', '.join(POLICIES)}")
        if block_size is not None and block_size != kv_cache_manager.block_size:
            raise ValueError(
                f"block_size {block_size} differs from the KV cache's {kv_cache_manager.block_size}"
            )
        if prefill_attention_budget < 0:
            raise ValueError(f"prefill_attention_budget must be >= 0; got {prefill_attention_budget}")
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2:
            raise ValueError(
                f"need max_num_batched_tokens >= 1, max_num_seqs >= 1, max_model_len >= 2; got "
                f"{max_num_batched_tokens}, {max_num_seqs}, {max_model_len}"
            )
        needed = kv_cache_manager.max_blocks_per_request(max_model_len, max_num_batched_tokens)
        if needed > kv_cache_manager.num_blocks:
            # A request alone must always fit, or it would preempt itself forever.
            raise ValueError(
                f"the KV cache has {kv_cache_manager.num_blocks} blocks, less than the {needed} one request "
                f"of max_model_len {max_model_len} may hold"
            )
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.is_ready = is_ready
        """Whether a waiting request may start (False while its grammar still compiles)."""
        self.max_loras = max_loras
        """The most distinct LoRA adapters the running requests may use (0: no LoRA)."""
        self.prefill_attention_budget = prefill_attention_budget
        """While a running request decodes, the (query, position) pairs a step's prefill chunks may attend
        to (0: no limit; see the module docstring)."""
        self.prefill_token_pairs = prefill_token_pairs
        """What each prefill token's own layers count against that budget (the engine:
        PREFILL_TOKEN_PAIRS_BY_PATH)."""
        self._attention_left: int | None = None
        """What is left of it in the step being scheduled (None: no limit this step)."""
        self._chunk_caps: dict[str, int] | None = None
        """The most tokens each running prompt's chunk takes in the step being scheduled, by request id (None
        until the step's first chunk; see the module docstring, "Prompts in the step")."""
        self.requests: dict[str, Request] = {}
        """Every unfinished request by id."""
        self.running: list[Request] = []
        self.waiting = _WaitingQueue(policy)
        self._finished_request_ids: list[str] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_scheduled_tokens_last_step = 0
        self.num_prompt_tokens = 0
        """Prompt tokens computed (prefix hits excluded, recomputation included), cumulative."""
        self.num_generation_tokens = 0
        self.spec_num_drafts = 0
        """Speculative decoding, cumulative (vLLM's spec_decode_* counters): verified drafts, their
        tokens, the accepted ones, and the accepted ones by position in the draft."""
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []

    # -- requests in and out ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a new request. It was validated before it got here (the frontend's
        input_processor.process_request; EngineCore checks the invariants): a non-empty prompt, a
        max_tokens resolved to an int that fits the room the prompt leaves within max_model_len (at
        least one output token unless it is a prompt-only request), and an id not in use. Those are
        only asserted here."""
        assert request.num_prompt_tokens > 0, request.request_id
        room = context_room(self.max_model_len, request.num_prompt_tokens)
        assert (0 if request.is_prompt_only else 1) <= request.max_tokens <= room, (
            request.request_id,
            request.num_prompt_tokens,
            request.max_tokens,
        )
        assert request.request_id not in self.requests, request.request_id
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests in any state, freeing their blocks; unknown or finished ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string, grammar end); returns those finished."""
        if status <= RequestStatus.PREEMPTED:
            raise ValueError(f"{status!r} is not a finished status")
        finished: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        # The caller takes the request out of running / waiting (update_from_output does it in bulk).
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)

    # -- one step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their blocks."""
        output = SchedulerOutput()
        decoding = any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        self._attention_left = (
            self.prefill_attention_budget if self.prefill_attention_budget and decoding else None
        )
        self._chunk_caps = None
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        # After a preemption blocks are scarce: admitting new work would only preempt again.
        if not output.preempted_request_ids:
            budget = self._schedule_waiting(output, budget)
        output.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        if self.max_loras:
            output.running_lora_ids = self.running_lora_ids()
        output.finished_request_ids = self._finished_request_ids
        self._finished_request_ids = []
        self.num_steps += 1
        self.num_scheduled_tokens_last_step = output.total_num_scheduled_tokens
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        """Give each running request what it still needs, the decodes first and then the chunks in
        _running_order (a chunk never takes a decode's token); preempt when blocks run out."""
        prompts = [r for r in self.running if _in_prompt(r)]  # oldest first
        for request in self._running_order(prompts):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new_tokens <= 0:
                continue  # its step produced no token (the runner skipped it); nothing to compute
            if _in_prompt(request):
                if self._chunk_caps is None:  # the decodes, scheduled first, have taken theirs
                    self._chunk_caps = self._prompt_chunk_caps(prompts, budget)
                num_new_tokens = min(num_new_tokens, self._chunk_caps.get(request.request_id, num_new_tokens))
                if num_new_tokens <= 0:
                    continue  # what is left of the budget is the shorter prompts
            if request.num_tokens - request.num_computed_tokens > 1:
                num_new_tokens = self._cap_by_attention(request.num_computed_tokens, num_new_tokens)
            spec_token_ids = request.spec_token_ids
            if spec_token_ids:
                request.spec_token_ids = []
                if request.num_tokens - request.num_computed_tokens == 1:
                    # A decode with drafts: the drafts that fit the budget ride along for verification.
                    spec_token_ids = spec_token_ids[: budget - 1]
                    num_new_tokens += len(spec_token_ids)
                else:
                    spec_token_ids = []
            while True:
                if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is not None:
                    self._add_scheduled(output, request, num_new_tokens, spec_token_ids)
                    budget -= num_new_tokens
                    break
                victim = self._pick_victim()
                budget += self._preempt(victim, output)
                if victim is request:
                    break  # it waits; later running requests may still fit without new blocks
        return budget

    def _prompt_chunk_caps(self, prompts: list[Request], budget: int) -> dict[str, int]:
        """What each running prompt's chunk may take of `budget` (what the decodes left), the chunks then taken
        in _running_order: the waiting queue's head, when it could start, keeps what it needs from every
        prompt with more tokens left, and the oldest prompt in progress (taken first) keeps at least a
        quarter of the step's budget but leaves what the prompts with fewer tokens left need. `prompts`: the
        prompts in progress at the step's start, oldest first; those the decodes' blocks preempted drop out."""
        prompts = [r for r in prompts if r.status == RequestStatus.RUNNING]
        if not prompts:
            return {}
        head_left = None
        if self.waiting and len(self.running) < self.max_num_seqs and self._may_start(self.waiting.peek()):
            head_left = _left(self.waiting.peek())
        caps = {
            r.request_id: budget - head_left
            for r in prompts
            if head_left is not None and _left(r) > head_left
        }
        oldest = prompts[0]
        shorter = sum(_left(r) for r in prompts[1:] if _left(r) < _left(oldest))
        shorter += head_left if head_left is not None and head_left < _left(oldest) else 0
        # at least one token: the waiting head it leaves room for may not get its blocks, and then nothing else
        # would move (a livelock the fuzz test found at a budget of 3)
        caps[oldest.request_id] = max(budget - shorter, self.max_num_batched_tokens // 4, 1)
        return caps

    def _running_order(self, prompts: list[Request]) -> list[Request]:
        """The decodes, then the oldest prompt in progress (prompts[0]), then the other chunks by tokens left (a
        prompt's, or a preempted request's recomputation past its prompt; the module docstring, "Prompts in the
        step"); a snapshot, as preemption removes requests from self.running."""
        oldest = prompts[0] if prompts else None
        return sorted(
            self.running,
            key=lambda r: (0, 0) if _left(r) <= 1 else (1, 0) if r is oldest else (2, _left(r)),
        )

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests by policy until the budget, max_num_seqs or the blocks run out."""
        kv = self.kv_cache_manager
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if not self._may_start(request):
                break  # head of line keeps its place; the running requests go on meanwhile
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            if request.is_pooling:
                # Whole or not at all (see the module docstring): it skips the prefix cache, so it
                # computes every token, and the first admission of a step may overrun the budget.
                num_new_tokens = request.num_tokens - num_hit_tokens
                if num_new_tokens > budget and admitted:
                    break
            elif num_new_tokens > 0:
                num_new_tokens = self._cap_by_attention(num_hit_tokens, num_new_tokens)
            if kv.allocate_slots(request, num_new_tokens, computed_blocks, num_hit_tokens) is None:
                break  # the head waits for blocks; skipping it for smaller requests could starve it
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            self._add_scheduled(output, request, num_new_tokens)
            budget -= num_new_tokens
            admitted = True
        return budget

    def _may_start(self, request: Request) -> bool:
        """Whether a waiting request could start, budget and blocks aside: it is ready (is_ready), and its
        adapter, if any, has a slot (one that running requests' adapters do not all hold)."""
        if self.is_ready is not None and not self.is_ready(request):
            return False
        return not request.lora_id or self._lora_fits(request.lora_id)

    def _cap_by_attention(self, context: int, num_new_tokens: int) -> int:
        """num_new_tokens (>= 1) of a prefill chunk from position `context`, cut to the pairs it may attend
        to (the module docstring: what is left of the step's budget, or a quarter of the budget if that is
        more; at least one token), which it then takes from what is left."""
        left = self._attention_left
        if left is None:
            return num_new_tokens
        allowed = max(left, self.prefill_attention_budget // 4)
        n = num_new_tokens
        if prefill_chunk_cost(context, n, self.prefill_token_pairs) > allowed:
            # the largest n with n * (context + K) + n (n + 1) / 2 <= allowed (K = prefill_token_pairs):
            # n^2 + b n - 2 allowed <= 0 with b odd, whose root's floor (isqrt(D) - b) // 2 gives exactly
            # (b odd, so rounding D's root down first cannot lower it)
            b = 2 * (context + self.prefill_token_pairs) + 1
            n = (math.isqrt(b * b + 8 * allowed) - b) // 2
            n = max(1, min(n, num_new_tokens))
        self._attention_left = max(0, left - prefill_chunk_cost(context, n, self.prefill_token_pairs))
        return n

    def _lora_fits(self, lora_id: int) -> bool:
        """Admitting a request on adapter `lora_id` keeps the running adapters within max_loras."""
        running = self.running_lora_ids()
        return lora_id in running or len(running) < self.max_loras

    def running_lora_ids(self) -> set[int]:
        """The distinct adapters (ids) of the running requests."""
        return {r.lora_id for r in self.running if r.lora_id}

    def _add_scheduled(
        self,
        output: SchedulerOutput,
        request: Request,
        num_new_tokens: int,
        spec_token_ids: list[int] | None = None,
    ) -> None:
        num_computed = request.num_computed_tokens
        num_known = num_new_tokens - len(spec_token_ids or ())
        output.scheduled.append(
            ScheduledRequest(
                request=request,
                num_scheduled_tokens=num_new_tokens,
                num_computed_tokens_before=num_computed,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                group_block_ids=self.kv_cache_manager.get_group_block_ids(request.request_id),
                samples=num_computed + num_known == request.num_tokens and not request.is_prompt_only,
                spec_token_ids=spec_token_ids or [],
            )
        )

    def _pick_victim(self) -> Request:
        """The lowest-priority (highest value), latest-arrival running request; FCFS ignores priority.
        Ties go to the one latest in the running list."""
        if self.policy == "priority":
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return max(reversed(self.running), key=lambda r: r.arrival_time)

    def _preempt(self, victim: Request, output: SchedulerOutput) -> int:
        """Free the victim's blocks and put it back in front of the waiting queue. Returns the tokens it
        gives back to this step's budget (non-zero when it was already scheduled in this step)."""
        self.running.remove(victim)
        num_returned = 0
        for index, scheduled in enumerate(output.scheduled):
            if scheduled.request is victim:
                num_returned = scheduled.num_scheduled_tokens
                del output.scheduled[index]
                break
        self.kv_cache_manager.free(victim)
        victim.spec_token_ids = []
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(victim)
        output.preempted_request_ids.append(victim.request_id)
        logger.debug("preempted request %s (%d tokens)", victim.request_id, victim.num_tokens)
        return num_returned

    # -- after the step -----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Advance every scheduled request by its scheduled tokens, append the sampled tokens and check
        the stop conditions; a prompt-only request whose prompt is computed finishes with "length".
        Returns the requests that got new tokens or finished, in batch order."""
        updated: list[Request] = []
        num_finished = 0
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted or finished from outside since schedule()
            before = scheduled.num_computed_tokens_before
            request.num_computed_tokens = before + scheduled.num_scheduled_tokens
            if scheduled.spec_token_ids:
                # The KV of the last known token and of the accepted drafts stays; the rejected drafts'
                # slots are past num_computed_tokens (overwritten later, or freed by `trim` below).
                num_accepted = self._count_spec(scheduled, sampled_token_ids.get(request.request_id))
                request.num_computed_tokens = before + 1 + num_accepted
            if before < request.num_prompt_tokens:
                self.num_prompt_tokens += min(request.num_computed_tokens, request.num_prompt_tokens) - before
            if request.is_prompt_only and request.num_computed_tokens == request.num_tokens:
                if sampled_token_ids.get(request.request_id):
                    raise ValueError(f"prompt-only request {request.request_id} got a sampled token")
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                num_finished += 1
                updated.append(request)
                continue
            token_ids = sampled_token_ids.get(request.request_id)
            if not token_ids:
                continue
            if not scheduled.samples:
                raise ValueError(f"request {request.request_id} got a token in a step that does not sample")
            status = self._append_and_check_stop(request, token_ids)
            if status is not None:
                self._finish(request, status)
                num_finished += 1
            elif scheduled.spec_token_ids:
                self.kv_cache_manager.trim(request)
            updated.append(request)
        if num_finished:
            self.running = [request for request in self.running if request.status == RequestStatus.RUNNING]
        return updated

    def _count_spec(self, scheduled: ScheduledRequest, token_ids: list[int] | None) -> int:
        """Count one verified draft in the spec_decode counters; returns its accepted tokens (the
        runner's tokens are the accepted drafts plus one the target sampled itself)."""
        num_drafted = len(scheduled.spec_token_ids)
        num_accepted = max(0, min(len(token_ids or ()) - 1, num_drafted))
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafted
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_drafted:
            per_pos.extend([0] * (num_drafted - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1
        return num_accepted

    def _append_and_check_stop(self, request: Request, token_ids: list[int]) -> RequestStatus | None:
        """Append tokens one by one, stopping at the first that finishes the request."""
        params = request.sampling_params
        for token_id in token_ids:
            request.append_output_token_ids(token_id)
            self.num_generation_tokens += 1
            # min_tokens tokens must come out before EOS or a stop token counts (the sampler masks
            # them until then, so this only matters for a runner that does not).
            if request.num_output_tokens > params.min_tokens:
                if not params.ignore_eos and token_id in request.eos_token_ids:
                    return RequestStatus.FINISHED_STOPPED
                if token_id in params.stop_token_ids:
                    request.stop_reason = token_id
                    return RequestStatus.FINISHED_STOPPED
            # max_tokens fits max_model_len (asserted on admission); the second test guards recomputation.
            if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
                return RequestStatus.FINISHED_LENGTH
        return None

    # -- observability ------------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStatsDict:
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": kv.usage,
            "num_blocks": kv.num_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_scheduled_tokens_last_step": self.num_scheduled_tokens_last_step,
            "running_lora_adapters": sorted({r.lora_name for r in self.running if r.lora_name}),
            "waiting_lora_adapters": sorted({r.lora_name for r in self.waiting if r.lora_name}),
            "spec_decode_num_drafts": self.spec_num_drafts,
            "spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent state (also checks the KV cache; O(everything))."""
        self.kv_cache_manager.check_invariants()
        waiting = list(self.waiting)
        ids = [r.request_id for r in self.running] + [r.request_id for r in waiting]
        if sorted(ids) != sorted(self.requests):
            raise AssertionError(f"running + waiting {sorted(ids)} != unfinished {sorted(self.requests)}")
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs {self.max_num_seqs}")
        kv = self.kv_cache_manager
        for request in self.running:
            num_blocks = len(kv.get_block_ids(request.request_id))
            if (
                request.status != RequestStatus.RUNNING
                or num_blocks * self.block_size < request.num_computed_tokens
            ):
                raise AssertionError(
                    f"running request {request.request_id} is {request.status!r} with {num_blocks} blocks"
                )
            if not 0 <= request.num_computed_tokens <= request.num_tokens <= self.max_model_len:
                raise AssertionError(f"request {request.request_id}: bad token counts")
        for request in waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"waiting request {request.request_id} is {request.status!r}")
            if request.num_computed_tokens != 0 or kv.get_block_ids(request.request_id):
                raise AssertionError(f"waiting request {request.request_id} holds computed tokens or blocks")
