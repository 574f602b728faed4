"""Fixtures of the paper-table tests: a small config and fake phase results in the shapes the real
``experiments/paper/steps.py`` returns, so the runner and the report run without services."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from experiments.paper.config import PaperConfig, load_paper_config
from experiments.paper.phases import (
    AuditSpec,
    CollectSpec,
    EvalSpec,
    Phase,
    ProbeSpec,
    SelectSpec,
    TrainSpec,
)

TOML = """
name = "t"
report_name = "t_report"
train_tasks = 3
val_tasks = 2
val_samples = 2
test_tasks = 8
eval_samples = 4
ks = [1, 4]
[warm]
demo_counts = [4]
epochs = 2
[warm.variants]
a = { max_solution_len = 2 }
b = { max_solution_len = 3 }
[grpo]
rounds = 2
lrs = [1e-5, 3e-5]
[probe]
env = "humaneval"
"""


@pytest.fixture
def small_cfg(tmp_path: Path) -> PaperConfig:
    """A tiny experiment: 2 room variants, 2 GRPO lrs and rounds, 8 test tasks x 4 samples."""
    path = tmp_path / "t.toml"
    path.write_text(TOML, encoding="utf-8")
    return load_paper_config(path)


def _eval(name: str, spec: EvalSpec, wins: dict[str, float]) -> dict[str, Any]:
    rate = wins.get(spec.row or name, 0.25)
    tasks = [f"sokoban/test/{i}" for i in range(8)]
    hits = round(rate * 4)
    return {
        "run_id": f"pt-t-{name}",
        "passk": {"1": rate, "4": min(1.0, 2 * rate)},
        "parse_failure_rate": 0.05,
        "mean_steps": 3.0,
        "successes": {t: [i < hits for i in range(4)] for t in tasks},
        "episodes": 32,
        "task_ids": tasks,
        "samples": 4,
        "wall_s": 60.0,
        "model": "runs/paper/t/x/final",
        "split": "train" if spec.split == "val" else "test",
        "seed": (777 if spec.split == "val" else 12345) + spec.seed_offset,
        "env_options": {"max_solution_len": 2},
        "rollout_overrides": {"horizon": 8, **spec.rollout},
    }


def _collect(spec: CollectSpec) -> dict[str, Any]:
    tree = {
        "branches": 2,
        "reflections": 2,
        "parse_failures": 1,
        "branch_outcomes": 2,
        "branch_successes": 1,
    }
    return {
        "mode": spec.mode,
        "samples_per_task": spec.samples,
        "weights_tag": "base",
        "episodes": 6,
        "episodes_expected": 6,
        "actions": 18,
        "replay_steps": 0,
        "successful_episodes": 2,
        "tasks_solved": 2,
        "tasks": 3,
        "log_file": "x/run.leafelog.gz",
        "log_events": 40,
        "log_bytes": 2048,
        "tree": {**tree, "experiences": [{"tau": 0, "source": "model", "experience": "go left"}]},
        "collect_wall_s": 30.0,
        "wall_s": 30.0,
    }


def _train(spec: TrainSpec) -> dict[str, Any]:
    epochs = spec.epochs if isinstance(spec.epochs, int) else 2
    weights = {str(e): f"w/{e}" for e in range(1, epochs + 1)}
    head = {
        "replayed": 12,
        "start": spec.start,
        "lr": 1e-5,
        "epochs": epochs,
        "samples": 12,
        "demos": 0,
    }
    head.update(
        source_log=f"logs/{spec.data}.leafelog.gz", start_weights=f"runs/paper/t/{spec.start}/final"
    )
    head.update(config={"trainer": {"precision": "bf16"}})
    return {
        **head,
        "kinds": {"sft": 12},
        "steps": 2,
        "losses": [1.0, 0.5],
        "tokens": 3000,
        "final": "w/f",
        "epoch_weights": weights,
        "wall_s": 120.0,
    }


def _select(spec: SelectSpec) -> dict[str, Any]:
    base = {"chosen": spec.candidates[0], "rule_met": True, "why": "fake", "candidates": []}
    if spec.what == "sft":
        return {
            **base,
            "variant": "a",
            "env_options": {"max_solution_len": 2},
            "demos": 4,
            "epochs": 1,
            "weights": "w/1",
            "val_phase": spec.candidates[0],
        }
    if spec.what == "grpo-lr":
        return {**base, "lr": 1e-5, "weights": "w/f", "round": 1}
    if spec.what == "warm":
        return {**base, "epochs": 1, "weights": "w/1", "val_phase": spec.candidates[0]}
    if spec.what == "rooms":
        variant = spec.candidates[0].removeprefix("val-rooms-")
        return {
            **base,
            "variant": variant,
            "env_options": {},
            "weights": "w/1",
            "val_phase": spec.candidates[0],
        }
    return {**base, "round": 1, "weights": "w/f", "beats_start": False, "curve": []}


class FakeSteps:
    """Returns canned results; ``calls`` records the phases run; ``fail`` names phases that raise;
    ``on_first`` runs before the first phase (to look at what was written before any phase)."""

    def __init__(
        self,
        wins: dict[str, float] | None = None,
        fail: tuple[str, ...] = (),
        on_first: Callable[[], None] | None = None,
        follow: float = 0.9,
    ) -> None:
        self.wins, self.fail, self.on_first, self.follow = wins or {}, fail, on_first, follow
        self.calls: list[str] = []

    async def run(self, phase: Phase) -> dict[str, Any]:
        if not self.calls and self.on_first is not None:
            self.on_first()
        self.calls.append(phase.name)
        if phase.name in self.fail:
            raise RuntimeError(f"{phase.name} broke")
        spec = phase.spec
        if isinstance(spec, EvalSpec):
            return _eval(phase.name, spec, self.wins)
        if isinstance(spec, CollectSpec):
            return _collect(spec)
        if isinstance(spec, TrainSpec):
            return _train(spec)
        if isinstance(spec, SelectSpec):
            return _select(spec)
        if isinstance(spec, AuditSpec):
            gate = {
                "threshold": 0.7,
                "follow_rate": self.follow,
                "without_e": 0.2,
                "passed": self.follow >= 0.7,
            }
            return {"gate": gate, "summary": {"verdicts": 10}, "report": "x.md", "wall_s": 5.0}
        assert isinstance(spec, ProbeSpec)
        return {**_eval(phase.name, EvalSpec(model="base", split="test"), {}), "s_per_episode": 2.0}


@pytest.fixture
def fake_steps() -> type[FakeSteps]:
    """The :class:`FakeSteps` class."""
    return FakeSteps
