"""A stand-in for SamplingParams with just the fields the pure-Python engine state reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Params:
    """Stand-in for izh.sampling_params.SamplingParams with the fields the engine state reads."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    prompt_logprobs: int | None = None
