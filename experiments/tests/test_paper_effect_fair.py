"""The fair table's plan (``experiments/configs/paper_effect-fair.toml``, issue #61): its rows and
the reflector's rounds and audits are phases of the ``effect`` protocol; every distillation row
rehearses the policy's own steps; the protocols registered before are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.paper.config import load_paper_config, scale_path
from experiments.paper.phases import TrainSpec
from experiments.paper.plans import plan
from experiments.paper.protocol import protocol_of

ROOT = Path(__file__).resolve().parents[2]


def _specs(scale: str) -> dict[str, object]:
    return {p.name: p for p in plan(load_paper_config(scale_path(scale)))}


def test_fair_plan_has_every_row_the_reflector_rounds_and_their_audits() -> None:
    phases = _specs("effect-fair")
    for name in (
        "train-dagger",
        "train-reh-own",
        "eval-dagger",
        "eval-reh-own",
        "eval-leafe-self",
        "eval-grpo",
        "eval-warm",
        *(f"{k}-r{r}" for r in (1, 2, 3) for k in ("reflector", "explore-self", "audit-self")),
    ):
        assert name in phases, name
    assert "train-reh" not in phases and "train-reh-oracle" not in phases
    self_row = phases["train-leafe-self"].spec  # type: ignore[attr-defined]
    assert self_row.data == "explore-self-r3"
    r3 = phases["reflector-r3"].spec  # type: ignore[attr-defined]
    assert r3.materializer == "self-taught" and r3.start == "warm"
    assert [m.data for m in r3.mix] == ["explore-self-r1", "explore-self-r2", "explore-model"]
    collect = phases["explore-self-r2"].spec  # type: ignore[attr-defined]
    assert collect.model == "train:reflector-r2" and collect.tasks == "rl"
    assert phases["audit-self-r2"].spec.tasks == "audit"  # type: ignore[attr-defined]


def test_every_fair_distillation_row_rehearses_own_steps_with_equal_steps() -> None:
    phases = _specs("effect-fair")
    rows = ["train-leafe", "train-leafe-oracle", "train-dagger", "train-leafe-self"]
    for name in rows:
        spec = phases[name].spec  # type: ignore[attr-defined]
        assert isinstance(spec, TrainSpec) and spec.steps == 60 and spec.start == "warm"
        assert [(m.materializer, m.data) for m in spec.mix] == [("reh-own", spec.data)], name
    assert phases["train-leafe-oracle"].spec.options == {"rehearsal_fraction": 0.0}  # type: ignore[attr-defined]
    dagger = phases["train-dagger"].spec  # type: ignore[attr-defined]
    assert dagger.materializer == "dagger" and dagger.data == "explore-oracle"
    assert dagger.options == {"per_rollout": "all", "max_samples": 505}


@pytest.mark.parametrize("scale", ["effect", "effect-hard"])
def test_registered_protocols_and_their_leafe_rows_are_unchanged(scale: str) -> None:
    cfg = load_paper_config(scale_path(scale))
    committed = json.loads(
        (ROOT / f"experiments/results/paper_logs/{scale}/state/protocol.json").read_text()
    )
    assert protocol_of(cfg) == committed.get("protocol", committed)
    spec = _specs(scale)["train-leafe-oracle"].spec  # type: ignore[attr-defined]
    assert spec.mix == [] and spec.options["rehearsal_fraction"] == 0.2


def test_fair_rows_need_own_rehearsal_and_rounds(tmp_path: Path) -> None:
    base = 'extends = "effect-fair"\nname = "fx"\n'
    path = tmp_path / "fx.toml"
    path.write_text(base + "[effect]\nown_rehearsal = false\n", encoding="utf-8")
    with pytest.raises(ValueError, match="own_rehearsal"):
        load_paper_config(path)
    path.write_text(base + "[effect]\nreflector_rounds = 0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="reflector_rounds"):
        load_paper_config(path)


FAIR = "own_rehearsal = true\nreflector_rounds = 2\n" + 'dagger = { per_rollout = "all" }\n'
ROWS = 'rows = ["warm", "grpo", "dagger", "reh-own", "leafe-oracle", "leafe", "leafe-self"]'


def test_the_runner_runs_every_fair_phase_and_reports_every_row(tmp_path: Path) -> None:
    """Fake steps (the runner's own bookkeeping is real): an inheriting experiment with the fair
    rows runs the reflector's rounds, their audits and every row, and its report names them."""
    import asyncio

    from experiments.paper.runner import Runner
    from experiments.tests.test_paper_carry import WritingSteps
    from experiments.tests.test_paper_effect import TOML
    from experiments.tests.test_paper_effect_rooms import ROOMS_TOML, _parent

    results = tmp_path / "results"
    _parent(tmp_path, results, stop_after="select-warm")
    text = TOML.replace('name = "fx"', 'name = "fxh"').replace('"fx_report"', '"fxh_report"')
    text = text.replace("[effect]\n", '[effect]\ninherit = "fx"\n' + FAIR)
    text = "\n".join(ROWS if line.startswith("rows =") else line for line in text.splitlines())
    path = tmp_path / "fxh.toml"
    path.write_text(text + "\n" + ROOMS_TOML, encoding="utf-8")
    cfg = load_paper_config(path)
    work = tmp_path / "fxh-work"
    runner = Runner(cfg, work, results, 1e18, carried=True)
    steps = WritingSteps(work, runner.state.plan)
    steps.runner = runner
    asyncio.run(runner.run(steps))
    assert not runner.state.blocked
    assert all(f"eval-{r}" in runner.state.phases for r in cfg.rows)
    for r in (1, 2):
        assert {f"reflector-r{r}", f"explore-self-r{r}", f"audit-self-r{r}"} <= set(steps.calls)
    assert steps.calls.index("explore-self-r1") < steps.calls.index("reflector-r2")
    md = (results / "fxh_report.md").read_text()
    assert "DAgger with the oracle" in md and "LEAFE (self-taught e" in md
    assert "leafe-self - reh-own" in md
