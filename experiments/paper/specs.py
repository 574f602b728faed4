"""What a phase of the paper table does, as data: the specs (collect, train, evaluate, select,
probe, audit) and :class:`Phase`, whose dependencies come from the weights and data it references
(:func:`refs_of`). ``experiments/paper/phases.py`` assembles them into the protocol;
``experiments/paper/steps.py`` runs them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "ROOMS",
    "AuditSpec",
    "CollectSpec",
    "EvalSpec",
    "MixPart",
    "Phase",
    "ProbeSpec",
    "SelectSpec",
    "Spec",
    "TrainSpec",
    "refs_of",
]

Options = dict[str, Any]

ROOMS = "@rooms"
"""The room variant ``select-rooms`` chose (the ``effect`` protocol's ``effect.rooms``), as a
phase's ``variant``."""


class CollectSpec(msgspec.Struct, frozen=True, kw_only=True, tag="collect"):
    """Episodes on train tasks through the actor service (their log is exported afterwards)."""

    mode: Literal["demo", "rollout", "explore"]
    """Episode mode."""
    model: str
    """Weights served while collecting (a reference)."""
    tasks: Literal["demos", "demos-chosen", "rl", "labels", "audit"]
    """All demonstration tasks, the chosen count of them, the RL tasks, or the ``effect`` protocol's
    label or audit rooms."""
    samples: int = 1
    """Episodes per task (a GRPO group, trees per task)."""
    match_actions_of: str = ""
    """Size the samples per task to this collection's policy actions (Table 3's equal budget)."""
    variant: str = ""
    """Room variant; empty = the one ``select-sft`` chose, :data:`ROOMS` = the one ``select-rooms``
    chose."""
    explorer: Options = msgspec.field(default_factory=dict)
    """``ExplorerConfig`` overrides."""
    demo: Options = msgspec.field(default_factory=dict)
    """``DemoConfig`` overrides."""
    seed_offset: int = 0
    """Added to the training-episode seed: every GRPO round samples afresh (with the same seeds a
    barely changed policy would replay the previous round's trajectories)."""


class MixPart(msgspec.Struct, frozen=True, kw_only=True):
    """One more dataset of a training: another log replayed with another materializer."""

    data: str
    """The collection phase whose exported log is replayed."""
    materializer: str
    """Materializer name."""
    options: Options = msgspec.field(default_factory=dict)
    """Materializer options."""


class TrainSpec(msgspec.Struct, frozen=True, kw_only=True, tag="train"):
    """``leafe replay --from <exported log>`` then ``leafe train``."""

    data: str
    """The collection phase whose exported log is replayed (``demos:chosen``: the chosen variant's
    demonstrations)."""
    materializer: str
    """Materializer name."""
    start: str
    """Weights trained from (a reference)."""
    lr: float | str
    """Learning rate, or ``grpo`` for the lr ``grpo-r1-select`` chose."""
    epochs: int | str
    """Epochs, or ``sft`` for the epochs ``select-sft`` chose."""
    kinds: list[str] = msgspec.field(default_factory=list)
    """Keep only samples of these kinds (empty = all)."""
    demos: int | str = 0
    """Keep only samples of the first n demonstration tasks (``sft`` = the chosen count; 0 =
    all)."""
    beta: float | None = None
    """Weight of the rehearsal term."""
    export_epochs: bool = False
    """Export the weights after every epoch (``train:<phase>@<epoch>``)."""
    options: Options = msgspec.field(default_factory=dict)
    """Materializer options."""
    mix: list[MixPart] = msgspec.field(default_factory=list)
    """More datasets trained together with the first (each replayed whole)."""
    steps: int = 0
    """Exactly this many optimizer steps (epochs as many as it takes; 0 = ``epochs``): equal steps
    across rows trained on different sample counts."""
    share_prefix: bool = False
    """Pack with the learner's ``share_prefix`` (the common prompt prefix once a row: the same step
    up to float rounding, fewer tokens through the model)."""
    dual_clip: float = 0.0
    """``loss.dual_clip`` of this training, pinned in its trainer table (0 = off, what every record
    before the learner's default became 3 was trained with)."""


class EvalSpec(msgspec.Struct, frozen=True, kw_only=True, tag="eval"):
    """Pass@k of some weights on the validation slice or the test tasks."""

    model: str
    """Weights evaluated (a reference)."""
    split: Literal["val", "test"]
    """``val``: the validation slice of the train split; ``test``: the held-out tasks."""
    variant: str = ""
    """Room variant; empty = the one ``select-sft`` chose, :data:`ROOMS` = the one ``select-rooms``
    chose."""
    seed_offset: int = 0
    """Added to the split's sampling seed (the noise check)."""
    rollout: Options = msgspec.field(default_factory=dict)
    """``RolloutConfig`` overrides (SR answers after ``<think>``)."""
    row: str = ""
    """Row label of a test evaluation."""


class SelectSpec(msgspec.Struct, frozen=True, kw_only=True, tag="select"):
    """A choice made on validation results only (``experiments/paper/select.py``)."""

    what: Literal["sft", "grpo-lr", "grpo", "warm", "rooms"]
    """What is chosen."""
    candidates: list[str]
    """Validation phases (or, for ``grpo``, round 1's select phase) compared."""
    start: str = "sft"
    """``grpo``: the weights the rounds started from (``sft`` or ``warm``), the baseline of the
    choice."""


class ProbeSpec(msgspec.Struct, frozen=True, kw_only=True, tag="probe"):
    """Base on a few test tasks of a second environment: the cost per episode."""


class AuditSpec(msgspec.Struct, frozen=True, kw_only=True, tag="audit"):
    """The follow audit (``experiments/paper/follow_audit.py``) of some weights at the verdicts of a
    collection; its result carries the gate (``gate.passed``): phases after it are blocked when it
    is not met."""

    model: str
    """Weights audited (a reference)."""
    data: str
    """The labelled explore collection whose verdicts are the audit's states."""


Spec = CollectSpec | TrainSpec | EvalSpec | SelectSpec | ProbeSpec | AuditSpec


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """One step of the protocol; finished, it leaves ``<work>/<name>/done.json``."""

    name: str
    """Unique, key-safe; the directory of its results."""
    stage: str
    """Group shown in the report (``warm start``, ``GRPO`` ...)."""
    spec: Spec
    """What it does."""
    after: list[str] = msgspec.field(default_factory=list)
    """Phases that must have finished first although nothing is read from them (a gate)."""

    @property
    def deps(self) -> list[str]:
        """Phases whose results this one reads (from its references), then ``after``."""
        return list(dict.fromkeys(refs_of(self.spec) + self.after))


def _model_deps(ref: str) -> list[str]:
    if ref == "base":
        return []
    if ref == "sft":
        return ["select-sft"]
    if ref == "grpo":
        return ["select-grpo"]
    if ref == "warm":
        return ["select-warm"]
    if ref == "grpo-r1":
        return ["grpo-r1-select"]
    if ref.startswith("grpo-r"):
        return [f"{ref}-train"]
    if ref.startswith("train:"):
        return [ref.removeprefix("train:").split("@")[0]]
    raise ValueError(f"unknown weights reference {ref!r}")


def _variant_deps(variant: str) -> list[str]:
    if variant == ROOMS:
        return ["select-rooms"]
    return [] if variant else ["select-sft"]


def refs_of(spec: Spec) -> list[str]:
    """The phases ``spec`` depends on, in a stable order without repeats."""
    deps: list[str] = []
    chosen = "select-sft"
    if isinstance(spec, CollectSpec):
        deps += _model_deps(spec.model)
        deps += [spec.match_actions_of] if spec.match_actions_of else []
        deps += [chosen] if spec.tasks == "demos-chosen" else []
        deps += _variant_deps(spec.variant)
    elif isinstance(spec, TrainSpec):
        deps += [chosen] if spec.data == "demos:chosen" else [spec.data]
        deps += [part.data for part in spec.mix] + _model_deps(spec.start)
        deps += ["grpo-r1-select"] if spec.lr == "grpo" else []
        deps += [chosen] if "sft" in (spec.epochs, spec.demos) else []
    elif isinstance(spec, EvalSpec):
        deps += _model_deps(spec.model) + _variant_deps(spec.variant)
    elif isinstance(spec, SelectSpec):
        deps += spec.candidates + (_model_deps(spec.start) if spec.what == "grpo" else [])
    elif isinstance(spec, AuditSpec):
        deps += [*_model_deps(spec.model), spec.data]
    return list(dict.fromkeys(deps))
