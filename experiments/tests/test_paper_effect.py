"""The ``effect`` protocol as data and through the runner with fake phase results: every
row starts from the one shared warm start and comes after the follow gate; a gate that is not met
blocks every row and the report says why; the distillation rows train the same number of steps; the
protocol records the label and audit ranges and the gate before anything runs."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from experiments.paper.config import PaperConfig, load_paper_config
from experiments.paper.effect import GATE
from experiments.paper.phases import AuditSpec, CollectSpec, EvalSpec, TrainSpec, closure
from experiments.paper.plans import plan
from experiments.paper.runner import Runner

TOML = """
name = "fx"
report_name = "fx_report"
protocol = "effect"
rows = ["warm", "leafe", "reh", "leafe-oracle", "reh-oracle", "grpo"]
train_tasks = 3
val_tasks = 2
val_samples = 4
test_tasks = 8
eval_samples = 4
ks = [1, 4]
[warm]
demo_counts = [4]
epochs = 1
max_passk = 0.7
[warm.variants]
w0 = { max_solution_len = 3, horizon = 10, history_window = 0 }
w2 = { max_solution_len = 3, horizon = 10, history_window = 2 }
[effect]
label_tasks = 3
audit_tasks = 2
row_steps = 5
explorer = { max_corrections = 3, stop_on_first_success = false }
[grpo]
rounds = 1
"""


@pytest.fixture
def fx_cfg(tmp_path: Path) -> PaperConfig:
    path = tmp_path / "fx.toml"
    path.write_text(TOML, encoding="utf-8")
    return load_paper_config(path)


def test_every_row_starts_from_the_warm_start_and_comes_after_the_gate(fx_cfg: PaperConfig) -> None:
    """All trainings of rows start from ``warm``; every test evaluation needs the gate; no test
    evaluation is needed by a choice (choices use validation only); the warm start mixes
    demonstrations, reflections and following; both Stage-1 collections run the paper's tree from
    the warm start."""
    phases = plan(fx_cfg)
    by = {p.name: p for p in phases}
    names = [p.name for p in phases]
    assert len(names) == len(set(names)) and all(
        set(p.deps) <= set(names[:i]) for i, p in enumerate(phases)
    )
    tests = [p.name for p in phases if isinstance(p.spec, EvalSpec) and p.spec.split == "test"]
    assert sorted(tests) == sorted(f"eval-{r}" for r in fx_cfg.rows)
    for t in tests:
        assert GATE in closure(phases, [t]), t
    for p in phases:
        if not isinstance(p.spec, EvalSpec) or p.spec.split != "test":
            assert not any(n.startswith("eval-") for n in closure(phases, [p.name]) - {p.name}), (
                p.name
            )
    warm = by["warm-train"].spec
    assert isinstance(warm, TrainSpec) and warm.start == "base" and warm.data == "demos:chosen"
    assert [(m.data, m.materializer) for m in warm.mix] == [
        ("labels", "reflect"),
        ("labels", "follow"),
    ]
    for name in (
        "train-leafe",
        "train-reh",
        "train-leafe-oracle",
        "train-reh-oracle",
        "grpo-r1-train-lr0",
    ):
        assert by[name].spec.start == "warm", name  # type: ignore[union-attr]
    model, oracle = by["explore-model"].spec, by["explore-oracle"].spec
    assert isinstance(model, CollectSpec) and isinstance(oracle, CollectSpec)
    assert model.model == oracle.model == "warm"
    assert model.explorer["oracle_labels"] and oracle.explorer["reflection_source"] == "oracle"
    assert model.explorer["max_corrections"] == 3 and not model.explorer["stop_on_first_success"]
    audit = by[GATE].spec
    assert isinstance(audit, AuditSpec) and audit.model == "warm" and audit.data == "audit-collect"


def test_the_distillation_rows_train_equal_steps(fx_cfg: PaperConfig) -> None:
    """LEAFE and L_reh of both tree sets: the same optimizer steps, lr and start (only the data
    differs)."""
    by = {p.name: p.spec for p in plan(fx_cfg)}
    rows = [by[n] for n in ("train-leafe", "train-reh", "train-leafe-oracle", "train-reh-oracle")]
    assert all(isinstance(r, TrainSpec) for r in rows)
    assert {(r.steps, r.lr, r.start) for r in rows} == {(5, fx_cfg.effect.row_lr, "warm")}  # type: ignore[union-attr]
    assert by["train-reh"].kinds == ["reh"] and by["train-leafe"].kinds == []  # type: ignore[union-attr]
    assert by["train-leafe"].options["rehearsal_unit"] == "path"  # type: ignore[union-attr]


def _run(cfg: PaperConfig, tmp_path: Path, steps: Any) -> Runner:
    runner = Runner(cfg, tmp_path / "work", tmp_path / "results", 1e18)
    asyncio.run(runner.run(steps))
    return runner


def test_a_gate_not_met_blocks_every_row_and_the_report_says_why(
    fx_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """Follow rate 40% < 70%: the warm start and the audit run, no row does, and the report names
    the gate."""
    steps = fake_steps(follow=0.4)
    runner = _run(fx_cfg, tmp_path, steps)
    assert GATE in steps.calls and not any(
        c.startswith(("eval-", "explore-", "train-", "grpo-")) for c in steps.calls
    )
    assert (
        "eval-warm" in runner.state.blocked
        and "the gate was not met" in runner.state.blocked["eval-warm"]
    )
    md = (tmp_path / "results" / "fx_report.md").read_text()
    assert "NOT MET" in md and "follow rate 40.0% with e" in md


def test_a_gate_met_runs_every_row_with_verdicts(
    fx_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """Follow rate 90%: every row is evaluated and every comparison of the protocol gets a verdict;
    the registered protocol holds the effect ranges and the gate."""
    runner = _run(fx_cfg, tmp_path, fake_steps(follow=0.9, wins={"leafe": 0.75}))
    assert all(f"eval-{r}" in runner.state.phases for r in fx_cfg.rows)
    report = json.loads((tmp_path / "results" / "fx_report.json").read_text())
    assert {(c["a"], c["b"]) for c in report["comparisons"]} >= {
        ("leafe", "reh"),
        ("leafe", "grpo"),
    }
    proto = json.loads((tmp_path / "work" / "protocol.json").read_text())["protocol"]
    assert proto["effect"]["follow_gate"] == 0.7 and proto["effect"]["label_rooms"]["first"] == 3000
    md = (tmp_path / "results" / "fx_report.md").read_text()
    assert "LEAFE (model e) - L_reh only (model-e trees)" in md and "PASSED" in md
    cores = os.cpu_count()
    # 1 correction in 6 trees, 0.5 min of collection on this host's cores
    assert f"| explore-model | 6 | 1 | 0.17 | 0.5 | {1 / (0.5 * cores):.2f} |" in md


def test_overlapping_train_ranges_are_refused(tmp_path: Path) -> None:
    """Label rooms inside the RL range would train the warm start on the rooms Stage 1 explores."""
    path = tmp_path / "bad.toml"
    path.write_text(
        TOML.replace("label_tasks = 3", "label_tasks = 3\nlabel_offset = 1001"), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="disjoint"):
        load_paper_config(path)
