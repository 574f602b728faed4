"""The work a run plans, the work done so far, and the time left from the rates measured in this
run.

:func:`plan_stages` lists a run's stages from its config, each with its work: episodes of
evaluations, demonstrations and rounds (counted from the log: ``RunProgress.episodes_finished`` by
mode), or learner steps of a phased run's training (known once the phase's samples are released).
:class:`RunPlan` follows the stage the supervisor enters (:meth:`RunPlan.enter`), measures each kind
of work's rate over the stages that did it, and estimates the time left of the stage and of the run.
A stage whose kind of work has not run yet (the first round's trees) has no rate: it is named as
untimed, never guessed. Progress lines read::

    [exploring round 0 03:12 | 5/8 episodes, ~01:40 left | run ~04:30 left + 3 stages not yet timed]
        ...                                                                 (one line, wrapped here)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from leafe.services.run.presets import RunConfig
from leafe.services.run.progress import RunProgress

__all__ = ["PlannedStage", "RunPlan", "plan_stages", "stage_key"]

_VERSION = re.compile(r"-v\d+$")


def stage_key(stage: str) -> str:
    """A stage's name without the weight version an evaluation label carries (``evaluating
    warm``)."""
    return _VERSION.sub("", stage)


@dataclass
class PlannedStage:
    """One stage of the plan and what it did so far."""

    key: str
    """The supervisor's stage name (:func:`stage_key`)."""
    counter: str
    """What counts its work: an episode mode (``eval``, ``demo``, ``explore``, ``rollout``),
    ``steps`` (learner steps), or ``""`` (no counted work: draining, finishing)."""
    planned: int | None
    """Units of work planned (``None``: not known yet)."""
    base: int = 0
    done: int = 0
    started: float | None = None
    ended: float | None = None

    @property
    def unit(self) -> str:
        return "steps" if self.counter == "steps" else "episodes" if self.counter else ""


def plan_stages(cfg: RunConfig) -> list[PlannedStage]:
    """Every stage ``cfg`` plans, in order (rounds: ``explore.rounds``; 0 = until a budget or a step
    cap plans round 0 only). Training stages are phased runs' only; their steps are known at
    release."""
    ev, ex, ov = cfg.eval, cfg.explore, cfg.online_eval
    phased = ex.schedule == "phased" and cfg.services.learner
    held_out = ev.tasks * ev.samples
    stages: list[PlannedStage] = []
    if ev.before:
        stages.append(PlannedStage(key="evaluating before", counter="eval", planned=held_out))
    if ex.demos:
        passes = ex.demo_epochs if phased else 1
        for e in range(passes):
            demos = ex.demos * (1 if phased else ex.demo_epochs)
            stages.append(PlannedStage(key="warm start", counter="demo", planned=demos))
            if phased:
                stages.append(
                    PlannedStage(key=f"training warm start pass {e}", counter="steps", planned=None)
                )
        if ev.after_warm_start:
            stages.append(PlannedStage(key="evaluating warm", counter="eval", planned=held_out))
        if ov.every_rounds:
            key = "validation after the warm start"
            stages.append(PlannedStage(key=key, counter="eval", planned=ov.tasks * ov.samples))
    rounds = max(1, ex.rounds)
    for r in range(rounds):
        stages.append(
            PlannedStage(key=f"exploring round {r}", counter=ex.mode, planned=ex.tasks * ex.samples)
        )
        if phased:
            stages.append(PlannedStage(key=f"training round {r}", counter="steps", planned=None))
        if ov.every_rounds and ((r + 1) % ov.every_rounds == 0 or r + 1 == rounds):
            key = f"validation after round {r}"
            stages.append(PlannedStage(key=key, counter="eval", planned=ov.tasks * ov.samples))
    stages.append(PlannedStage(key="draining", counter="", planned=None))
    if ev.after:
        stages.append(PlannedStage(key="evaluating after", counter="eval", planned=held_out))
    stages.append(PlannedStage(key="finishing", counter="", planned=None))
    return stages


def _count(progress: RunProgress, counter: str) -> int:
    if counter == "steps":
        return progress.learner_step
    return progress.episodes_finished.get(counter, 0) if counter else 0


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{s:02d}" if hours else f"{minutes:02d}:{s:02d}"


class RunPlan:
    """The stages of :func:`plan_stages`, followed as the supervisor enters them."""

    def __init__(
        self, stages: list[PlannedStage], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stages = stages
        self._clock = clock
        self.current: PlannedStage | None = None

    def _find(self, key: str) -> PlannedStage | None:
        """The first stage of that name not yet ended (the warm start's passes share one name)."""
        return next((s for s in self.stages if s.key == key and s.ended is None), None)

    def enter(self, stage: str, progress: RunProgress) -> None:
        """The supervisor enters ``stage``: the current stage ends, the new one starts counting (a
        stage the plan does not know, such as ``starting``, is followed by nothing)."""
        now, key = self._clock(), stage_key(stage)
        if self.current is not None and self.current.key == key:
            return
        if self.current is not None:
            self.update(progress)
            self.current.ended = now
        self.current = self._find(key)
        if self.current is not None:
            self.current.started, self.current.base = now, _count(progress, self.current.counter)

    def update(self, progress: RunProgress) -> None:
        """Refresh the current stage's work done from the counters."""
        s = self.current
        if s is not None and s.counter:
            s.done = _count(progress, s.counter) - s.base

    def expect(self, stage: str, planned: int) -> None:
        """Set a stage's planned work once it is known (a phased training's steps)."""
        s = self._find(stage_key(stage))
        if s is not None:
            s.planned = planned

    def rate(self, counter: str) -> float | None:
        """Units per second of ``counter``'s kind of work over the stages that did it (None: none
        yet)."""
        now = self._clock()
        spans = [
            (s.done, (s.ended or now) - s.started)
            for s in self.stages
            if s.counter == counter and s.started is not None and s.done > 0
        ]
        seconds = sum(t for _, t in spans)
        return sum(n for n, _ in spans) / seconds if spans and seconds > 0 else None

    def _left(self, s: PlannedStage) -> float | None:
        """Seconds left of stage ``s`` at the measured rate (None: not known)."""
        if not s.counter or s.planned is None:
            return None
        rate = self.rate(s.counter)
        left = max(0, s.planned - s.done)
        return 0.0 if left == 0 else (left / rate if rate else None)

    def line(self) -> str:
        """``5/8 episodes, ~01:40 left | run ~04:30 left + 3 stages not yet timed`` (the time left
        of stages whose kind of work has a measured rate, and how many have none yet); empty outside
        the plan."""
        s = self.current
        if s is None:
            return ""
        if s.counter:
            planned = "?" if s.planned is None else str(s.planned)
            left = self._left(s)
            stage = f"{s.done}/{planned} {s.unit}" + (
                f", ~{_clock(left)} left" if left is not None else ""
            )
        else:
            stage = "no counted work"
        later = [x for x in self.stages[self.stages.index(s) :] if x.ended is None]
        times = [self._left(x) for x in later]
        known = sum(t for t in times if t is not None)
        untimed = sum(t is None for t in times)
        if untimed == len(later):
            run = f"run: {untimed} stages not yet timed"
        else:
            run = f"run ~{_clock(known)} left" + (
                f" + {untimed} stages not yet timed" if untimed else ""
            )
        return f"{stage} | {run}"
