"""Messages across the process boundary (frontend <-> engine core): msgspec tagged unions.

Only token ids, validated sampling params, preprocessed image pixels (raw float32 bytes), per-step
outputs and stats cross it: never text to detokenize, tensors, pickles or tokenizers.
"""

from __future__ import annotations

from typing import Any

import msgspec

from izh.pooling_params import PoolingParams
from izh.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The logprob and rank of one chosen token, plus the top-N alternatives of its position."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of tokens with a strictly greater logprob."""
    top: list[tuple[int, float]] = []


# --- frontend -> core ---------------------------------------------------------------------------


class ImageInput(msgspec.Struct, array_like=True):
    """One image of a request, preprocessed in the API process (izh.frontend.image_processor)."""

    pixel_values: bytes
    """Little-endian float32 tiles, C order, of shape `shape`."""
    shape: tuple[int, int, int, int]
    """[num_tiles, channels, tile, tile]."""
    offset: int
    """The prompt position of its first placeholder token."""
    length: int
    """Placeholder positions it spans (its `<image>` tokens and the tile separators between them)."""
    content_hash: str
    """sha256 of the image file (hex): the prefix cache keys the blocks it overlaps on it."""


class AddRequest(msgspec.Struct, tag=True, kw_only=True):
    """One generation request (n == 1: the frontend fans n > 1 out into child requests)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    """Set for an embedding request (then max_tokens is 0): the core pools its prompt's final hidden
    states and returns the vector in EngineOutput.embedding."""
    client_index: int = 0
    """Which of the core's frontends (API processes) sent it: its outputs go back to that one only
    (izh.engine.core_proc; always 0 with one frontend)."""
    images: list[ImageInput] | None = None
    """A VLM's images, in prompt order (their placeholder ranges do not overlap)."""
    lora_name: str | None = None
    """The LoRA adapter to run with (one the core has loaded); None for the base model."""


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Utility(msgspec.Struct, tag=True):
    """A call on the core answered by a UtilityResult with the same call_id.

    Methods: "ping" (heartbeat; answered by the core's input thread, even during a step, with
    `{"num_steps", "step_running_s"}`), "reset_prefix_cache", "kv_block_states", "load_lora_adapter" (name,
    path), "unload_lora_adapter" (name). (Stats are not asked for: the core publishes them on
    EngineOutputs.)
    """

    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0
    """The calling frontend, to which the UtilityResult goes (as AddRequest.client_index)."""


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | Abort | Utility | Shutdown


# --- core -> frontend ---------------------------------------------------------------------------


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request got in one step. finish_reason set means the request is over in the core."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    """stop | length | abort | error."""
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    """For finish_reason "error": why this request failed (the others go on)."""
    error_code: int = 0
    """HTTP-like status for the error (400 for a bad request found by the core)."""
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    """Monotonic engine-clock times, sent with a request's first output (for queue/prefill metrics)."""
    embedding: bytes | None = None
    """A pooling request's vector (or a cross-encoder's score), little-endian float32 (numpy's '<f4'),
    on its finishing output."""


class SchedulerStats(msgspec.Struct, kw_only=True):
    """The core's published snapshot: on an EngineOutputs at most every STATS_INTERVAL_S while busy,
    when it goes idle, and every IDLE_STATS_INTERVAL_S while idle (izh.engine.core_proc). The frontend
    keeps the latest one, so that /v1/izh/stats never waits for a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    prefix_cache_queries: int = 0
    """Cumulative, in tokens."""
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    """Cumulative prompt tokens computed (not served from the prefix cache)."""
    num_generation_tokens: int = 0
    iteration_tokens: list[int] = []
    """Tokens scheduled in each step since the last stats message."""
    kv_block_states: bytes | None = None
    """One byte per block id (0 free, 1 cached, 2 used); None when this message carries no block map
    (it rides at most every BLOCK_MAP_INTERVAL_S: building it is O(num_blocks))."""
    engine_index: int = 0
    """Which data-parallel core published it: set by the frontend on receipt (the core does not
    know its index), for per-core metrics."""
    running_lora_adapters: list[str] = []
    """The LoRA adapters of the running requests (names, sorted)."""
    waiting_lora_adapters: list[str] = []
    max_loras: int = 0
    spec_decode_num_drafts: int = 0
    """Speculative decoding, cumulative (vLLM's counters): drafts verified, their tokens, the tokens
    the target accepted, and the accepted ones by position in the draft (index 0: first draft token)."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class EngineOutputs(msgspec.Struct, tag=True, kw_only=True):
    """One step's outputs (and, at most every few ms, the scheduler stats)."""

    outputs: list[EngineOutput]
    timestamp: float
    """The core's time.monotonic() when it sent this (the same clock as the frontend's on one machine:
    the age of `stats`)."""
    stats: SchedulerStats | None = None


class Ready(msgspec.Struct, tag=True, kw_only=True):
    """The core loaded its model and serves."""

    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    kv_cache_dtype: str = ""
    """The KV cache's element format in force (izh.kernels.kv_cache_dtype; `auto` resolved)."""
    kv_bytes_per_token: int = 0
    """Bytes one token takes in the KV cache (every layer's K and V); 0 for an encoder."""
    kv_tokens_per_gib: int = 0
    """Tokens a GiB of KV cache holds (1 GiB // kv_bytes_per_token); 0 for an encoder."""
    can_generate: bool = True
    """False for an encoder (BERT): it only pools; generation requests are refused with a 400."""
    pooling_task: str = "embed"
    """What its pooling requests do (izh.pooling_params.POOLING_TASKS): "embed", or "score" for a
    cross-encoder (it scores text pairs and embeds nothing)."""
    hidden_size: int = 0
    """The size of an embedding (before `dimensions`)."""
    pooling_type: str = "last"
    """The model's pooling (model files, or the `model.pooling` setting): mean | cls | last."""
    normalize_embeddings: bool = True
    matryoshka_dimensions: list[int] | None = None
    """None: the model declares no Matryoshka training, so `dimensions` is refused; [] any size up to
    hidden_size; else the sizes it was trained for."""
    lora_adapters: list[tuple[str, str]] = []
    """The LoRA adapters loaded at start (--lora-modules): (name, path)."""
    max_loras: int = 0
    """Adapters resident at once; 0: LoRA is off (no adapter can be loaded)."""
    max_lora_rank: int = 0


class Dead(msgspec.Struct, tag=True):
    """The core failed (at start or in step()) and exits; every in-flight request fails."""

    reason: str
    error_code: str | None = None
    """The IzhError's code when one was raised (e.g. "unsupported_model"), so that the frontend raises
    the same kind of error."""


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None


EngineMessage = EngineOutputs | Ready | Dead | UtilityResult


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_input_decoder() -> msgspec.msgpack.Decoder[EngineInput]:
    return msgspec.msgpack.Decoder(EngineInput)


def make_output_decoder() -> msgspec.msgpack.Decoder[EngineMessage]:
    return msgspec.msgpack.Decoder(EngineMessage)
