"""`ProgressBar`: izh.LLM's progress callback drawn as a transient Rich bar on stderr.

The library reports (done, total, phase) and never draws; this is where a command (or a benchmark script)
turns that into a bar: one per phase, shown while the phase runs and gone once it completes.

    with ProgressBar() as progress:
        llm = LLM(model, progress=progress)
        llm.generate(prompts)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

MIN_TOTALS = {"generating": 16}
"""Phases shown only from this many steps: a generate() call of a few prompts draws no bar."""


class ProgressBar:
    """A callable `izh.llm.ProgressFn`: phase after phase, each as its own transient bar."""

    def __init__(self, *, min_totals: Mapping[str, int] = MIN_TOTALS, console: Console | None = None) -> None:
        self.min_totals = dict(min_totals)
        self._console = console
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._phase: str | None = None

    def __call__(self, done: int, total: int, phase: str) -> None:
        if phase != self._phase:
            self.close()
            self._phase = phase
            if total > 0 and total >= self.min_totals.get(phase, 0):
                self._start(phase)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=total)
        if done >= total:
            self.close()  # the phase is over; the next call (a new generate()) starts a new bar

    def _start(self, phase: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self._console or Console(stderr=True),
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(phase, total=None)

    def close(self) -> None:
        """Take down the bar of the phase running now, if any (a phase that failed half-way)."""
        if self._bar is not None:
            self._bar.stop()
        self._bar = self._task = self._phase = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
