"""``report.json`` of ``leafe run`` as data: what the run did (:class:`RunSummary`), the offline
rebuild's check (:class:`DatasetCheck`), the held-out evaluations and what each part of the run
changed in them (:class:`PartComparison`, paired). ``services/run/report.py`` builds it,
``services/run/report_md.py`` renders it."""

from __future__ import annotations

from typing import Any

import msgspec

from leafe.actors.evaluate import EvalResult
from leafe.actors.passk import PassKDiff, paired_difference
from leafe.services.run.rounds import CurvePoint, RoundRecord

__all__ = [
    "DatasetCheck",
    "PartComparison",
    "RunReport",
    "RunSummary",
    "comparisons",
    "part_comparisons",
]


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the run did, counted from its log (``RunProgress``) and its services."""

    episodes: int
    """Training-time episodes finished (of the explore mode)."""
    successes: int
    """Of them, episodes in which some branch succeeded."""
    steps: int
    """Policy steps (eval included)."""
    unparseable: int
    """Steps whose answer named no valid action."""
    reflections: int
    rollbacks: int
    branches: int
    replay_steps: int
    """Env steps spent replaying prefixes on rollback."""
    events: int
    """Events in the log."""
    samples: dict[str, int]
    """Samples published, by kind."""
    learner_step: int
    learner_loss: float | None
    weights_version: str
    """Last version pushed (``default`` if none)."""


class DatasetCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The offline rebuild from the exported log against what the replayer published."""

    samples: int
    content_sha256: str
    stream_samples: int
    identical: bool
    """Same sample ids on both sides."""


class PartComparison(msgspec.Struct, frozen=True, kw_only=True):
    """One part of the run on the held-out tasks: the evaluation after it minus the one before it,
    paired (same tasks, same sampling seeds), with a 95% interval per k."""

    part: str
    """``warm start`` or the rounds (``LEAFE rounds``, ``rollout rounds``)."""
    label: str
    """The evaluation after the part (``warm-<version>``, ``after-<version>``)."""
    baseline: str
    """The evaluation before it (``before``, ``warm-<version>``)."""
    same_weights: bool
    """Both evaluations scored the same weights (the part changed nothing the engines serve)."""
    diffs: list[PassKDiff]


class RunReport(msgspec.Struct, frozen=True, kw_only=True):
    """``report.json``: everything ``report.md`` says, as data."""

    run_id: str
    model: str
    env: str
    env_options: dict[str, Any]
    materializer: str
    evals: dict[str, EvalResult]
    """Label -> result (``before``, ``after-<version>``)."""
    comparisons: list[PassKDiff]
    """After minus before per k, with 95% intervals (empty without both evaluations)."""
    run: RunSummary
    timings: dict[str, float]
    """Seconds per stage."""
    dataset: DatasetCheck
    rounds: list[RoundRecord] = msgspec.field(default_factory=list)
    """Each explore round (continual mode)."""
    curve: list[CurvePoint] = msgspec.field(default_factory=list)
    """The learning curve on the validation slice."""
    policy_lag: dict[str, int] = msgspec.field(default_factory=dict)
    """Trained samples per policy lag (versions behind the learner's push at training time)."""
    stale_dropped: int = 0
    """Samples dropped for exceeding ``max_policy_lag``."""
    step_counts: dict[str, int] = msgspec.field(default_factory=dict)
    """The learner's last process: steps ``taken``, of them ``partial`` (fewer samples than the
    global batch), ``grad_clipped`` (gradient norm above ``max_grad_norm``) and ``dual_clipped``
    (a GRPO token capped), and batches ``skipped`` (nothing left to train: no step)."""
    parts: list[PartComparison] = msgspec.field(default_factory=list)
    """What each part of the run did on the held-out tasks (the warm start, the rounds), paired."""
    schedule: str = "continuous"
    """``[explore] schedule`` (``phased``: the work bounds what the run does)."""
    budget_minutes: float = 0.0
    """The wall-clock budget (0: none)."""
    cuts: list[str] = msgspec.field(default_factory=list)
    """What the budget cut (empty: nothing)."""
    threads: str = ""
    """The thread plan the run used and why (``services.cores`` pins it; runs agree bit for bit
    under one)."""


def _diffs(a: EvalResult, b: EvalResult) -> list[PassKDiff]:
    return [
        paired_difference(a.successes, b.successes, k) for k in sorted(set(a.passk) & set(b.passk))
    ]


def _last(evals: dict[str, EvalResult], prefix: str) -> str | None:
    return next((label for label in reversed(evals) if label.startswith(prefix)), None)


def comparisons(evals: dict[str, EvalResult]) -> list[PassKDiff]:
    """The last evaluation after the rounds minus the one before everything, per k (empty without
    both)."""
    after = _last(evals, "after-")
    if "before" not in evals or after is None:
        return []
    return _diffs(evals[after], evals["before"])


_ROUNDS = {"explore": "LEAFE rounds", "rollout": "rollout rounds", "demo": "demonstration rounds"}


def part_comparisons(evals: dict[str, EvalResult], mode: str) -> list[PartComparison]:
    """(warm start - before) and (rounds - warm start), where those evaluations exist."""
    warm, after = _last(evals, "warm-"), _last(evals, "after-")
    steps = [("warm start", "before", warm), (_ROUNDS.get(mode, "rounds"), warm, after)]
    return [
        PartComparison(
            part=part,
            label=label,
            baseline=base,
            same_weights=evals[label].weight_version == evals[base].weight_version,
            diffs=_diffs(evals[label], evals[base]),
        )
        for part, base, label in steps
        if base in evals and label in evals
    ]
