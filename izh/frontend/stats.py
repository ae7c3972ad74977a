"""Per-request metrics and the StatLogger plug point that AsyncLLM feeds.

Frontend times (`arrival_time`, `first_token_time`, `last_token_time`, `finished_time`) come from
`time.monotonic()` in the API process. The engine's `queued_ts` / `scheduled_ts` come from the core's
`time.monotonic()`: the same system-wide clock on one machine, so intervals across the two are
meaningful (0.0 means "not reported").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from izh.engine_messages import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestMetrics:
    """What one request took; handed to every StatLogger when it finishes."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    n: int = 1
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    finished_time: float = 0.0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    lora_name: str | None = None
    """The LoRA adapter the request ran with (None: the base model)."""


@runtime_checkable
class StatLogger(Protocol):
    """Receives metrics from AsyncLLM, on the event loop; must be fast and must not raise."""

    def on_new_tokens(self, request_id: str, num_tokens: int, now: float, is_first: bool) -> None:
        """`num_tokens` new output tokens of one request arrived at `now` (monotonic); `is_first`
        on the request's first ones (time to first token), later ones give inter-token latency."""
        ...

    def on_request_finished(self, m: RequestMetrics) -> None:
        """The request ended (any finish reason, errors included)."""
        ...

    def on_scheduler_stats(self, s: SchedulerStats) -> None:
        """The core's latest scheduler stats (at most every ~50 ms, and when it goes idle)."""
        ...


class StatLoggers:
    """Fans each event out to every registered logger; a failing logger is logged, not raised."""

    __slots__ = ("loggers",)

    def __init__(self, loggers: Sequence[StatLogger] = ()) -> None:
        self.loggers = list(loggers)

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def on_new_tokens(self, request_id: str, num_tokens: int, now: float, is_first: bool) -> None:
        for stat_logger in self.loggers:
            try:
                stat_logger.on_new_tokens(request_id, num_tokens, now, is_first)
            except Exception:
                logger.exception("request %s: stat logger %r failed", request_id, stat_logger)

    def on_request_finished(self, m: RequestMetrics) -> None:
        for stat_logger in self.loggers:
            try:
                stat_logger.on_request_finished(m)
            except Exception:
                logger.exception("request %s: stat logger %r failed", m.request_id, stat_logger)

    def on_scheduler_stats(self, s: SchedulerStats) -> None:
        for stat_logger in self.loggers:
            try:
                stat_logger.on_scheduler_stats(s)
            except Exception:
                logger.exception("stat logger %r failed on scheduler stats", stat_logger)
