"""Turn the core's per-step token ids into per-request text deltas: detokenize, stop strings, logprobs.

The core knows no text, so stop strings are found here (vLLM's semantics). Each new delta is
searched together with the last (max stop length - 1) characters before it, so a stop string split
across tokens is caught. Unless `include_stop_str_in_output`, those last characters are held back
from the stream while a stop string could still be completing, so nothing after (or of) a stop
string ever leaks into a delta; they are released when the request ends otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from izh.engine_messages import EngineOutput, TokenLogprobs
from izh.frontend.stats import RequestMetrics
from izh.sampling_params import SamplingParams
from izh.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprob:
    """One token with its logprob, as the API shows it."""

    token_id: int
    token: str
    """The token's text; "bytes:\\xe2\\x80" style when its bytes are not valid UTF-8 on their own."""
    logprob: float
    token_bytes: list[int]


@dataclass(slots=True)
class PositionLogprobs:
    """The logprobs of one position: the chosen (or prompt) token, its rank and the top-N."""

    chosen: TokenLogprob
    rank: int
    top: list[TokenLogprob]


@dataclass(slots=True)
class RequestOutput:
    """What one request got since its previous output (text, token ids and logprobs are deltas)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """stop | length | abort | error (None until finished)."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if one did."""
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Only on the request's first output."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Cumulative, like the next two."""
    num_cached_tokens: int = 0
    error: str | None = None
    """For finish_reason "error": why the request failed."""
    error_code: int = 0
    embedding: bytes | None = None
    """An embedding request's vector (little-endian float32), on its finished output."""

    def merge(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this undelivered one."""
        if later.embedding is not None:
            self.embedding = later.embedding
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        self.error = later.error
        self.error_code = later.error_code


@dataclass(slots=True)
class RequestState:
    """The frontend's running state of one request (made by OutputProcessor.make_request_state)."""

    request_id: str
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop_str_in_output: bool
    min_tokens: int
    stop_token_ids: frozenset[int]
    """The ids whose sampling ends the request as "stop" without being text: EOS (unless
    ignore_eos) and stop_token_ids. A grammar's last token also ends it as "stop", but is text."""
    want_logprobs: bool
    window_len: int
    """max stop length - 1: how far back a stop string completed by new text can start."""
    metrics: RequestMetrics
    tail: str = ""
    """The last `window_len` characters of the text so far; unsent unless include_stop_str_in_output."""
    num_output_tokens: int = 0
    finished: bool = False
    stop_hit: bool = field(default=False)
    """A stop string ended the request (the core may still be running it)."""


class OutputProcessor:
    """Stateless over requests: the caller keeps each RequestState (one dict lookup per output)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_cache: dict[int, tuple[str, list[int]]] = {}

    def make_request_state(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float,
    ) -> RequestState:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            prompt_token_ids=prompt_token_ids,
        )
        stop = list(params.stop)
        return RequestState(
            request_id=request_id,
            detokenizer=detokenizer,
            stop=stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids),
            want_logprobs=params.logprobs is not None,
            window_len=max(map(len, stop)) - 1 if stop else 0,
            metrics=RequestMetrics(
                request_id=request_id,
                arrival_time=arrival_time,
                num_prompt_tokens=len(prompt_token_ids),
                max_tokens=params.max_tokens,
                n=params.n,
            ),
        )

    # --- the per-step path ----------------------------------------------------------------------

    def process(self, state: RequestState, eo: EngineOutput, now: float) -> RequestOutput:
        """The delta for one EngineOutput of `state`'s request.

        When the result is finished but `eo.finish_reason` is None, a stop string ended the request
        and the caller must abort it in the core.
        """
        if eo.finish_reason == "error":
            return self._failed(state, eo, now)
        token_ids = eo.new_token_ids
        finish_reason = eo.finish_reason
        stop_reason = eo.stop_reason
        new_logprobs = eo.new_logprobs
        if state.stop and len(token_ids) > 1:
            # Several tokens at once (a verified speculative step): the stop strings are checked after
            # each, so the request ends at the token that completes one, as one token a step would.
            pieces = []
            for index in range(len(token_ids)):
                last = index == len(token_ids) - 1
                piece, stop_str = self._delta(
                    state, token_ids[index : index + 1], finish_reason if last else None
                )
                pieces.append(piece)
                if stop_str is not None:
                    token_ids = token_ids[: index + 1]
                    finish_reason, stop_reason = "stop", stop_str
                    state.stop_hit = True
                    break
            delta = "".join(pieces)
            if new_logprobs is not None:
                new_logprobs = new_logprobs[: len(token_ids)]
        else:
            delta, stop_str = self._delta(state, token_ids, finish_reason)
            if stop_str is not None:
                finish_reason, stop_reason = "stop", stop_str
                state.stop_hit = True
        self._record(state.metrics, eo, len(token_ids), now)
        out = RequestOutput(
            request_id=state.request_id,
            text=delta,
            token_ids=token_ids,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=state.metrics.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.metrics.num_cached_tokens,
        )
        if new_logprobs is not None and state.want_logprobs:
            out.logprobs = [self._position(lp) for lp in new_logprobs]
        if eo.prompt_logprobs is not None:
            out.prompt_logprobs = [None if lp is None else self._position(lp) for lp in eo.prompt_logprobs]
        out.embedding = eo.embedding
        if out.finished:
            self._finish(state, finish_reason, now)
        return out

    def _delta(
        self, state: RequestState, token_ids: list[int], finish_reason: str | None
    ) -> tuple[str, str | None]:
        """Count `token_ids` as output and detokenize them: the text to release, and the stop string
        they completed (None when none did)."""
        state.num_output_tokens += len(token_ids)
        # A stop token (EOS or a stop_token_id) is not part of the text (vLLM), unless asked for.
        stop_terminated = (
            finish_reason == "stop"
            and not state.include_stop_str_in_output
            and bool(token_ids)
            and token_ids[-1] in state.stop_token_ids
        )
        decode_ids = token_ids[:-1] if stop_terminated else token_ids
        if finish_reason is not None:
            # The last output also flushes a character left incomplete (as U+FFFD, like decode()).
            delta = state.detokenizer.add(decode_ids, finished=True)
        elif decode_ids:
            delta = state.detokenizer.add(decode_ids)
        else:
            delta = ""
        if state.stop:
            return self._check_stop(state, delta, finished=finish_reason is not None)
        return delta, None

    def finish(
        self,
        state: RequestState,
        finish_reason: str,
        now: float,
        *,
        error: str | None = None,
        error_code: int = 0,
    ) -> RequestOutput:
        """End a request from the frontend's side (deadline, failure): release held-back text."""
        text = ""
        if error is None:
            detokenizer = state.detokenizer
            text = "" if detokenizer.finished else detokenizer.add((), finished=True)
            if state.stop:
                # Releases the held-back tail; a stop string completed by the flush still cuts.
                text, _ = self._check_stop(state, text, finished=True)
        self._finish(state, finish_reason, now)
        return RequestOutput(
            request_id=state.request_id,
            text=text,
            token_ids=[],
            finished=True,
            finish_reason=finish_reason,
            num_prompt_tokens=state.metrics.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.metrics.num_cached_tokens,
            error=error,
            error_code=error_code,
        )

    def _failed(self, state: RequestState, eo: EngineOutput, now: float) -> RequestOutput:
        return self.finish(state, "error", now, error=eo.error or "request failed", error_code=eo.error_code)

    @staticmethod
    def _finish(state: RequestState, finish_reason: str | None, now: float) -> None:
        state.finished = True
        state.metrics.finish_reason = finish_reason
        state.metrics.finished_time = now

    @staticmethod
    def _record(m: RequestMetrics, eo: EngineOutput, num_new_tokens: int, now: float) -> None:
        if eo.num_prompt_tokens:
            m.num_prompt_tokens = eo.num_prompt_tokens
        if eo.num_cached_tokens:
            m.num_cached_tokens = eo.num_cached_tokens
        if eo.queued_ts:
            m.queued_ts = eo.queued_ts
            m.scheduled_ts = eo.scheduled_ts
        if num_new_tokens:
            if not m.first_token_time:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += num_new_tokens

    # --- stop strings ---------------------------------------------------------------------------

    @staticmethod
    def _check_stop(state: RequestState, delta: str, *, finished: bool) -> tuple[str, str | None]:
        """The text to release now, and the stop string that ended the request (or None).

        Without include_stop_str_in_output, `state.tail` is unsent and `window` = unsent text;
        with it, `state.tail` was sent already and only `delta` is unsent.
        """
        keep = state.window_len
        window = state.tail + delta
        if state.num_output_tokens > state.min_tokens and delta:
            match = _find_stop(window, state.stop, len(state.tail))
            if match is not None:
                index, stop_str = match
                if state.include_stop_str_in_output:
                    release = window[len(state.tail) : index + len(stop_str)]
                else:
                    release = window[:index]
                state.tail = ""
                return release, stop_str
        if state.include_stop_str_in_output:
            state.tail = window[-keep:] if keep else ""
            return delta, None
        if finished or not keep:
            state.tail = ""
            return window, None
        state.tail = window[-keep:]
        return window[:-keep], None

    # --- logprobs -------------------------------------------------------------------------------

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        return PositionLogprobs(
            chosen=self._token_logprob(lp.token_id, lp.logprob),
            rank=lp.rank,
            top=[self._token_logprob(token_id, logprob) for token_id, logprob in lp.top],
        )

    def _token_logprob(self, token_id: int, logprob: float) -> TokenLogprob:
        cached = self._token_cache.get(token_id)
        if cached is None:
            cached = self._token_cache[token_id] = _token_text(self.tokenizer.token_bytes(token_id))
        text, raw = cached
        return TokenLogprob(token_id=token_id, token=text, logprob=logprob, token_bytes=raw)


def _find_stop(window: str, stops: list[str], num_old_chars: int) -> tuple[int, str] | None:
    """The earliest stop string in `window` that ends inside its new part (after num_old_chars).

    Ties at one position go to the first listed. Occurrences wholly inside the old part were
    checked before (or fell under min_tokens) and do not count again.
    """
    best: tuple[int, str] | None = None
    for stop_str in stops:
        index = window.find(stop_str, max(0, num_old_chars - len(stop_str) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop_str)
    return best


def _token_text(raw: bytes) -> tuple[str, list[int]]:
    """A token's display text and bytes; OpenAI's "bytes:\\x.." form for a partial UTF-8 sequence."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
    return text, list(raw)
