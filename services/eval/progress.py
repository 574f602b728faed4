"""``leafe eval``'s progress: rich bars on a terminal, a plain line every 30 s elsewhere (CI, a
log)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from leafe.actors.episode import EpisodeSummary
from leafe.actors.evaluate import EvalSample

__all__ = ["LINE_EVERY_S", "EvalProgress"]

LINE_EVERY_S = 30.0
"""Away from a terminal: how often a model's progress line is printed (and once at the end)."""


class EvalProgress:
    """Rich progress bars on stderr, one per model, on a terminal; elsewhere (a log, CI) a plain
    line per model at most every :data:`LINE_EVERY_S` seconds; nothing with ``enabled=False``."""

    def __init__(self, enabled: bool, live: bool) -> None:
        self.bar: Any = None
        self.enabled = enabled
        if enabled and live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description:<16}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rollouts  {task.fields[solved]} solved"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self.bar.start()

    def track(self, label: str, total: int) -> Callable[[EvalSample, EpisodeSummary], None]:
        if not self.enabled:
            return lambda item, summary: None
        solved, done, started = [0], [0], time.monotonic()
        last = [started]
        task = None if self.bar is None else self.bar.add_task(label, total=total, solved=0)

        def advance(item: EvalSample, summary: EpisodeSummary) -> None:
            solved[0] += summary.success
            done[0] += 1
            if task is not None:
                self.bar.update(task, advance=1, solved=solved[0])
                return
            now = time.monotonic()
            if now - last[0] >= LINE_EVERY_S or done[0] == total:
                last[0] = now
                print(
                    f"{label}: {done[0]}/{total} rollouts, {solved[0]} solved, {now - started:.0f} "
                    "s",
                    file=sys.stderr,
                    flush=True,
                )

        return advance

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
