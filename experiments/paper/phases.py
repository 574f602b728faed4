"""The protocol of the paper table as data: every phase, its dependencies, in priority order.

:func:`plan` turns a :class:`~experiments.paper.config.PaperConfig` into the list of phases the
runner walks in order; a time box (``--max-minutes``) cuts from the end, so the list is in priority
order:

1. warm start: demonstrations per room variant, SFT per (variant, count) with weights after every
   epoch, each evaluated on the validation slice, then ``select-sft`` (difficulty, count, epochs);
2. ``eval-base``, ``eval-sft`` on test;
3. GRPO rounds from Base + SFT (round 1 per candidate lr, validation after every round),
   ``select-grpo`` (best round on validation), ``eval-grpo``;
4. LEAFE from GRPO with model reflections; 5. LEAFE with oracle reflections (ablation: it isolates
   Stage 2);
6. L_reh only; 7. RFT from Base + SFT; 8. Early Experience IWM from Base; 9. the noise check (Base +
   SFT,
other seeds); then Early Experience SR (its evaluation writes thoughts: the slowest row);
10. Table 3 from Base + SFT (tree, independent sampling at its budget, iterative refinement);
11. Base on validation per room variant; 12. the cost probe of a second environment.

Weights, room options and choices are named by references resolved at run time from finished phases:
``base``, ``sft`` (``select-sft``), ``grpo`` (``select-grpo``), ``grpo-r<k>`` (round k's weights),
``train:<phase>`` (its final weights) and ``train:<phase>@<epoch>``. Dependencies are derived from
these references (:func:`refs_of`), so they cannot drift from what a phase reads.
"""

from __future__ import annotations

from typing import Any

import msgspec

from experiments.paper.config import PaperConfig
from experiments.paper.specs import (
    AuditSpec,
    CollectSpec,
    EvalSpec,
    MixPart,
    Phase,
    ProbeSpec,
    SelectSpec,
    TrainSpec,
    refs_of,
)

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
    "checked",
    "closure",
    "grpo_phases",
    "plan_paper",
    "refs_of",
    "row_phase",
    "warm_phases",
]

GRPO_ROUND_SEEDS = 1_000_000
"""Round r of GRPO collects with seeds offset by (r - 1) x this (larger than 1000 x tasks +
samples)."""

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
    out = [
        _c(f"demos-{v}", stage, mode="demo", model="base", tasks="demos", variant=v)
        for v in w.variants
    ]
    vals = []
    for v in w.variants:
        for n in w.demo_counts:
            train = f"sft-{v}-n{n}"
            sft = dict(
                materializer="sft",
                start="base",
                lr=w.lr,
                epochs=w.epochs,
                demos=n,
                export_epochs=True,
            )
            out.append(_t(train, stage, data=f"demos-{v}", **sft))
            for e in range(1, w.epochs + 1):
                vals.append(f"val-{train}-e{e}")
                out.append(_e(vals[-1], stage, model=f"train:{train}@{e}", split="val", variant=v))
    return [*out, _s("select-sft", stage, "sft", vals)]


def grpo_phases(
    cfg: PaperConfig, start: str = "sft", after: tuple[str, ...] = (), variant: str = ""
) -> list[Phase]:
    """GRPO rounds from ``start`` (a weights reference), the round chosen on validation, its test
    row; on the room variant ``variant`` (empty: ``select-sft``'s)."""
    g, stage, rooms = cfg.grpo, "GRPO", {"variant": variant} if variant else {}
    first = _c(
        "grpo-r1-collect", stage, mode="rollout", model=start, tasks="rl", samples=g.group, **rooms
    )
    out = [msgspec.structs.replace(first, after=list(after))]
    vals = []
    for i, lr in enumerate(g.lrs):
        train = f"grpo-r1-train-lr{i}"
        out.append(
            _t(
                train,
                stage,
                data="grpo-r1-collect",
                materializer="grpo",
                start=start,
                lr=lr,
                epochs=g.epochs,
                share_prefix=g.share_prefix,
                dual_clip=g.dual_clip,
            )
        )
        vals.append(f"grpo-r1-val-lr{i}")
        out.append(_e(vals[-1], stage, model=f"train:{train}", split="val", **rooms))
    out.append(_s("grpo-r1-select", stage, "grpo-lr", vals))
    rounds = ["grpo-r1-select"]
    for r in range(2, g.rounds + 1):
        prev, data = f"grpo-r{r - 1}", f"grpo-r{r}-collect"
        seeds = (r - 1) * GRPO_ROUND_SEEDS
        out.append(
            _c(
                data,
                stage,
                mode="rollout",
                model=prev,
                tasks="rl",
                samples=g.group,
                seed_offset=seeds,
                **rooms,
            )
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
                share_prefix=g.share_prefix,
                dual_clip=g.dual_clip,
            )
        )
        rounds.append(f"grpo-r{r}-val")
        out.append(_e(rounds[-1], stage, model=f"train:grpo-r{r}-train", split="val", **rooms))
    return [
        *out,
        _s("select-grpo", stage, "grpo", rounds, start=start),
        _test("grpo", "grpo", stage, **rooms),
    ]


def _methods(cfg: PaperConfig) -> list[Phase]:
    lf, n = cfg.leafe, cfg.leafe.explore_samples
    # oracle_labels label model reflections; the oracle row's reflections are the oracle's own
    oracle = {
        **{k: v for k, v in lf.explorer.items() if k != "oracle_labels"},
        "reflection_source": "oracle",
    }
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
        _c(
            "early-collect",
            "EarlyExp",
            mode="demo",
            model="base",
            tasks="demos-chosen",
            demo=early_demo,
        ),
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
            _e(f"val-base-{v}", "warm start", model="base", split="val", variant=v)
            for v in cfg.warm.variants
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


def plan_paper(cfg: PaperConfig) -> list[Phase]:
    """Every phase the ``paper`` protocol needs for ``cfg``, in priority order (dependencies first);
    ``experiments.paper.plans.plan`` picks the protocol."""
    main = [_test("base", "base", "main"), _test("sft", "sft", "main")]
    full = [*warm_phases(cfg), *main, *grpo_phases(cfg), *_methods(cfg)]
    extras = _extras(cfg)
    keep = closure(full + extras, [row_phase(r) for r in cfg.rows] + [p.name for p in extras])
    return checked([p for p in full + extras if p.name in keep])


def checked(out: list[Phase]) -> list[Phase]:
    """``out``, once every phase is known to come after its dependencies."""
    seen: set[str] = set()
    for p in out:
        missing = [d for d in p.deps if d not in seen]
        if missing:
            raise AssertionError(f"phase {p.name} comes before its dependencies {missing}")
        seen.add(p.name)
    return out
