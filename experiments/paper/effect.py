"""The ``effect`` protocol: LEAFE's own effect, from one shared warm start that acts on e.

```
 demos ─► SFT per room variant (x history window) ─► validation
     ─► select-sft (W0: the rooms where large k can show, Pass@16 <= cap)
 labels: W0's trees on label rooms (model reflections + the oracle's verdict beside each)
   ├─► reflect samples (the reflection format)                 ┐
   └─► follow samples (history at tau + e -> the move e names) ├─► warm-train from Base
 demos (the chosen count) ─► sft samples                       ┘   ─► validation ─► select-warm (W)
 rooms (with effect.rooms): W on each candidate variant's validation
     ─► select-rooms (Pass@16 <= cap)
 audit: W's trees on audit rooms ─► follow audit (oracle e / no e / placebo e / own e) ─► GATE
 rows, all from W (after the gate): eval-warm; GRPO rounds; Stage 1 with model e and with oracle e
 (the paper's tree: on after the first success, <= max_corrections, no repeated request)
     ─► LEAFE and L_reh of each, with equal optimizer steps ─► test evaluations, paired comparisons
```

Choices are made on the validation slice only; the test evaluations come last, after the protocol
was registered and the gate passed. Every collection's log is exported
(``experiments/results/paper_logs/<name>/``), so every training set is rebuilt by ``leafe replay``
from the repository.

With ``effect.rooms`` the audit and the rows run on the room variant chosen there with the warm
start (harder rooms, where large k can show); with ``effect.inherit`` the warm start is another
experiment's (its committed records and logs, the weights rebuilt), so a harder-room variant costs
no Stage A.
"""

from __future__ import annotations

from typing import Any

import msgspec

from experiments.paper.config import PaperConfig
from experiments.paper.phases import (
    AuditSpec,
    CollectSpec,
    EvalSpec,
    MixPart,
    Phase,
    SelectSpec,
    TrainSpec,
    grpo_phases,
    row_phase,
    warm_phases,
)
from experiments.paper.specs import ROOMS

__all__ = ["EFFECT_COMPARISONS", "GATE", "inherited", "plan_effect"]

GATE = "audit-follow"
"""The follow audit: every row comes after it, and none runs when it is not met."""

EFFECT_COMPARISONS: list[tuple[str, str]] = [
    ("leafe", "reh"),
    ("leafe", "grpo"),
    ("leafe-oracle", "reh-oracle"),
    ("leafe-oracle", "grpo"),
    ("leafe", "warm"),
    ("leafe-oracle", "warm"),
    ("grpo", "warm"),
    ("reh", "warm"),
    ("leafe-oracle", "leafe"),
    # the fair table (issue #61): every pair names a row only it has, so the protocols registered
    # before keep their comparisons
    ("leafe-self", "reh-own"),
    ("leafe-self", "dagger"),
    ("leafe-self", "grpo"),
    ("leafe-self", "leafe"),
    ("leafe-self", "warm"),
    ("leafe-oracle", "dagger"),
    ("leafe-oracle", "reh-own"),
    ("leafe", "reh-own"),
    ("dagger", "reh-own"),
    ("dagger", "warm"),
    ("reh-own", "warm"),
]
"""(a - b) with intervals and a verdict at k = 1 and the largest k: LEAFE - L_reh isolates L_cf
(same trees), LEAFE - GRPO is the paper's claim, the oracle pair isolates L_cf with corrections that
are right."""


def _phase(name: str, stage: str, spec: Any, after: tuple[str, ...] = ()) -> Phase:
    return Phase(name=name, stage=stage, spec=spec, after=list(after))


def _shared_warm_start(cfg: PaperConfig) -> list[Phase]:
    fx, stage = cfg.effect, "warm start"
    labels = {**fx.label_explorer, "oracle_labels": True}
    out = [
        _phase(
            "labels",
            stage,
            CollectSpec(
                mode="explore",
                model="sft",
                tasks="labels",
                samples=fx.label_samples,
                explorer=labels,
            ),
        ),
        _phase(
            "warm-train",
            stage,
            TrainSpec(
                data="demos:chosen",
                materializer="sft",
                demos="sft",
                start="base",
                lr=fx.warm_lr,
                epochs=fx.warm_epochs,
                export_epochs=True,
                mix=[
                    MixPart(data="labels", materializer="reflect"),
                    MixPart(data="labels", materializer="follow"),
                ],
            ),
        ),
    ]
    vals = [f"val-warm-e{e}" for e in range(1, fx.warm_epochs + 1)]
    out += [
        _phase(v, stage, EvalSpec(model=f"train:warm-train@{e}", split="val"))
        for e, v in enumerate(vals, 1)
    ]
    out.append(_phase("select-warm", stage, SelectSpec(what="warm", candidates=vals)))
    if fx.rooms:  # the rows' rooms: the warm start on each candidate's validation slice
        rooms = [f"val-rooms-{v}" for v in fx.rooms]
        out += [
            _phase(r, "rooms", EvalSpec(model="warm", split="val", variant=v))
            for r, v in zip(rooms, fx.rooms, strict=True)
        ]
        out.append(_phase("select-rooms", "rooms", SelectSpec(what="rooms", candidates=rooms)))
    audit = CollectSpec(
        mode="explore", model="warm", tasks="audit", samples=1, explorer=labels, variant=_rooms(cfg)
    )
    out += [
        _phase("audit-collect", "follow audit", audit),
        _phase(GATE, "follow audit", AuditSpec(model="warm", data="audit-collect")),
    ]
    return out


def _rooms(cfg: PaperConfig) -> str:
    """The variant of the audit and the rows: ``select-rooms``'s when there are candidates, else
    ``select-sft``'s (the warm start's own rooms)."""
    return ROOMS if cfg.effect.rooms else ""


def inherited(cfg: PaperConfig) -> set[str]:
    """The phases an ``effect.inherit`` experiment takes from the other one (the warm start up to
    ``select-warm``): never run here; empty without ``inherit``."""
    from experiments.paper.phases import closure

    if not cfg.effect.inherit:
        return set()
    warm = warm_phases(cfg) + _shared_warm_start(cfg)
    return closure(warm, ["select-warm"])


def _rows(cfg: PaperConfig) -> list[Phase]:
    fx, gate, rooms = cfg.effect, (GATE,), {"variant": _rooms(cfg)} if cfg.effect.rooms else {}
    explore = dict(mode="explore", model="warm", tasks="rl", samples=fx.explore_samples, **rooms)
    model_e = {**fx.explorer, "oracle_labels": True}
    oracle_e = {**fx.explorer, "reflection_source": "oracle"}
    reh = {
        "rehearsal_fraction": fx.rehearsal_fraction,
        "rehearsal_seed": cfg.seed,
        "rehearsal_unit": "path",
    }
    train = dict(
        materializer="leafe", start="warm", lr=fx.row_lr, epochs=1, steps=fx.row_steps, options=reh
    )
    out = [
        _phase(
            row_phase("warm"),
            "rows",
            EvalSpec(model="warm", split="test", row="warm", **rooms),
            gate,
        )
    ]
    for suffix, explorer in (("", model_e), ("-oracle", oracle_e)):
        data = f"explore{suffix or '-model'}"
        out += [
            _phase(data, "Stage 1", CollectSpec(**explore, explorer=explorer), gate),  # type: ignore[arg-type]
            _phase(f"train-leafe{suffix}", "rows", TrainSpec(data=data, beta=fx.beta, **train)),  # type: ignore[arg-type]
            _phase(f"train-reh{suffix}", "rows", TrainSpec(data=data, kinds=["reh"], **train)),  # type: ignore[arg-type]
        ]
        for row in (f"leafe{suffix}", f"reh{suffix}"):
            spec = EvalSpec(model=f"train:train-{row}", split="test", row=row, **rooms)  # type: ignore[arg-type]
            out.append(_phase(row_phase(row), "rows", spec))
    return out


def _fair_rows(cfg: PaperConfig) -> list[Phase]:
    """The fair table's rows (issue #61, ``effect.own_rehearsal``): each distillation row is its
    corrections plus the same kind of rehearsal (``reh-own`` of its trees, the policy's own steps),
    with equal optimizer steps; DAgger's corrections come from the oracle-e log's root rollouts
    (W's own), the self-taught reflector's rounds from the model-e trees."""
    fx, rooms = cfg.effect, {"variant": _rooms(cfg)} if cfg.effect.rooms else {}
    reh = {
        "rehearsal_fraction": fx.rehearsal_fraction,
        "rehearsal_seed": cfg.seed,
        "rehearsal_unit": "path",
    }
    model_e = {**fx.explorer, "oracle_labels": True}  # the labels serve the audit only

    def own(data: str) -> MixPart:
        return MixPart(data=data, materializer="reh-own", options=reh)

    def train(data: str, materializer: str, options: dict[str, Any], mix: list[MixPart]) -> Any:
        return TrainSpec(
            data=data,
            materializer=materializer,
            start="warm",
            lr=fx.row_lr,
            epochs=1,
            steps=fx.row_steps,
            beta=fx.beta,
            options=options,
            mix=mix,
        )

    cf_only = {"rehearsal_fraction": 0.0}
    out = [
        _phase(
            "train-dagger",
            "rows",
            train("explore-oracle", "dagger", fx.dagger, [own("explore-oracle")]),
        ),
        _phase("train-reh-own", "rows", train("explore-oracle", "reh-own", reh, [])),
    ]
    rounds = fx.reflector_rounds
    for r in range(1, rounds + 1):
        earlier = [
            MixPart(data=f"explore-self-r{j}", materializer="self-taught", options=fx.self_taught)
            for j in range(1, r)
        ]
        reflector = TrainSpec(
            data="explore-model",
            materializer="self-taught",
            start="warm",
            lr=fx.row_lr,
            epochs=1,
            steps=fx.reflector_steps,
            options=fx.self_taught,
            mix=[*earlier, own("explore-model")],
        )
        collect = dict(mode="explore", model=f"train:reflector-r{r}", explorer=model_e, **rooms)
        out += [
            _phase(f"reflector-r{r}", "reflector", reflector),
            _phase(
                f"explore-self-r{r}",
                "reflector",
                CollectSpec(tasks="rl", samples=fx.explore_samples, **collect),  # type: ignore[arg-type]
            ),
            _phase(
                f"audit-self-r{r}",
                "reflector",
                CollectSpec(tasks="audit", samples=1, **collect),  # type: ignore[arg-type]
            ),
        ]
    if rounds:
        last = f"explore-self-r{rounds}"
        out.append(_phase("train-leafe-self", "rows", train(last, "leafe", cf_only, [own(last)])))
    for row in ("dagger", "reh-own", "leafe-self"):
        if row == "leafe-self" and not rounds:
            continue
        spec = EvalSpec(model=f"train:train-{row}", split="test", row=row, **rooms)  # type: ignore[arg-type]
        out.append(_phase(row_phase(row), "rows", spec))
    return out


def _own_rehearsal(cfg: PaperConfig, rows: list[Phase]) -> list[Phase]:
    """With ``effect.own_rehearsal`` the LEAFE rows' rehearsal is ``reh-own`` of their trees (their
    cf samples as before): the same rehearsal as every other distillation row."""
    if not cfg.effect.own_rehearsal:
        return rows
    fx = cfg.effect
    reh = {
        "rehearsal_fraction": fx.rehearsal_fraction,
        "rehearsal_seed": cfg.seed,
        "rehearsal_unit": "path",
    }
    out = []
    for p in rows:
        spec = p.spec
        if p.name in ("train-leafe", "train-leafe-oracle") and isinstance(spec, TrainSpec):
            spec = msgspec.structs.replace(
                spec,
                options={"rehearsal_fraction": 0.0},
                mix=[MixPart(data=spec.data, materializer="reh-own", options=reh)],
            )
            p = msgspec.structs.replace(p, spec=spec)
        out.append(p)
    return out


def plan_effect(cfg: PaperConfig) -> list[Phase]:
    """Every phase of the ``effect`` protocol in priority order (the rows ``cfg.rows`` asks for)."""
    from experiments.paper.phases import closure

    warm = warm_phases(cfg) + _shared_warm_start(cfg)
    rows = _own_rehearsal(cfg, _rows(cfg))
    rows += grpo_phases(cfg, start="warm", after=(GATE,), variant=_rooms(cfg))
    if cfg.effect.own_rehearsal:
        rows += _fair_rows(cfg)
    audits = [p.name for p in rows if p.name.startswith("audit-self-")]  # the reflector's audit
    keep = closure(warm + rows, [GATE] + [row_phase(r) for r in cfg.rows] + audits)
    return [p for p in warm + rows if p.name in keep]
