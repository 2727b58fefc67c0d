"""Progress of long steps (build stages, tactic timing per layer, calibration, validation images), in
two modes: a live rich bar when stderr is a terminal, and in a log (stderr not a terminal) a plain
line at most every few seconds: `progress: STAGE DONE/TOTAL, elapsed Xs, about Ys left: DETAIL`.

A foundation module (rich and the standard library only), so that every layer can report through
one. docs/decisions/0031-progress-json-and-layer-profiles.md says why logs get lines, not bars."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

INTERVAL_ENVIRONMENT = "SARTOR_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 5.0  # a line every few seconds keeps a 15-minute CI build visibly alive, not noisy


def log_interval() -> float:
    """Seconds between plain progress lines ($SARTOR_PROGRESS_INTERVAL; 0: every update)."""
    value = os.environ.get(INTERVAL_ENVIRONMENT)
    try:
        return max(0.0, float(value)) if value else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


def fmt_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class ProgressReport:
    """Called with a stage name as each stage starts (the builder's `progress` callback); `advance`
    reports steps inside the current stage (done of total, and what is being done). `finish` ends
    the display. With `enabled=False` nothing is shown (a caller printing JSON only)."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool = True,
                 interval: float | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interval = log_interval() if interval is None else interval
        self.terminal = enabled and self.stream.isatty()
        self.stage: str | None = None
        self.stage_started = time.perf_counter()
        self._last_line = 0.0
        self._bar = None
        self._task = None
        if self.terminal:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            console = Console(file=self.stream, highlight=False)
            self._bar = Progress(SpinnerColumn(), TextColumn(f"[bold]{label}[/] {{task.description}}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                                 transient=True)
            self._bar.start()
            self._task = self._bar.add_task("", total=None)

    def print(self, line: str) -> None:
        """A line that stays (a finished stage, a warning), above the live bar on a terminal."""
        if not self.enabled:
            return
        if self._bar is not None:
            from rich.text import Text
            self._bar.console.print(Text(line), soft_wrap=True)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def __call__(self, stage: str) -> None:
        self.stage = stage
        self.stage_started = time.perf_counter()
        self._last_line = 0.0
        if self._bar is not None:
            self._bar.reset(self._task, total=None, description=stage)
        elif self.enabled:
            self.print(f"{self.label}: {stage} started")
            self._last_line = time.perf_counter()

    def advance(self, done: int, total: int | None, detail: str = "") -> None:
        """`done` of `total` steps of the current stage finished (or under way); `detail` names the step."""
        if not self.enabled:
            return
        if self._bar is not None:
            description = f"{self.stage or ''} {detail}".strip()
            self._bar.update(self._task, completed=done, total=total, description=description)
            return
        now = time.perf_counter()
        last = total is not None and done >= total
        if now - self._last_line < self.interval and not last:
            return
        self._last_line = now
        elapsed = now - self.stage_started
        count = f"{done}/{total}" if total else str(done)
        estimate = ""
        if total and 0 < done < total:
            estimate = f", about {fmt_seconds(elapsed / done * (total - done))} left"
        self.print(f"progress: {self.label} {self.stage or ''} {count}, elapsed {fmt_seconds(elapsed)}{estimate}"
                   + (f": {detail}" if detail else ""))

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self):  # -> Self (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def advance_of(progress) -> Callable[..., None]:
    """The `advance(done, total, detail)` of a progress callback that has one (a ProgressReport), else
    a no-op: builder callers may pass any `progress(stage)` function."""
    advance = getattr(progress, "advance", None)
    return advance if callable(advance) else (lambda done, total, detail="": None)
