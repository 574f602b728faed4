"""experiments/paper/reflector_audit.py: each reflection judged at the state its branch starts from,
on hand-built trees in a real room, and the shares recounted from the written records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.paper.reflector_audit import (
    judge_records,
    main,
    read_records,
    summarize,
    write_outputs,
)
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.envs.sokoban.generator import render_room
from leafe.envs.sokoban.solver import ACTIONS, apply_move, solve
from tests.support.materializers import Tree

OPTIONS = dict(
    height=7, width=7, num_boxes=1, min_solution_len=5, max_solution_len=12, max_steps=30
)


def _env() -> SokobanEnv:
    return SokobanEnv(SokobanConfig(**OPTIONS))


def _tree(env: SokobanEnv, episode: str = "ep1") -> tuple[Tree, dict[str, str]]:
    """Root b0: the plan's first move, then a walk into a wall. b1 (from b0 at tau 1, the wall
    walk blamed): e names the solver's move at b1's start, b1 takes it and succeeds. b2 (from b1
    at tau 0, so the blamed step is the root's, an ancestor's): e names a move that walks into a
    wall at the room's start; b2 fails."""
    task = env.tasks("train")[3]
    g = env.room(task)
    room = g.room
    p1, b1_boxes, _ = apply_move(room, room.player, room.boxes, g.plan[0])
    wall1 = next(m for m in ACTIONS if apply_move(room, p1, b1_boxes, m)[2] == "wall")
    fix1 = solve(room.with_state(p1, b1_boxes))[0]  # type: ignore[index]
    wall0 = next(m for m in ACTIONS if apply_move(room, room.player, room.boxes, m)[2] == "wall")
    tree = Tree(episode, task_id=task, observation=render_room(room))
    tree.step("b0", g.plan[0])
    tree.step("b0", wall1)
    tree.outcome("b0", False)
    tree.branch("b0", 1, "b1", experience=f"At step 1 you hit a wall. Move {fix1} instead.")
    tree.step("b1", fix1, with_e=True)
    tree.outcome("b1", True)
    tree.branch("b1", 0, "b2", experience=f"At step 0, move {wall0} instead.")
    tree.step("b2", wall0, with_e=True)
    tree.outcome("b2", False)
    return tree, {"fix1": fix1, "wall0": wall0, "plan0": g.plan[0], "wall1": wall1}


def test_each_reflection_is_judged_at_its_branch_start_not_the_root() -> None:
    env = _env()
    tree, moves = _tree(env)
    recs = {r["branch_id"]: r for r in judge_records(tree.events, env)}
    b1, b2 = recs["b1"], recs["b2"]
    # b1 starts after the plan's first move: e names the solver's move there
    assert (b1["named_move"], b1["legal"], b1["fix"], b1["optimal"]) == (
        moves["fix1"],
        True,
        True,
        True,
    )
    assert b1["plan_move"] == moves["fix1"] and b1["success"] is True
    # the blamed step is the wall walk: no progress (a real mistake) but not a longer solution
    assert (b1["blamed_move"], b1["mistake"], b1["worse"]) == (moves["wall1"], True, False)
    # one of the two steps of the reflected path was not optimal
    assert b1["chance_mistake"] == pytest.approx(0.5)
    # b2 starts at the room's start (tau 0 of a branch: the root's step is the blamed one)
    assert (b2["named_move"], b2["legal"], b2["fix"]) == (moves["wall0"], False, False)
    assert (b2["blamed_move"], b2["mistake"]) == (moves["plan0"], False)
    assert b2["success"] is False
    assert b2["chance_legal"] == len(b2["legal_moves"]) / 4 < 1
    assert b2["chance_fix"] == 0.25


def test_shares_split_by_outcome_and_counted_over_named_or_blamed() -> None:
    env = _env()
    t1, _ = _tree(env, "ep1")
    t2, _ = _tree(env, "ep2")
    s = summarize(judge_records(t1.events + t2.events, env))
    assert (s["trees"], s["branches"], s["branches_succeeded"]) == (2, 4, 2)
    assert (s["all"]["fix"]["k"], s["all"]["fix"]["n"]) == (2, 4)
    assert s["succeeded"]["fix"]["share"] == 1.0 and s["failed"]["fix"]["share"] == 0.0
    assert s["all"]["legal"]["share"] == 0.5
    assert s["all"]["mistake"]["share"] == 0.5
    assert s["succeeded"]["mistake"]["interval"] == [1.0, 1.0]


def test_an_unparsed_reflection_that_opened_a_branch_is_judged_by_the_branch_e() -> None:
    env = _env()
    tree, moves = _tree(env)
    events = [
        e.__class__(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "parse_ok": False})
        if e.__class__.__name__ == "Reflection"
        else e
        for e in tree.events
    ]
    recs = {r["branch_id"]: r for r in judge_records(events, env)}
    assert recs["b1"]["named_move"] == moves["fix1"] and recs["b1"]["fix"] is True


def test_records_recount_to_the_same_figures(tmp_path: Path) -> None:
    env = _env()
    tree, _ = _tree(env)
    recs = judge_records(tree.events, env, log="model")
    figures = {"options": OPTIONS, "model": {"log": "model", **summarize(recs)}}
    paths = write_outputs(tmp_path / "audit", figures, recs)
    assert [p.name for p in paths] == ["audit.json", "audit.md", "audit_records.jsonl"]
    assert read_records(paths[2]) == json.loads(json.dumps(recs))
    assert (
        main(
            [
                "--options",
                json.dumps(OPTIONS),
                "--recount",
                str(paths[2]),
                "--out",
                str(tmp_path / "again"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(paths[0].read_text())
    assert "| fix | succeeded | 1 | 100.0 |" in paths[1].read_text()


def test_the_fair_report_audits_each_rounds_trees_from_the_phase_logs() -> None:
    """The report's section reads each round's log from its phase record, on the chosen rooms (the
    shipped audit-collect log of effect-hard: W's trees on held-out audit rooms, round 0)."""
    from types import SimpleNamespace

    from experiments.paper.config import load_paper_config, scale_path
    from experiments.paper.reflector_audit import reflector_lines

    logs = Path(__file__).resolve().parents[2] / "experiments/results/paper_logs/effect-hard"
    cfg = load_paper_config(scale_path("effect-fair"))
    state = SimpleNamespace(
        phases={
            "select-rooms": {"variant": "7x7-l12-w2"},
            "audit-collect": {"log_file": str(logs / "audit-collect.leafelog.gz")},
        }
    )
    lines = reflector_lines(cfg, state)
    (row,) = [x for x in lines if x.startswith("| 0 |")]
    assert row.startswith("| 0 | audit (audit-collect) | 64 | 26.6 [")
    hard = load_paper_config(scale_path("effect-hard"))
    assert reflector_lines(hard, state) == []  # not in the protocols registered before
