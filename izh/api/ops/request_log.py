"""One structured log line per API request, on the `izh.request` logger.

Fields (also the keys of the JSON line under `logging.json`): request_id, key_id (never the key),
method, path, status, prompt_tokens, completion_tokens, cached_tokens, num_sequences,
finish_reason (comma-joined, one per sequence), ttft_s, duration_s. Prompts and outputs are added
(`prompts`, `outputs`) only when the server was asked to log them (`server.log_prompts`).

Probes and scrapes (/health, /ready, /version, /metrics) are logged at DEBUG only. A request whose
client went away before any response is logged with status 499.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from izh.frontend.async_llm import RequestScope

logger = logging.getLogger("izh.request")

QUIET_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a client that went away before the response (no response was sent)."""


@dataclass(slots=True)
class RequestRecord:
    """What the middleware knows of one request; the engine's part comes from its RequestScope."""

    request_id: str
    method: str
    path: str
    started: float
    """time.monotonic() when the request arrived."""
    key_id: str | None = None
    status: int = 0
    """The response status (0 until a response starts)."""


class RequestLogger:
    """Formats and emits the per-request line (see the module docstring)."""

    def __init__(self, *, enabled: bool = True, log_prompts: bool = False) -> None:
        self.enabled = enabled
        self.log_prompts = log_prompts

    def fields(self, record: RequestRecord, scope: RequestScope | None, now: float) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "key_id": record.key_id,
            "method": record.method,
            "path": record.path,
            "status": record.status or CLIENT_CLOSED_REQUEST,
            "duration_s": round(now - record.started, 6),
        }
        if scope is not None and scope.num_requests:
            fields.update(
                prompt_tokens=scope.num_prompt_tokens,
                completion_tokens=scope.num_output_tokens,
                cached_tokens=scope.num_cached_tokens,
                num_sequences=scope.num_requests,
                finish_reason=",".join(scope.finish_reasons) or None,
                ttft_s=round(scope.first_token_time - record.started, 6) if scope.first_token_time else None,
            )
            if self.log_prompts:
                fields.update(prompts=list(scope.prompts), outputs=list(scope.outputs))
        return fields

    def log(self, record: RequestRecord, scope: RequestScope | None) -> None:
        if not self.enabled:
            return
        level = logging.DEBUG if record.path in QUIET_PATHS else logging.INFO
        if not logger.isEnabledFor(level):
            return
        fields = self.fields(record, scope, time.monotonic())
        # The text line carries the same fields; the JSON formatter takes them from `fields`.
        text = " ".join(f"{name}={value}" for name, value in fields.items() if value is not None)
        logger.log(level, "request %s", text, extra={"fields": fields})
