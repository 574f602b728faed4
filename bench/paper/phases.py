"""The protocol of the paper table as data: every phase, its dependencies, in priority order.

:func:`plan` turns a :class:`~bench.paper.config.PaperConfig` into the list of phases the runner walks in
order; a time box (``--max-minutes``) cuts from the end, so the list is in priority order:

1. warm start: demonstrations per room variant, SFT per (variant, count) with weights after every epoch,
   each evaluated on the validation slice, then ``select-sft`` (difficulty, count, epochs);
2. ``eval-base``, ``eval-sft`` on test;
3. GRPO rounds from Base + SFT (round 1 per candidate lr, validation after every round), ``select-grpo``
   (best round on validation), ``eval-grpo``;
4. LEAFE from GRPO with model reflections; 5. LEAFE with oracle reflections (ablation: it isolates Stage 2);
6. L_reh only; 7. RFT from Base + SFT; 8. Early Experience IWM from Base; 9. the noise check (Base + SFT,
other seeds); then Early Experience SR (its evaluation writes thoughts: the slowest row);
10. Table 3 from Base + SFT (tree, independent sampling at its budget, iterative refinement);
11. Base on validation per room variant; 12. the cost probe of a second environment.

Weights, room options and choices are named by references resolved at run time from finished phases:
``base``, ``sft`` (``select-sft``), ``grpo`` (``select-grpo``), ``grpo-r<k>`` (round k's weights),
``train:<phase>`` (its final weights) and ``train:<phase>@<epoch>``. Dependencies are derived from these
references (:func:`refs_of`), so they cannot drift from what a phase reads.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from bench.paper.config import PaperConfig

__all__ = [
    "COMPARISONS",
    "GRPO_ROUND_SEEDS",
    "AuditSpec",
    "CollectSpec",
    "EvalSpec",
    "MixPart",
    "Phase",
    "ProbeSpec",
    "SelectSpec",
    "TrainSpec",
    "closure",
    "comparisons_of",
    "grpo_phases",
    "plan",
    "refs_of",
    "row_phase",
    "warm_phases",
]

Options = dict[str, Any]


class CollectSpec(msgspec.Struct, frozen=True, kw_only=True, tag="collect"):
    """Episodes on train tasks through the actor service (their log is exported afterwards)."""

    mode: Literal["demo", "rollout", "explore"]
    """Episode mode."""
    model: str
    """Weights served while collecting (a reference)."""
    tasks: Literal["demos", "demos-chosen", "rl", "labels", "audit"]
    """All demonstration tasks, the chosen count of them, the RL tasks, or the ``effect`` protocol's label
    or audit rooms."""
    samples: int = 1
    """Episodes per task (a GRPO group, trees per task)."""
    match_actions_of: str = ""
    """Size the samples per task to this collection's policy actions (Table 3's equal budget)."""
    variant: str = ""
    """Room variant; empty = the one ``select-sft`` chose."""
    explorer: Options = msgspec.field(default_factory=dict)
    """``ExplorerConfig`` overrides."""
    demo: Options = msgspec.field(default_factory=dict)
    """``DemoConfig`` overrides."""
    seed_offset: int = 0
    """Added to the training-episode seed: every GRPO round samples afresh (with the same seeds a barely
    changed policy would replay the previous round's trajectories)."""


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
    """Keep only samples of the first n demonstration tasks (``sft`` = the chosen count; 0 = all)."""
    beta: float | None = None
    """Weight of the rehearsal term."""
    export_epochs: bool = False
    """Export the weights after every epoch (``train:<phase>@<epoch>``)."""
    options: Options = msgspec.field(default_factory=dict)
    """Materializer options."""
    mix: list[MixPart] = msgspec.field(default_factory=list)
    """More datasets trained together with the first (each replayed whole)."""
    steps: int = 0
    """Exactly this many optimizer steps (epochs as many as it takes; 0 = ``epochs``): equal steps across
    rows trained on different sample counts."""


class EvalSpec(msgspec.Struct, frozen=True, kw_only=True, tag="eval"):
    """Pass@k of some weights on the validation slice or the test tasks."""

    model: str
    """Weights evaluated (a reference)."""
    split: Literal["val", "test"]
    """``val``: the validation slice of the train split; ``test``: the held-out tasks."""
    variant: str = ""
    """Room variant; empty = the chosen one."""
    seed_offset: int = 0
    """Added to the split's sampling seed (the noise check)."""
    rollout: Options = msgspec.field(default_factory=dict)
    """``RolloutConfig`` overrides (SR answers after ``<think>``)."""
    row: str = ""
    """Row label of a test evaluation."""


class SelectSpec(msgspec.Struct, frozen=True, kw_only=True, tag="select"):
    """A choice made on validation results only (``bench/paper/select.py``)."""

    what: Literal["sft", "grpo-lr", "grpo", "warm"]
    """What is chosen."""
    candidates: list[str]
    """Validation phases (or, for ``grpo``, round 1's select phase) compared."""
    start: str = "sft"
    """``grpo``: the weights the rounds started from (``sft`` or ``warm``), the baseline of the choice."""


class ProbeSpec(msgspec.Struct, frozen=True, kw_only=True, tag="probe"):
    """Base on a few test tasks of a second environment: the cost per episode."""


class AuditSpec(msgspec.Struct, frozen=True, kw_only=True, tag="audit"):
    """The follow audit (``bench/paper/follow_audit.py``) of some weights at the verdicts of a collection;
    its result carries the gate (``gate.passed``): phases after it are blocked when it is not met."""

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


GRPO_ROUND_SEEDS = 1_000_000
"""Round r of GRPO collects with seeds offset by (r - 1) x this (larger than 1000 x tasks + samples)."""

COMPARISONS: list[tuple[str, str]] = [
    ("sft", "base"),
    ("grpo", "sft"),
    ("leafe", "grpo"),
    ("iwm", "sft"),
    ("sr", "sft"),
    ("rft", "sft"),
    ("leafe-oracle", "grpo"),
    ("leafe-oracle", "leafe"),
    ("reh", "grpo"),
    ("leafe", "reh"),
    ("leafe", "sft"),
    ("sft-reseed", "sft"),
]
"""Paired comparisons (row a - row b) with intervals and a verdict each, in report order."""


def comparisons_of(cfg: PaperConfig) -> list[tuple[str, str]]:
    """The paired comparisons of ``cfg``'s protocol (``effect``: ``bench/paper/effect.py``)."""
    if cfg.protocol == "effect":
        from bench.paper.effect import EFFECT_COMPARISONS

        return EFFECT_COMPARISONS
    return COMPARISONS


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


def refs_of(spec: Spec) -> list[str]:
    """The phases ``spec`` depends on, in a stable order without repeats."""
    deps: list[str] = []
    chosen = "select-sft"
    if isinstance(spec, CollectSpec):
        deps += _model_deps(spec.model)
        deps += [spec.match_actions_of] if spec.match_actions_of else []
        deps += [chosen] if not spec.variant or spec.tasks == "demos-chosen" else []
    elif isinstance(spec, TrainSpec):
        deps += [chosen] if spec.data == "demos:chosen" else [spec.data]
        deps += [part.data for part in spec.mix] + _model_deps(spec.start)
        deps += ["grpo-r1-select"] if spec.lr == "grpo" else []
        deps += [chosen] if "sft" in (spec.epochs, spec.demos) else []
    elif isinstance(spec, EvalSpec):
        deps += _model_deps(spec.model) + ([] if spec.variant else [chosen])
    elif isinstance(spec, SelectSpec):
        deps += spec.candidates + (_model_deps(spec.start) if spec.what == "grpo" else [])
    elif isinstance(spec, AuditSpec):
        deps += [*_model_deps(spec.model), spec.data]
    return list(dict.fromkeys(deps))


def _c(name: str, stage: str, **kw: Any) -> Phase:
    return Phase(name=name, stage=stage, spec=CollectSpec(**kw))


def _t(name: str, stage: str, **kw: Any) -> Phase:
    return Phase(name=name, stage=stage, spec=TrainSpec(**kw))


def _e(name: str, stage: str, **kw: Any) -> Phase:
    return Phase(name=name, stage=stage, spec=EvalSpec(**kw))


def _s(name: str, stage: str, what: str, candidates: list[str], start: str = "sft") -> Phase:
    spec = SelectSpec(what=what, candidates=candidates, start=start)  # type: ignore[arg-type]
    return Phase(name=name, stage=stage, spec=spec)


def _test(row: str, model: str, stage: str, **kw: Any) -> Phase:
    return _e(f"eval-{row}", stage, model=model, split="test", row=row, **kw)


def warm_phases(cfg: PaperConfig) -> list[Phase]:
    w, stage = cfg.warm, "warm start"
    out = [_c(f"demos-{v}", stage, mode="demo", model="base", tasks="demos", variant=v) for v in w.variants]
    vals = []
    for v in w.variants:
        for n in w.demo_counts:
            train = f"sft-{v}-n{n}"
            sft = dict(
                materializer="sft", start="base", lr=w.lr, epochs=w.epochs, demos=n, export_epochs=True
            )
            out.append(_t(train, stage, data=f"demos-{v}", **sft))
            for e in range(1, w.epochs + 1):
                vals.append(f"val-{train}-e{e}")
                out.append(_e(vals[-1], stage, model=f"train:{train}@{e}", split="val", variant=v))
    return [*out, _s("select-sft", stage, "sft", vals)]


def grpo_phases(cfg: PaperConfig, start: str = "sft", after: tuple[str, ...] = ()) -> list[Phase]:
    """GRPO rounds from ``start`` (a weights reference), the round chosen on validation, its test row."""
    g, stage = cfg.grpo, "GRPO"
    first = _c("grpo-r1-collect", stage, mode="rollout", model=start, tasks="rl", samples=g.group)
    out = [msgspec.structs.replace(first, after=list(after))]
    vals = []
    for i, lr in enumerate(g.lrs):
        train = f"grpo-r1-train-lr{i}"
        out.append(
            _t(train, stage, data="grpo-r1-collect", materializer="grpo", start=start, lr=lr, epochs=g.epochs)
        )
        vals.append(f"grpo-r1-val-lr{i}")
        out.append(_e(vals[-1], stage, model=f"train:{train}", split="val"))
    out.append(_s("grpo-r1-select", stage, "grpo-lr", vals))
    rounds = ["grpo-r1-select"]
    for r in range(2, g.rounds + 1):
        prev, data = f"grpo-r{r - 1}", f"grpo-r{r}-collect"
        seeds = (r - 1) * GRPO_ROUND_SEEDS
        out.append(
            _c(data, stage, mode="rollout", model=prev, tasks="rl", samples=g.group, seed_offset=seeds)
        )
        out.append(
            _t(
                f"grpo-r{r}-train",
                stage,
                data=data,
                materializer="grpo",
                start=prev,
                lr="grpo",
                epochs=g.epochs,
            )
        )
        rounds.append(f"grpo-r{r}-val")
        out.append(_e(rounds[-1], stage, model=f"train:grpo-r{r}-train", split="val"))
    return [*out, _s("select-grpo", stage, "grpo", rounds, start=start), _test("grpo", "grpo", stage)]


def _methods(cfg: PaperConfig) -> list[Phase]:
    lf, n = cfg.leafe, cfg.leafe.explore_samples
    # oracle_labels label model reflections; the oracle row's reflections are the oracle's own
    oracle = {**{k: v for k, v in lf.explorer.items() if k != "oracle_labels"}, "reflection_source": "oracle"}
    early_demo = {
        "alternatives": cfg.early.alternatives,
        "self_reflection": True,
        "max_states": cfg.early.max_states,
    }
    sr_rollout = {"response_prefix": "<think>", "max_new_tokens": cfg.early.sr_max_new_tokens}
    early = dict(data="early-collect", start="base", lr=cfg.warm.lr, epochs="sft")
    reh = {"rehearsal_fraction": lf.rehearsal_fraction, "rehearsal_seed": cfg.seed}
    leafe = dict(materializer="leafe", start="grpo", lr=lf.lr, epochs=lf.epochs, options=reh)
    explore = dict(mode="explore", model="grpo", tasks="rl", samples=n)
    return [
        _c("explore-grpo", "LEAFE", **explore, explorer=lf.explorer),
        _t("train-leafe", "LEAFE", data="explore-grpo", beta=lf.beta, **leafe),
        _test("leafe", "train:train-leafe", "LEAFE"),
        _c("explore-grpo-oracle", "LEAFE", **explore, explorer=oracle),
        _t("train-leafe-oracle", "LEAFE", data="explore-grpo-oracle", beta=lf.beta, **leafe),
        _test("leafe-oracle", "train:train-leafe-oracle", "LEAFE"),
        _t("train-reh", "LEAFE", data="explore-grpo", kinds=["reh"], **leafe),
        _test("reh", "train:train-reh", "LEAFE"),
        _t(
            "train-rft",
            "RFT",
            data="grpo-r1-collect",
            materializer="rft",
            start="sft",
            lr=lf.lr,
            epochs=lf.epochs,
        ),
        _test("rft", "train:train-rft", "RFT"),
        _c("early-collect", "EarlyExp", mode="demo", model="base", tasks="demos-chosen", demo=early_demo),
        _t("train-iwm", "EarlyExp", materializer="iwm", **early),
        _test("iwm", "train:train-iwm", "EarlyExp"),
        _test("sft-reseed", "sft", "noise check", seed_offset=cfg.reseed_offset),
        _t("train-sr", "EarlyExp", materializer="sr", **early),
        _test("sr", "train:train-sr", "EarlyExp", rollout=sr_rollout),
    ]


def _extras(cfg: PaperConfig) -> list[Phase]:
    out, stage = [], "Table 3"
    if cfg.table3:
        tree = dict(mode="explore", model="sft", tasks="rl", samples=cfg.leafe.explore_samples)
        out += [
            _c("t3-tree", stage, **tree, explorer=cfg.leafe.explorer),
            _c("t3-is", stage, mode="rollout", model="sft", tasks="rl", match_actions_of="t3-tree"),
            _c("t3-ir", stage, **tree, explorer={**cfg.leafe.explorer, "restart_from": "start"}),
        ]
    if cfg.val_base:
        out += [
            _e(f"val-base-{v}", "warm start", model="base", split="val", variant=v) for v in cfg.warm.variants
        ]
    if cfg.probe.env:
        out.append(Phase(name=f"probe-{cfg.probe.env}", stage="cost probe", spec=ProbeSpec()))
    return out


def row_phase(row: str) -> str:
    """The test evaluation phase of ``row``."""
    return f"eval-{row}"


def closure(phases: list[Phase], wanted: list[str]) -> set[str]:
    """``wanted`` and every phase they depend on, transitively."""
    by_name = {p.name: p for p in phases}
    out: set[str] = set()
    todo = list(wanted)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo += by_name[name].deps
    return out


def plan(cfg: PaperConfig) -> list[Phase]:
    """Every phase ``cfg`` needs, in priority order (dependencies always come first)."""
    if cfg.protocol == "effect":
        from bench.paper.effect import plan_effect

        return _checked(plan_effect(cfg))
    main = [_test("base", "base", "main"), _test("sft", "sft", "main")]
    full = [*warm_phases(cfg), *main, *grpo_phases(cfg), *_methods(cfg)]
    extras = _extras(cfg)
    keep = closure(full + extras, [row_phase(r) for r in cfg.rows] + [p.name for p in extras])
    return _checked([p for p in full + extras if p.name in keep])


def _checked(out: list[Phase]) -> list[Phase]:
    """``out``, once every phase is known to come after its dependencies."""
    seen: set[str] = set()
    for p in out:
        missing = [d for d in p.deps if d not in seen]
        if missing:
            raise AssertionError(f"phase {p.name} comes before its dependencies {missing}")
        seen.add(p.name)
    return out
