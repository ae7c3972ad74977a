"""EngineCore: schedule → run → sample → update, one step at a time (in-process; no I/O)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from izh.config import EngineConfig, default_prefill_attention_budget
from izh.engine.draft_model import (
    DraftModelProposer,
    DraftRequest,
    draft_kv_bytes_per_block,
    resolve_draft_path,
)
from izh.engine.guided import GrammarManager
from izh.engine.heap import release_free_heap
from izh.engine.kv_cache import KVCacheManager
from izh.engine.lora_manager import LoraManager
from izh.engine.model_runner import ModelRunner
from izh.engine.request import Request, RequestStatus
from izh.engine.scheduler import PREFILL_TOKEN_PAIRS_BY_PATH, Scheduler, SchedulerOutput
from izh.engine.spec_decode import make_proposer
from izh.engine_messages import AddRequest, EngineOutput, SchedulerStats, TokenLogprobs
from izh.errors import IzhError, LoraAdapterError, ModelLoadError
from izh.sampling_params import context_room
from izh.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class EngineCore:
    """Owns the scheduler, the KV cache manager and the model runner of one model."""

    def __init__(
        self,
        config: EngineConfig,
        progress: Callable[[int, int, str], None] | None = None,
    ) -> None:
        self.config = config
        spec = config.speculative
        uses_draft = spec is not None and spec.method == "draft_model"
        if uses_draft and config.tensor_parallel_size > 1:
            raise ModelLoadError(
                "a draft model (speculative method draft_model) runs with tensor_parallel_size 1"
            )
        # A draft model's KV shares the target's blocks: the budget holds both (izh.engine.draft_model).
        extra_kv = draft_kv_bytes_per_block(config, resolve_draft_path(config)) if uses_draft else 0
        self.runner = ModelRunner(config, progress=progress, extra_kv_bytes_per_block=extra_kv)
        self.max_model_len = self.runner.max_model_len
        self.num_blocks = self.runner.num_blocks
        self.block_size = self.runner.block_size
        self.vocab_size = self.runner.vocab_size
        self.device = str(self.runner.device)
        self.dtype = str(self.runner.dtype).removeprefix("torch.")
        self.kv_cache_dtype = self.runner.kv_format.name
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._grammar: GrammarManager | None = None
        """Made on the first constrained request (building the grammar tokenizer takes a moment)."""
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            enable_caching=config.enable_prefix_caching,
            group_windows=self.runner.kv_group_windows,
        )
        attention_path = self.runner.attention_path
        self.scheduler = Scheduler(
            kv_cache_manager=self.kv_cache_manager,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            prefill_attention_budget=(
                default_prefill_attention_budget(self.runner.device.type, attention_path)
                if config.prefill_attention_budget is None
                else config.prefill_attention_budget
            ),
            # a chunk token's own layers weigh against the budget where attention is cheap (bfloat16 products)
            prefill_token_pairs=PREFILL_TOKEN_PAIRS_BY_PATH[attention_path],
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            block_size=self.block_size,
            is_ready=self._grammar_ready,
            max_loras=config.max_loras if self.runner.lora is not None else 0,
        )
        self.proposer = None if uses_draft else make_proposer(spec)
        """Proposes each running request's n-gram drafts after every step (None: no n-gram drafts)."""
        self.draft: DraftModelProposer | None = None
        """The draft model (method draft_model) that decodes each running request's drafts instead."""
        if uses_draft:
            try:
                self.draft = DraftModelProposer(config, self.runner, self.tokenizer)
            except BaseException:
                self.runner.shutdown()
                raise
        if spec is not None and self.runner.device.type == "cpu" and self.runner.dtype != torch.float32:
            logger.warning(
                "speculative decoding on %s CPU weights: a verification step's rows are not yet bit-identical "
                "to single-token decodes there, so greedy tokens may differ from decoding without drafts "
                "(--dtype float32 keeps them identical)",
                self.dtype,
            )
        for name, path in config.lora_modules:
            self._lora().add(name, path)
        self._requests: dict[str, Request] = {}
        self._num_sent: dict[str, int] = {}
        """How many output tokens of each request were already reported."""
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self._queued_ts: dict[str, float] = {}
        self._scheduled_ts: dict[str, float] = {}
        self._iteration_tokens: list[int] = []
        self._embeddings: dict[str, bytes] = {}
        """Pooling requests' vectors from this step, until their finishing output takes them."""
        self.last_forward_s = 0.0
        self.last_step_is_decode = False
        """Whether the last step was decodes only (one token per request): for benchmarks."""
        # The load freed much more than it keeps (metadata, tokenizer documents, repack buffers).
        release_free_heap()

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, req: AddRequest) -> None:
        """Queue a request the frontend validated (izh.frontend.input_processor.validate_request).

        Nothing user-facing is checked again here: a request that breaks what the validation
        guarantees is a bug upstream, refused with an internal IzhError (500) before it touches
        any state (its ids would index the embedding table), so that it fails alone.
        """
        self._check_valid(req)
        lora_id = self._lora().acquire(req.lora_name) if req.lora_name is not None else 0
        try:
            self._add_request(req, lora_id)
        except BaseException:
            if lora_id:
                self._lora().release(lora_id)
            raise

    def _add_request(self, req: AddRequest, lora_id: int) -> None:
        params = req.sampling_params
        # bad_words become token sequences here, once, where the tokenizer is (the sampler bans them).
        params = params.with_bad_words_token_ids(
            lambda text: self.tokenizer.encode(text, add_special_tokens=False), self.vocab_size
        )
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            pooling_params=req.pooling_params,
            images=req.images,
            lora_name=req.lora_name,
            lora_id=lora_id,
        )
        if params.structured_outputs is not None:
            self._grammar_manager().add_request(req.request_id, params.structured_outputs)
        try:
            self.scheduler.add_request(request)
        except BaseException:
            if self._grammar is not None:
                self._grammar.remove(req.request_id)
            raise
        self._requests[req.request_id] = request
        self._num_sent[req.request_id] = 0
        self._queued_ts[req.request_id] = time.monotonic()

    def _check_valid(self, req: AddRequest) -> None:
        """The invariants of a validated request, cheap: O(1) plus a min/max over the prompt's and
        the params' token ids (an id past the vocabulary would fail the whole step, every request
        in it, not this one alone)."""
        problem = None
        prompt = req.prompt_token_ids
        max_tokens = req.sampling_params.max_tokens
        if req.request_id in self._requests:
            problem = "its id is already in use"
        elif req.sampling_params.n != 1:
            problem = f"n is {req.sampling_params.n}, not 1"
        elif not prompt:
            problem = "its prompt is empty"
        elif min(prompt) < 0 or max(prompt) >= self.vocab_size:
            problem = f"a prompt token id is outside [0, {self.vocab_size})"
        elif max_tokens is None:
            problem = "its max_tokens is unresolved (None)"
        elif max_tokens > context_room(self.max_model_len, len(prompt)):
            problem = (
                f"its {len(prompt)} prompt tokens and max_tokens {max_tokens} exceed {self.max_model_len}"
            )
        elif req.sampling_params.max_token_id() >= self.vocab_size:
            problem = f"a sampling params token id is outside [0, {self.vocab_size})"
        elif req.pooling_params is not None and max_tokens != 0:
            problem = f"it pools, but max_tokens is {max_tokens}, not 0"
        elif req.pooling_params is None and self.runner.is_encoder:
            problem = "this model is an encoder: it only takes pooling requests"
        elif req.pooling_params is not None and req.pooling_params.task != self.pooling_task:
            problem = f"it asks the pooling task {req.pooling_params.task!r} of a {self.pooling_task!r} model"
        elif (
            req.pooling_params is not None
            and req.pooling_params.segment_start is not None
            and req.pooling_params.segment_start >= len(prompt)
        ):
            problem = f"its segment_start {req.pooling_params.segment_start} is past its {len(prompt)} tokens"
        elif (
            req.pooling_params is not None
            and req.pooling_params.dimensions is not None
            and req.pooling_params.dimensions > self.runner.model_config.hidden_size
        ):
            problem = f"dimensions {req.pooling_params.dimensions} > {self.runner.model_config.hidden_size}"
        elif req.images:
            problem = self.runner.check_images(req.images, prompt)
        if problem is not None:
            raise IzhError(f"internal error: request {req.request_id!r} was not validated: {problem}")

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        live = [r for r in request_ids if r in self._requests]
        aborted = self.scheduler.abort_requests(live)
        outputs = [self._make_output(r, "abort") for r in aborted]
        for r in aborted:
            self._forget(r.request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One engine iteration; returns the outputs of requests that got tokens or finished."""
        sched = self.scheduler.schedule()
        if sched.total_num_scheduled_tokens == 0:
            self.runner.remove_requests(sched.finished_request_ids)
            return []
        self._mark_scheduled(sched)
        runner_out = self.runner.execute(
            sched, self._grammar, self.draft.draft_probs if self.draft is not None else None
        )
        self.last_forward_s = runner_out.forward_s
        self.last_step_is_decode = sched.total_num_scheduled_tokens == len(sched.scheduled)
        self._iteration_tokens.append(sched.total_num_scheduled_tokens)
        if runner_out.prompt_logprobs:
            self._record_prompt_logprobs(sched, runner_out.prompt_logprobs)
        if runner_out.embeddings:
            self._embeddings.update(runner_out.embeddings)
        changed = self.scheduler.update_from_output(sched, runner_out.sampled_token_ids)
        failed: dict[str, str] = {}
        if self._grammar is not None and self._grammar.num_requests:
            failed = self._advance_grammars(changed, runner_out.sampled_token_ids)
        outputs = []
        for request in changed:
            if request.request_id in failed:
                outputs.append(self._make_output(request, "error"))
                outputs[-1].error = failed[request.request_id]
                outputs[-1].error_code = 500
                self._forget(request.request_id)
                continue
            finish_reason = _FINISH_REASONS.get(request.status)
            outputs.append(
                self._make_output(request, finish_reason, runner_out.logprobs.get(request.request_id))
            )
            if finish_reason is not None:
                self._forget(request.request_id)
        if self.proposer is not None or self.draft is not None:
            self._propose()
        return outputs

    def _propose(self) -> None:
        """Give each running request at its decode its drafts for the next step, unless drafting pauses
        (more running requests than disable_by_batch_size) or the request cannot take drafts."""
        spec = self.config.speculative
        assert spec is not None
        if self.draft is not None:
            self.draft.draft_probs = {}
        running = self.scheduler.running
        if spec.disable_by_batch_size is not None and len(running) > spec.disable_by_batch_size:
            return
        # The step's rows stay within what the fused decode stack takes, so that each is a decode's row.
        rows_left = (self.runner.max_decode_rows or sys.maxsize) - len(running)
        wanted: list[tuple[Request, int]] = []
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1 or not self._may_draft(request):
                continue
            # Room for the drafts and the token after them: max_tokens, and KV slots within max_model_len.
            room = min(
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens,
                rows_left,
            )
            request.spec_token_ids = []  # drafts not verified last step are stale
            if self.proposer is not None:
                self._set_draft(request, self.proposer.propose(request.all_token_ids, room))
                rows_left -= len(request.spec_token_ids)
            elif room > 0:
                wanted.append((request, min(room, spec.num_speculative_tokens)))
                rows_left -= wanted[-1][1]
        if wanted:
            self._propose_with_draft_model(wanted)

    def _propose_with_draft_model(self, wanted: list[tuple[Request, int]]) -> None:
        """One batched drafting round of the draft model. Each request first takes KV slots up to its last
        draft's position (the draft writes its KV there before the scheduler sees the drafts); one that
        cannot get them drafts nothing this time."""
        draft = self.draft
        assert draft is not None
        kv = self.kv_cache_manager
        batch = []
        for request, num_drafts in wanted:
            block_ids = kv.get_block_ids(request.request_id)
            if not draft.worth_drafting(request, block_ids) or kv.allocate_slots(request, num_drafts) is None:
                continue
            generator = self.runner.generator(request.request_id, request.sampling_params)
            batch.append(DraftRequest(request, num_drafts, kv.get_block_ids(request.request_id), generator))
        proposed = draft.propose(batch)
        for d in batch:
            self._set_draft(d.request, proposed[d.request.request_id])
            if not d.request.spec_token_ids:
                kv.trim(d.request)  # a grammar cut every draft: the slots taken for them go back

    def _set_draft(self, request: Request, draft: list[int]) -> None:
        """A constrained request's draft is cut where its grammar rejects a token."""
        grammar = self._grammar
        if draft and grammar is not None and grammar.has_grammar(request.request_id):
            draft = draft[: grammar.valid_draft_length(request.request_id, draft)]
        request.spec_token_ids = draft

    @staticmethod
    def _may_draft(request: Request) -> bool:
        """Drafts go to generating requests that did not opt out (a structured output's drafts are cut
        where its grammar rejects a token, before they are verified)."""
        return (
            request.sampling_params.speculative_decoding
            and not request.is_pooling
            and not request.is_prompt_only
        )

    def _record_prompt_logprobs(
        self, sched: SchedulerOutput, chunks: dict[str, list[TokenLogprobs | None]]
    ) -> None:
        """Append each request's chunk of prompt logprobs (entry i is prompt token i's)."""
        for s in sched.scheduled:
            request_id = s.request.request_id
            entries = chunks.get(request_id)
            if entries is None or self._num_sent.get(request_id, 0):
                continue  # none asked, or sent with the first token already (a recomputation)
            recorded = self._prompt_logprobs.setdefault(request_id, [])
            # A preempted request recomputes from its first token: drop what the lost run recorded.
            start = s.num_computed_tokens_before
            del recorded[start + 1 if start else 0 :]
            recorded.extend(entries)

    def _advance_grammars(self, changed: list[Request], sampled: dict[str, list[int]]) -> dict[str, str]:
        """Feed the sampled tokens to each constrained request's matcher; a grammar that reached its
        end finishes its request with "stop", one that failed fails its request alone."""
        grammar = self._grammar
        assert grammar is not None
        failed: dict[str, str] = {}
        finished: list[str] = []
        for request in changed:
            request_id = request.request_id
            if not grammar.has_grammar(request_id) or request.is_finished:
                continue
            if not grammar.accept_tokens(request_id, sampled.get(request_id, [])):
                failed[request_id] = f"structured output failed: {grammar.error(request_id)}"
            elif grammar.is_terminated(request_id):
                finished.append(request_id)
        if failed:
            self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        if finished:
            self.scheduler.finish_requests(finished, RequestStatus.FINISHED_STOPPED)
        return failed

    def _grammar_manager(self) -> GrammarManager:
        if self._grammar is None:
            self._grammar = GrammarManager(
                self.tokenizer, self.vocab_size, max_num_rows=self.config.max_num_seqs
            )
        return self._grammar

    def _grammar_ready(self, request: Request) -> bool:
        return self._grammar is None or self._grammar.is_ready(request.request_id)

    def _mark_scheduled(self, sched: SchedulerOutput) -> None:
        """Record when each request was first scheduled (for the queue and prefill metrics)."""
        now = time.monotonic()
        for s in sched.scheduled:
            self._scheduled_ts.setdefault(s.request.request_id, now)

    def _make_output(
        self,
        request: Request,
        finish_reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> EngineOutput:
        sent = self._num_sent.get(request.request_id, 0)
        new_token_ids = request.output_token_ids[sent:]
        self._num_sent[request.request_id] = request.num_output_tokens
        prompt_logprobs = None
        embedding = None
        queued_ts = scheduled_ts = 0.0
        # The prompt's results go with the first output: its first token or, for a prompt-only
        # request, its end.
        if sent == 0 and (new_token_ids or (request.is_prompt_only and finish_reason == "length")):
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id, None)
            embedding = self._embeddings.pop(request.request_id, None)
            queued_ts = self._queued_ts.get(request.request_id, 0.0)
            scheduled_ts = self._scheduled_ts.get(request.request_id, 0.0)
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            # A stop condition may cut a verified step's tokens short: their logprobs go with them.
            new_logprobs=logprobs[: len(new_token_ids)] if logprobs is not None and new_token_ids else None,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            queued_ts=queued_ts,
            scheduled_ts=scheduled_ts,
            embedding=embedding,
        )

    def _forget(self, request_id: str) -> None:
        self.runner.remove_requests([request_id])
        if self.draft is not None:
            self.draft.forget(request_id)
        if self._grammar is not None:
            self._grammar.remove(request_id)
        request = self._requests.pop(request_id, None)
        if request is not None and request.lora_id:
            self._lora().release(request.lora_id)
        self._num_sent.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self._embeddings.pop(request_id, None)
        self._queued_ts.pop(request_id, None)
        self._scheduled_ts.pop(request_id, None)

    # --- utilities ------------------------------------------------------------------------------

    @property
    def pooling_task(self) -> str:
        """What this model's pooling requests do: "score" (a cross-encoder) or "embed"."""
        return "embed" if self.runner.score_activation is None else "score"

    def embedding_info(self) -> dict[str, Any]:
        """What the frontend needs to know to validate pooling requests (Ready's pooling fields)."""
        pooling = self.runner.pooling
        return {
            "can_generate": not self.runner.is_encoder,
            "pooling_task": self.pooling_task,
            "hidden_size": self.runner.model_config.hidden_size,
            "pooling_type": pooling.pooling_type,
            "normalize_embeddings": pooling.normalize,
            "matryoshka_dimensions": pooling.matryoshka_dimensions,
        }

    def _lora(self) -> LoraManager:
        lora = self.runner.lora
        if lora is None:
            raise LoraAdapterError(
                "LoRA is off in this server: start it with --lora-modules or --enable-lora", param="model"
            )
        return lora

    def kv_cache_info(self) -> dict[str, Any]:
        """Ready's KV cache fields: the format in force, bytes per token and tokens per GiB."""
        runner = self.runner
        if runner.is_encoder:
            return {"kv_cache_dtype": self.kv_cache_dtype}
        return {
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_token": runner.kv_bytes_per_token(),
            "kv_tokens_per_gib": runner.kv_tokens_per_gib(),
        }

    def lora_info(self) -> dict[str, Any]:
        """Ready's LoRA fields: the adapters loaded at start and the slot limits (max_loras 0: off)."""
        lora = self.runner.lora
        if lora is None:
            return {}
        return {
            "lora_adapters": [(a.name, a.path) for a in lora.loaded()],
            "max_loras": lora.max_loras,
            "max_lora_rank": lora.max_lora_rank,
        }

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Register the PEFT adapter at `path` as `name`: {"name", "path", "rank"}, or for a refusal
        {"error", "status", "code"} (a bad folder, a rank above max_lora_rank, a name in use: 400s)."""
        try:
            loaded = self._lora().add(name, path)
        except IzhError as exc:
            return {"error": exc.message, "status": exc.status_code, "code": exc.code, "param": exc.param}
        return {"name": loaded.name, "path": loaded.path, "rank": loaded.rank}

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unregister `name` ({} or {"error", "status", "code"}; 404 when it is not loaded). Requests
        already running on it finish with it."""
        try:
            self._lora().remove(name)
        except IzhError as exc:
            return {"error": exc.message, "status": exc.status_code, "code": exc.code, "param": exc.param}
        return {}

    def make_stats(self) -> SchedulerStats:
        s = self.scheduler.make_stats()
        iteration_tokens, self._iteration_tokens = self._iteration_tokens, []
        return SchedulerStats(
            num_running=s["num_running"],
            num_waiting=s["num_waiting"],
            kv_cache_usage=self.kv_cache_manager.usage,
            num_blocks=self.num_blocks,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_preemptions=s["num_preemptions"],
            num_steps=s["num_steps"],
            num_prompt_tokens=s["num_prompt_tokens"],
            num_generation_tokens=s["num_generation_tokens"],
            iteration_tokens=iteration_tokens,
            running_lora_adapters=s["running_lora_adapters"],
            waiting_lora_adapters=s["waiting_lora_adapters"],
            max_loras=self.scheduler.max_loras,
            spec_decode_num_drafts=s["spec_decode_num_drafts"],
            spec_decode_num_draft_tokens=s["spec_decode_num_draft_tokens"],
            spec_decode_num_accepted_tokens=s["spec_decode_num_accepted_tokens"],
            spec_decode_num_accepted_tokens_per_pos=s["spec_decode_num_accepted_tokens_per_pos"],
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def kv_block_states(self) -> list[int]:
        return self.kv_cache_manager.block_states()

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()
        self.runner.shutdown()
