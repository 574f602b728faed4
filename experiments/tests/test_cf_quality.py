"""experiments/paper/cf_quality.py: the solver's verdict on every branch's correction, on a
hand-built tree in a real room and on the shipped effect-hard logs (read only, a few seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from experiments.paper.cf_quality import quality_events, quality_log
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.envs.sokoban.generator import render_room
from leafe.envs.sokoban.solver import ACTIONS, apply_move
from tests.support.materializers import Tree

LOGS = Path(__file__).resolve().parents[2] / "experiments/results/paper_logs/effect-hard"
OPTIONS = dict(
    height=7, width=7, num_boxes=1, min_solution_len=5, max_solution_len=12, max_steps=30
)
"""The effect-hard rooms (7x7-l12-w2 without its rollout keys)."""


def _tree(env: SokobanEnv) -> Tree:
    """A root that makes the plan's first move (optimal) then walks into a wall (not); a branch at
    tau 1 that takes the plan's second move (optimal) and succeeds; and a branch of that branch at
    tau 0, whose blamed step is the root's (an ancestor's) first one, repeating it (optimal), and
    fails."""
    task = env.tasks("train")[3]
    g = env.room(task)
    room = g.room
    player, boxes, _ = apply_move(room, room.player, room.boxes, g.plan[0])
    wall = next(m for m in ACTIONS if apply_move(room, player, boxes, m)[2] == "wall")
    tree = Tree(task_id=task, observation=render_room(room))
    tree.step("b0", g.plan[0])
    tree.step("b0", wall)
    tree.outcome("b0", False)
    tree.branch("b0", 1, "b1")
    tree.step("b1", g.plan[1], with_e=True)
    tree.step("b1", "no move")  # an unparseable answer changes nothing: never optimal
    tree.outcome("b1", True)
    tree.branch("b1", 0, "b2")
    tree.step("b2", g.plan[0], with_e=True)
    tree.outcome("b2", False)
    return tree


def _counts(q: dict[str, Any], *keys: str) -> list[tuple[int, int]]:
    """(optimal, judged) of each of ``keys``."""
    return [(q[k]["optimal"], q[k]["n"]) for k in keys]


def test_each_correction_and_the_action_it_replaced_are_judged_at_the_branch_point() -> None:
    env = SokobanEnv(SokobanConfig(**OPTIONS))
    q = quality_events(_tree(env).events, env)
    assert q["trees"] == 1
    # b1 (solved): plan[1] at tau 1 replaces the wall walk; b2: plan[0] again, replacing root's
    # plan[0]
    assert _counts(q, "branch_first", "branch_blamed", "cf_first", "cf_blamed") == [
        (2, 2),
        (1, 2),
        (1, 1),
        (0, 1),
    ]
    # free steps (no e in the prompt): root's two, b1's unparseable second one
    assert (q["free"]["optimal"], q["free"]["n"], q["free"]["dead_state"]) == (1, 3, 0)
    assert q["cf_minus_blamed"]["diff"] == 1.0
    assert q["cf_minus_free"]["diff"] == pytest.approx(2 / 3, abs=1e-4)


def test_a_log_from_other_rooms_is_refused_by_name() -> None:
    env = SokobanEnv(SokobanConfig(**OPTIONS))
    events = _tree(env).events
    other = SokobanEnv(SokobanConfig(**{**OPTIONS, "height": 6, "width": 6, "max_solution_len": 8}))
    with pytest.raises(ValueError, match="not the ones the log was collected with"):
        quality_events(events, other)


def test_shipped_logs_oracle_corrections_all_optimal_model_ones_tie_the_moves_they_replace() -> (
    None
):
    """The oracle names an optimal move and blames one that is not (505 of 505 either way: the
    solver and the oracle agree); the model's 255 corrections are optimal 121 times, the moves they
    replaced 103 times: better than the policy's own steps (28%), but a tie with what they
    replaced."""
    oracle = quality_log(LOGS / "explore-oracle.leafelog.gz", OPTIONS)
    assert _counts(oracle, "cf_first", "cf_blamed") == [(505, 505), (0, 505)]
    model = quality_log(LOGS / "explore-model.leafelog.gz", OPTIONS)
    assert _counts(model, "cf_first", "cf_blamed") == [(121, 255), (103, 255)]
    assert model["cf_minus_free"]["verdict"] == "higher"
    assert model["cf_minus_blamed"]["verdict"].startswith("tie")


def test_the_effect_reports_section_uses_the_chosen_rooms_and_skips_a_missing_log() -> None:
    """The report judges each Stage 1 log in the rooms ``select-rooms`` chose (effect-hard's
    7x7-l12-w2): the oracle's 505 corrections all optimal; a run whose log is missing gives no row;
    before the rooms are chosen there is no section."""
    from types import SimpleNamespace

    from experiments.paper.cf_quality import quality_lines
    from experiments.paper.config import load_paper_config, scale_path

    cfg = load_paper_config(scale_path("effect-hard"))
    phases = {
        "select-rooms": {"variant": "7x7-l12-w2"},
        "explore-oracle": {"log_file": str(LOGS / "explore-oracle.leafelog.gz")},
        "explore-model": {"log_file": "nope"},
    }
    lines = quality_lines(cfg, SimpleNamespace(phases=phases))
    assert (
        "| explore-oracle | cf targets (the first action of a solved branch) | 505 | 100.0 | "
        "[100.0, 100.0] | 0 |" in lines
    )
    assert not any(line.startswith("| explore-model") for line in lines)
    assert (
        quality_lines(
            cfg, SimpleNamespace(phases={k: v for k, v in phases.items() if k != "select-rooms"})
        )
        == []
    )
    # the report is rendered after every phase: a log from other rooms is named, not a crash
    wrong = quality_lines(
        cfg, SimpleNamespace(phases={**phases, "select-rooms": {"variant": "6x6-l14-w2"}})
    )
    assert any(
        line.startswith("- explore-oracle: not judged:") and "collected with" in line
        for line in wrong
    )
