"""Grammar-constrained decoding: one llguidance matcher per request, batched token bitmasks.

Grammars compile in a worker thread, off the engine's hot path; the scheduler holds a request whose
grammar is still compiling (`is_ready`). Each step the engine fills one bitmask row per sampling
row (`fill_bitmask`), the sampler masks the logits with it (`apply_bitmask`), and the sampled token
advances the request's matcher (`accept_tokens`).

EOS follows the grammar: while the grammar is incomplete EOS is masked; once it is complete EOS is
allowed (and is the only token allowed when the grammar cannot go on). A grammar that cannot go
on is `is_terminated`: the request finishes with "stop" without needing the EOS step. A matcher
error (a token the grammar rejects, a grammar llguidance cannot build) fails that request alone.

A request whose output holds JSON also has a bounds matcher (izh.guided_spec.bounds_grammar: the
same output with every JSON number and whitespace run bounded), and its bitmask row is the AND of
both. Should the AND ever leave no token (a schema that demands a longer lexeme than the bounds
allow), the request drops its bounds and goes on under its grammar alone.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from izh.guided_spec import SpecKey, bounds_grammar, build_ll_tokenizer, compile_grammar, spec_key
from izh.sampling_params import StructuredOutputsParams
from izh.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["GrammarManager", "apply_bitmask", "bitmask_words"]

_NEG_INF = float("-inf")
# Short errors: the verbose ones dump the parser state and the whole grammar into the message.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# The unpacking below reads each int32 word as 4 bytes, lowest byte first.
assert sys.byteorder == "little", "grammar bitmasks assume a little-endian host"


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id, id i in word i // 32, bit i % 32."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, every logit whose bit is 0 in `bitmask` [num_rows, words] int32.

    Logit columns past the bitmask's width are disallowed too. Written in plain torch rather than
    llguidance.torch's helper, which goes through torch.compile on first use (a compile stall on
    the hot path, and a C++ toolchain on CPU hosts).
    """
    num_rows, vocab_size = logits.shape
    if bitmask.shape[0] != num_rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {num_rows} logit rows")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [num_rows, words * 4]
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [num_rows, words * 4, 8]
    allowed = bits.view(num_rows, -1)[:, :vocab_size].bool()  # [num_rows, <= vocab_size]
    if allowed.shape[1] < vocab_size:
        logits[:, allowed.shape[1] :] = _NEG_INF
        logits = logits[:, : allowed.shape[1]]
    logits.masked_fill_(~allowed, _NEG_INF)
    return logits


@dataclass(frozen=True, slots=True)
class _Templates:
    """A spec's compiled matchers, never advanced: requests get deep copies."""

    grammar: llguidance.LLMatcher
    bounds: llguidance.LLMatcher | None


@dataclass(slots=True)
class _GuidedRequest:
    """One request's grammar: the compiled templates while compiling, then its own matchers."""

    compiled: Future[_Templates]
    matcher: llguidance.LLMatcher | None = None
    bounds: llguidance.LLMatcher | None = None
    """The lexeme bounds on the request's JSON, while they hold (see the module docstring)."""
    compile_error: str | None = None


class GrammarManager:
    """The engine's structured-output state: compiled grammars (LRU by spec) and request matchers.

    Called from the engine thread only; the worker thread only compiles. Requests never added (or
    already removed) have no grammar: they are ready, never terminated, accept every token.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        max_num_rows: int = 256,
        cache_size: int = 128,
        executor: Executor | None = None,
    ) -> None:
        """`vocab_size` is the logits width (it may exceed the tokenizer's vocabulary; the extra
        ids are never allowed). `executor` compiles grammars; by default one worker thread."""
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size)
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="izh-grammar")
        self._mask_executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[SpecKey, Future[_Templates]] = OrderedDict()
        self._requests: dict[str, _GuidedRequest] = {}
        self._bitmask = _allocate_bitmask(max_num_rows, bitmask_words(vocab_size))
        self._bounds_bitmask = _allocate_bitmask(max_num_rows, bitmask_words(vocab_size))

    # ---- request lifecycle -----------------------------------------------------------------

    def add_request(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Start (or reuse) the compilation of `spec`'s grammar for `request_id`; returns at once."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already has a grammar")
        self._requests[request_id] = _GuidedRequest(self._compile_async(spec))

    def is_ready(self, request_id: str) -> bool:
        """Whether the request's grammar is compiled (always true for a request without one)."""
        state = self._requests.get(request_id)
        if state is None:
            return True
        if state.matcher is None and state.compile_error is None and not state.compiled.done():
            return False
        self._materialize(state)
        return True

    def remove(self, request_id: str) -> None:
        """Forget the request's matcher (finished, aborted or failed); unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_cached_grammars(self) -> int:
        return len(self._compiled)

    # ---- one step ---------------------------------------------------------------------------

    def fill_bitmask(self, request_ids: list[str | None]) -> torch.Tensor | None:
        """The bitmask [len(request_ids), words] int32 (CPU) for one batch of sampling rows.

        Row i constrains request_ids[i] (its grammar AND its JSON bounds); a None row allows every
        token. None when no row has a grammar. The tensor is a view of a reused buffer, valid until
        the next call. A row whose grammar is still compiling waits for it (the scheduler should
        hold such requests).
        Raises KeyError for an id that was never added: a silently unconstrained row would be
        the worst failure.
        """
        if all(request_id is None for request_id in request_ids):
            return None
        bitmask, bounds_bitmask = self._bitmask_rows(len(request_ids))
        bitmask.fill_(-1)
        rows: list[tuple[llguidance.LLMatcher, int]] = []
        bounded: list[tuple[llguidance.LLMatcher, int]] = []
        bounded_ids: list[str] = []
        for row, request_id in enumerate(request_ids):
            if request_id is None:
                continue
            state = self._state(request_id)
            matcher = self._ready_matcher(state)
            if matcher is None:
                self._fill_eos_only(bitmask[row])
                continue
            rows.append((matcher, row))
            if state.bounds is not None:
                bounded.append((state.bounds, row))
                bounded_ids.append(request_id)
        if rows:
            self._compute_masks(rows, bitmask)
        if bounded:
            self._compute_masks(bounded, bounds_bitmask)
            self._apply_bounds(bitmask, bounds_bitmask, [row for _, row in bounded], bounded_ids)
        return bitmask

    def valid_draft_length(self, request_id: str, draft: list[int]) -> int:
        """How many leading tokens of `draft` the request's grammar (and JSON bounds) would accept from
        its current state, without advancing it: a draft token the grammar forbids is cut before it is
        verified. len(draft) for a request without a grammar; 0 while it compiles or failed."""
        state = self._requests.get(request_id)
        if state is None or not draft:
            return len(draft)
        matcher = self._ready_matcher(state)
        if matcher is None or matcher.is_error() or matcher.is_stopped():
            return 0
        length = matcher.validate_tokens(draft)
        if state.bounds is not None and not state.bounds.is_stopped():
            length = min(length, state.bounds.validate_tokens(draft))
        return length

    def fill_bitmask_drafts(
        self, entries: list[tuple[str | None, list[int]]]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """`fill_bitmask` for a step with drafts: entry e (a request id or None, and its draft) has
        len(draft) + 1 rows, row j the mask after the request's grammar took draft[:j]. The matchers are
        advanced over the drafts to compute the rows, then rolled back.

        Returns the bitmask (None when no entry has a grammar) and, per entry, how many of its drafts
        the rows hold: fewer than len(draft) where the grammar or its bounds reject a draft token, or
        where the bounds would leave no token (the step then ends at the row before, and the bounds are
        dropped when the request really reaches that state, as without drafts).
        """
        lengths = [len(draft) for _, draft in entries]
        if all(request_id is None for request_id, _ in entries):
            return None, lengths
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length + 1)
        bitmask, bounds_bitmask = self._bitmask_rows(starts[-1])
        bitmask.fill_(-1)
        live: list[tuple[int, _GuidedRequest, llguidance.LLMatcher]] = []
        for e, (request_id, _) in enumerate(entries):
            if request_id is None:
                continue
            state = self._state(request_id)
            matcher = self._ready_matcher(state)
            if matcher is None:
                self._fill_eos_only(bitmask[starts[e]])
                lengths[e] = 0
                continue
            live.append((e, state, matcher))
        consumed = dict.fromkeys((e for e, _, _ in live), 0)
        bounds_consumed = dict.fromkeys((e for e, _, _ in live), 0)
        try:
            depth = 0
            while True:
                at_depth = [(e, state, matcher) for e, state, matcher in live if lengths[e] >= depth]
                if not at_depth:
                    break
                self._compute_masks([(m, starts[e] + depth) for e, _, m in at_depth], bitmask)
                bounded = [(e, state) for e, state, _ in at_depth if state.bounds is not None]
                for e, state in bounded:
                    row = starts[e] + depth
                    assert state.bounds is not None
                    self._compute_masks([(state.bounds, row)], bounds_bitmask)
                    both = bitmask[row] & bounds_bitmask[row]
                    if bool((both != 0).any()):
                        bitmask[row] = both
                    elif depth == 0:
                        logger.info(
                            "request %s: its grammar needs a JSON lexeme past the bounds; going on without them",
                            entries[e][0],
                        )
                        state.bounds = None
                    else:
                        lengths[e] = depth - 1  # that state is decided when the request gets there
                for e, state, matcher in at_depth:
                    if lengths[e] <= depth:
                        continue
                    token = entries[e][1][depth]
                    if matcher.is_stopped() or not matcher.consume_token(token):
                        lengths[e] = depth
                        continue
                    consumed[e] += 1
                    if matcher.is_stopped():
                        # The draft ends the grammar: it must be the step's own token, the last one.
                        lengths[e] = depth
                        continue
                    bounds = state.bounds
                    if bounds is not None and not bounds.is_stopped():
                        if not bounds.consume_token(token):
                            lengths[e] = depth
                            continue
                        bounds_consumed[e] += 1
                depth += 1
        finally:
            for e, state, matcher in live:
                if consumed[e]:
                    matcher.rollback(consumed[e])
                if bounds_consumed[e] and state.bounds is not None:
                    state.bounds.rollback(bounds_consumed[e])
        return bitmask, lengths

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """The module's `apply_bitmask`, for callers that hold a GrammarManager."""
        return apply_bitmask(logits, bitmask)

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's matcher over `token_ids`; False when the grammar rejects one
        (then `error` says why and the request must fail). Tokens after the grammar's end
        (the final EOS) are ignored."""
        state = self._requests.get(request_id)
        if state is None:
            return True
        matcher = self._ready_matcher(state)
        if matcher is None or matcher.is_error():
            return False
        for token_id in token_ids:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(token_id):
                logger.warning(
                    "request %s: grammar rejected token %d: %s", request_id, token_id, matcher.get_error()
                )
                return False
            self._advance_bounds(request_id, state, token_id)
        return True

    @staticmethod
    def _advance_bounds(request_id: str, state: _GuidedRequest, token_id: int) -> None:
        """Feed `token_id` to the request's bounds; ones that reject it (the token came from a mask
        they did not shape) are dropped, never failing the request."""
        bounds = state.bounds
        if bounds is None or bounds.is_stopped():
            return
        if not bounds.consume_token(token_id):
            logger.info(
                "request %s: JSON bounds rejected token %d; going on without them", request_id, token_id
            )
            state.bounds = None

    def is_terminated(self, request_id: str) -> bool:
        """Whether the grammar has reached its end: nothing but EOS may follow, so the request is done."""
        state = self._requests.get(request_id)
        if state is None or not self.is_ready(request_id) or state.matcher is None:
            return False
        return state.matcher.is_stopped() and not state.matcher.is_error()

    def error(self, request_id: str) -> str | None:
        """Why the request's grammar failed (compilation or a rejected token), or None."""
        state = self._requests.get(request_id)
        if state is None or not self.is_ready(request_id):
            return None
        if state.compile_error is not None:
            return state.compile_error
        assert state.matcher is not None
        return state.matcher.get_error() or None

    # ---- housekeeping -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The grammar cache stays within its size; every materialized request has one outcome."""
        assert len(self._compiled) <= self.cache_size, (len(self._compiled), self.cache_size)
        for request_id, state in self._requests.items():
            assert state.matcher is None or state.compile_error is None, request_id
            assert state.bounds is None or state.matcher is not None, request_id

    def shutdown(self) -> None:
        """Stop the compile thread (pending compilations are dropped)."""
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- internals --------------------------------------------------------------------------

    def _compile_async(self, spec: StructuredOutputsParams) -> Future[_Templates]:
        key = spec_key(spec)
        future = self._compiled.get(key)
        if future is not None and not future.cancelled():
            self._compiled.move_to_end(key)
            return future
        future = self._executor.submit(self._compile, spec)
        self._compiled[key] = future
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> _Templates:
        """The template matchers of `spec`. Runs in the worker thread. A grammar error leaves the
        grammar matcher in its error state rather than raising; bounds that llguidance cannot build
        (a client grammar whose %json blocks sit where a nested grammar may not) are left out."""
        grammar = llguidance.LLMatcher(self.ll_tokenizer, compile_grammar(spec), log_level=0, limits=_LIMITS)
        bounds_text = bounds_grammar(spec)
        bounds = None
        if bounds_text is not None and not grammar.is_error():
            bounds = llguidance.LLMatcher(self.ll_tokenizer, bounds_text, log_level=0, limits=_LIMITS)
            if bounds.is_error():
                logger.warning("no JSON bounds for a %s spec: %s", spec_key(spec)[0], bounds.get_error())
                bounds = None
        return _Templates(grammar, bounds)

    def _compute_masks(self, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] with each matcher's allowed tokens (in llguidance's thread pool)."""
        words = bitmask.shape[1]
        self._mask_executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, bitmask.shape[0])

    def _apply_bounds(
        self, bitmask: torch.Tensor, bounds_bitmask: torch.Tensor, rows: list[int], request_ids: list[str]
    ) -> None:
        """AND the bounds rows into the grammar rows; a row the AND would empty keeps its grammar's
        mask, and its request drops its bounds."""
        index = torch.tensor(rows, dtype=torch.int64)
        both = bitmask[index] & bounds_bitmask[index]  # [len(rows), words]
        possible = (both != 0).any(dim=1)
        bitmask[index[possible]] = both[possible]
        for k in (~possible).nonzero().flatten().tolist():
            logger.info(
                "request %s: its grammar needs a JSON lexeme past the bounds; going on without them",
                request_ids[k],
            )
            self._requests[request_ids[k]].bounds = None

    def _materialize(self, state: _GuidedRequest) -> None:
        """Give a request whose grammar is compiled its own matcher (or its compile error)."""
        if state.matcher is not None or state.compile_error is not None:
            return
        try:
            templates = state.compiled.result()
        except Exception as exc:  # InvalidRequest from compile_grammar, or an llguidance failure
            state.compile_error = f"grammar compilation failed: {exc}"
            return
        state.matcher = templates.grammar.deep_copy()
        if templates.bounds is not None:
            state.bounds = templates.bounds.deep_copy()

    def _ready_matcher(self, state: _GuidedRequest) -> llguidance.LLMatcher | None:
        """The request's matcher, waiting for its compilation if need be; None if that failed."""
        self._materialize(state)
        return state.matcher

    def _fill_eos_only(self, row: torch.Tensor) -> None:
        # A failed request samples once more before the engine fails it: never from an empty mask.
        row.zero_()
        for token_id in self.ll_tokenizer.eos_tokens:
            row[token_id // 32] |= _bit(token_id % 32)

    def _state(self, request_id: str) -> _GuidedRequest:
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id} has no grammar; call add_request first")
        return state

    def _bitmask_rows(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The grammar and the bounds bitmask buffers, num_rows rows each."""
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = _allocate_bitmask(num_rows, self._bitmask.shape[1])
            self._bounds_bitmask = _allocate_bitmask(num_rows, self._bitmask.shape[1])
        return self._bitmask[:num_rows], self._bounds_bitmask[:num_rows]


def _allocate_bitmask(num_rows: int, words: int) -> torch.Tensor:
    # Pinned when a GPU is present, so the host-to-device copy in apply_bitmask is asynchronous.
    # Reusing the buffer next step is safe: reading the sampled tokens synchronizes the stream.
    pin = torch.cuda.is_available()
    return torch.full((num_rows, words), -1, dtype=torch.int32, pin_memory=pin)  # [num_rows, words]


def _bit(index: int) -> int:
    """The int32 word with only bit `index` set (bit 31 is the sign bit)."""
    return -(2**31) if index == 31 else 1 << index
