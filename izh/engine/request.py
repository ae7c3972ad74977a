"""Request: one generation's engine-side state (pure Python).

Prefill and decode are not states: a request still has `num_tokens - num_computed_tokens` tokens to
compute, and it samples once that reaches zero (a prompt-only request, max_tokens 0, finishes there
instead). The status only says where the scheduler keeps it.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from izh.engine_messages import ImageInput
    from izh.pooling_params import PoolingParams
    from izh.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is. Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def is_finished(status: RequestStatus) -> bool:
    """True for the FINISHED_* statuses."""
    return status > RequestStatus.PREEMPTED


def finish_reason(status: RequestStatus) -> str | None:
    """OpenAI's finish_reason ("stop" | "length" | "abort") for a finished status, else None."""
    return _FINISH_REASONS.get(status)


@dataclass(slots=True)
class Request:
    """A prompt, its sampling params and its progress through the engine.

    `all_token_ids` is one list, the prompt followed by every output token, appended to in place so
    that the scheduler and the KV cache never copy a whole sequence on the hot path.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    _: KW_ONLY
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float
    priority: int = 0
    """Lower is served first under the "priority" policy."""
    cache_salt: str | None = None
    """Isolates this request's prefix-cache entries from other tenants'."""
    lora_name: str | None = None
    """The LoRA adapter this request runs with (None: the base model)."""
    lora_id: int = 0
    """That adapter's registration id in the core (izh.engine.lora_manager); 0 for the base model."""
    pooling_params: PoolingParams | None = None
    """Set for an embedding request (prompt-only): pooled after its prompt is computed, in one step."""
    images: list[ImageInput] | None = None
    """A VLM's images: their features replace the embeddings of their placeholder tokens in prefill,
    and their content hashes key the prefix-cache blocks those placeholders overlap."""

    output_token_ids: list[int] = field(init=False, default_factory=list)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    """Tokens whose KV is in the cache (or is being written by the step just scheduled)."""
    num_cached_tokens: int = field(init=False, default=-1)
    """Prefix-cache hit in tokens on the first schedule; -1 until the request is first scheduled."""
    stop_reason: int | str | None = field(init=False, default=None)
    """The stop token id that finished the request (None for EOS, length or abort); a stop string
    set from outside through Scheduler.finish_requests."""
    num_preemptions: int = field(init=False, default=0)
    spec_token_ids: list[int] = field(init=False, default_factory=list)
    """Draft tokens proposed for the next step (izh.engine.spec_decode); the scheduler takes them when it
    schedules the request's decode and verifies them with it, or drops them."""
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    """Chain hashes of the full blocks of `all_token_ids`, grown by the KV cache manager as blocks fill."""
    _all_token_ids: list[int] = field(init=False, repr=False, default_factory=list)
    _max_tokens: int = field(init=False, repr=False, default=sys.maxsize)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        max_tokens = self.sampling_params.max_tokens
        assert max_tokens is not None, "the frontend resolves max_tokens (input_processor.resolve_context)"
        self._max_tokens = max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids: the live list, not a copy. Read it; never mutate it."""
        return self._all_token_ids

    @property
    def max_tokens(self) -> int:
        """The output-token limit: sampling_params.max_tokens, an int the frontend resolved to fit the
        room the prompt leaves in the context (the core asserts it)."""
        return self._max_tokens

    @property
    def is_prompt_only(self) -> bool:
        """max_tokens 0: the request computes its prompt (for its prompt logprobs, or to fill the
        prefix cache) and finishes with "length" without sampling a single token."""
        return self._max_tokens == 0

    @property
    def lora_key(self) -> str | None:
        """The adapter as the prefix cache keys it: name and registration id (a name loaded again with
        other weights must not hit the old adapter's blocks); None for the base model."""
        return None if self.lora_name is None else f"{self.lora_name}#{self.lora_id}"

    @property
    def is_finished(self) -> bool:
        return is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.status)

    @property
    def is_pooling(self) -> bool:
        """An embedding request: scheduled whole (its prompt in one step, so that mean pooling sees
        every hidden state and an encoder its whole input), pooled, and finished in that step."""
        return self.pooling_params is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt token, so a prefix hit would lose them; a
        pooling request needs every hidden state it pools computed (and an encoder's KV is no causal
        prefix anyone could reuse), so it neither reads nor fills the prefix cache."""
        return (
            self.pooling_params is not None
            or getattr(self.sampling_params, "prompt_logprobs", None) is not None
        )

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
