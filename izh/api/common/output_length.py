"""How many tokens a request asks to generate, read one way for every reader: the guard's limits and
rate-limit estimate (raw JSON, before validation) and the routes' sampling params (validated bodies).

OpenAI's chat API names the output length `max_completion_tokens` and keeps `max_tokens` as its
deprecated alias: the first wins when both are set. Legacy completions have `max_tokens` only, the
Responses API `max_output_tokens`. The room a prompt leaves in the context is
izh.sampling_params.context_room.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OUTPUT_LENGTH_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
"""The fields that set the output length, the winner first."""


def requested_output_length(body: Any) -> tuple[str, Any] | None:
    """(field, value) of the output length `body` asks for: its first field of OUTPUT_LENGTH_FIELDS
    that is set (null is unset); None when it sets none. `body` is a JSON object (a dict; its values
    unchecked) or a validated request model (its attributes)."""
    for name in OUTPUT_LENGTH_FIELDS:
        value = body.get(name) if isinstance(body, Mapping) else getattr(body, name, None)
        if value is not None:
            return name, value
    return None
