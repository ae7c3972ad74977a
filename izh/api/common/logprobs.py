"""Logprobs in the API's shapes: chat's `logprobs.content`, the legacy completions lists and vLLM's
`prompt_logprobs`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from izh.api.common.chat_protocol import (
    ChatLogprobEntry,
    TopLogprob,
)
from izh.api.common.protocol import (
    CompletionLogprobs,
)

if TYPE_CHECKING:
    from izh.frontend.output_processor import PositionLogprobs

# JSON has no -inf; OpenAI's convention for "practically impossible".
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(positions: list[PositionLogprobs], top_logprobs: int) -> list[ChatLogprobEntry]:
    """Chat's `logprobs.content` entries for generated positions."""
    return [
        ChatLogprobEntry(
            token=p.chosen.token,
            logprob=_finite(p.chosen.logprob),
            bytes=p.chosen.token_bytes,
            top_logprobs=[
                TopLogprob(token=t.token, logprob=_finite(t.logprob), bytes=t.token_bytes)
                for t in p.top[:top_logprobs]
            ],
        )
        for p in positions
    ]


def append_completion_logprobs(
    into: CompletionLogprobs,
    positions: list[PositionLogprobs | None],
    num_top: int,
    text_offset: int,
    prompt_token_strs: list[str] | None = None,
) -> int:
    """Extend the legacy completions shape; returns the text offset after the last token.

    A None position (the first prompt token has no logprob) needs its token text from
    `prompt_token_strs`. Like vLLM, the chosen token is always among its position's top_logprobs.
    """
    for i, position in enumerate(positions):
        if position is None:
            token = prompt_token_strs[i] if prompt_token_strs is not None else ""
            into.tokens.append(token)
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            token = position.chosen.token
            into.tokens.append(token)
            into.token_logprobs.append(_finite(position.chosen.logprob))
            top = {t.token: _finite(t.logprob) for t in position.top[:num_top]}
            top.setdefault(token, _finite(position.chosen.logprob))
            into.top_logprobs.append(top)
        into.text_offset.append(text_offset)
        text_offset += len(token)
    return text_offset


def prompt_logprobs_json(
    positions: list[PositionLogprobs | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` response field: per position {token_id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    result: list[dict[str, Any] | None] = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        entry = {
            str(t.token_id): {"logprob": _finite(t.logprob), "rank": None, "decoded_token": t.token}
            for t in position.top
        }
        entry[str(position.chosen.token_id)] = {
            "logprob": _finite(position.chosen.logprob),
            "rank": position.rank,
            "decoded_token": position.chosen.token,
        }
        result.append(entry)
    return result
