"""experiments/paper/reflect_audit.py: tau agreement and rolled-back successes, on the real
explorer's events and on the shipped model-reflection log (read only, well under a second)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.paper.reflect_audit import audit_events, audit_log, main, reflection_rows
from leafe.actors.config import ExplorerConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, ScriptedEngine
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.protocol.events import Branch, EpisodeEvent, Reflection

LOGS = Path(__file__).resolve().parents[2] / "experiments/results/paper_logs/full"
ROOMS = SokobanConfig(height=7, width=7, min_solution_len=3, max_solution_len=6, max_steps=20)


async def _labelled_run(model_tau: int, e: str = "Push the box first.") -> list[EpisodeEvent]:
    """A policy that only moves down (never solves) and blames step ``model_tau`` with experience
    ``e``; the oracle blames 0."""
    env = SokobanEnv(ROOMS)
    task_id = env.tasks("train")[0]
    answer = f"<step>{model_tau}</step><experience>{e}</experience>"
    engine = ScriptedEngine(default_action="<action>down</action>", default_reflection=answer)
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="r1", episode_id="a1", actor_id="a", task_key="k", env="sokoban", task_id=task_id
    )
    config = ExplorerConfig.for_env("sokoban", {"oracle_labels": True, "horizon": 4, "k": 0})
    await Explorer(
        engine=engine, tokenizer=ByteChatTokenizer(), env=env, config=config, sink=sink, spec=spec
    ).run()
    return sink.events


@pytest.mark.anyio
@pytest.mark.parametrize(("model_tau", "agree"), [(0, True), (2, False)])
async def test_tau_agreement_and_branch_outcomes_of_labelled_model_reflections(
    model_tau: int, agree: bool
) -> None:
    """Every model reflection is labelled; tau agrees with the oracle's (0) exactly when the model
    says 0; each opened branch is joined to its Outcome (none succeeds: the policy only moves
    down)."""
    events = await _labelled_run(model_tau)
    n = sum(isinstance(e, Reflection) for e in events)
    opened = sum(isinstance(e, Branch) for e in events)
    assert n >= 2 and opened >= 1
    model = audit_events(events)["model"]
    assert (
        model["reflections"],
        model["parsed"],
        model["labelled"],
        model["labelled_mistake"],
    ) == (
        n,
        n,
        n,
        n,
    )
    assert model["tau_agree" if agree else "tau_disagree"] == n and model[
        "tau_agree_share"
    ] == float(agree)
    assert model["tau_chance_share"] == 0.25  # every reflection at step 4 (the horizon): 1 tau in 4
    assert (model["branches"], model["branches_succeeded"]) == (opened, 0)
    rows = reflection_rows(events)
    assert [r["opened_branch"] is not None for r in rows].count(True) == opened
    assert all(r["branch_success"] is False for r in rows if r["opened_branch"] is not None)


def _fixes(events: list[EpisodeEvent]) -> tuple[list[dict[str, object]], dict[str, object]]:
    rows = [r for r in reflection_rows(events) if r["oracle_action"] and r["oracle_mistake"]]
    return rows, audit_events(events)["model"]


@pytest.mark.anyio
async def test_the_fix_a_model_e_names_is_compared_with_the_oracles_move() -> None:
    """The model's e "move X instead" agrees with the oracle's fix exactly where the oracle names X
    (X: an action the log shows); an e naming no such move is counted apart; each labelled mistake
    with an oracle move lands in exactly one class, and tau agreeing too (0 here) makes
    ``both_agree``."""
    rows, model = _fixes(await _labelled_run(0, "Push the box first."))
    assert rows and all(r["named_action"] == "" for r in rows)
    assert (model.get("fix_agree", 0), model.get("fix_disagree", 0), model["fix_unnamed"]) == (
        0,
        0,
        len(rows),
    )
    oracle = str(rows[0]["oracle_action"])
    for move in (
        oracle,
        "down",
    ):  # the oracle's fix; the move the policy makes (never the fix here)
        e = f"At step 0 the box got stuck. From there, move {move} instead."
        rows, model = _fixes(await _labelled_run(0, e))
        agree = sum(r["oracle_action"] == move for r in rows)
        assert (agree > 0) == (move == oracle) and all(r["named_action"] == move for r in rows), (
            move
        )
        assert (model.get("fix_agree", 0), model.get("fix_disagree", 0)) == (
            agree,
            len(rows) - agree,
        )
        assert model.get("both_agree", 0) == agree and model.get("fix_unnamed", 0) == 0


def test_the_shipped_model_log_gives_the_issues_22_of_295(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The quoted figure: 22 of 295 rolled-back branches solved; not one of the 334 model answers
    parsed cleanly (all fell back to untagged forms), and the log carries no oracle labels."""
    path = LOGS / "explore-grpo.leafelog.gz"
    model = audit_log(path)["model"]
    assert (model["branches"], model["branches_succeeded"]) == (295, 22)
    assert (model["reflections"], model["parsed"], model.get("labelled", 0)) == (334, 0, 0)
    assert main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["branches_succeeded"] == 22


def test_the_effect_reports_table_of_model_e_against_the_oracle_from_the_shipped_log() -> None:
    """W's own e on the shipped Stage-1 log: tau agrees with the oracle 25.9% (a uniform tau:
    16.5%), the fix move 37.5%; a phase whose log is missing gives no row, and with no labelled log
    there is no section."""
    from types import SimpleNamespace

    from experiments.paper.effect_report import _reflect_lines

    log = LOGS.parent / "effect" / "explore-model.leafelog.gz"
    state = SimpleNamespace(
        phases={"explore-model": {"log_file": str(log)}, "labels": {"log_file": "nope"}}
    )
    lines = _reflect_lines(state, ("labels", "explore-model"))
    rows = [line for line in lines if line.startswith("| explore-model")]
    assert (
        len(rows) == 1
        and "| 1253 | 25.9 (16.5) | 37.5 | 12.5 | 37.1 / 26.0 / 14.4 / 18.9 |" in rows[0]
    )
    assert not any(line.startswith("| labels") for line in lines)
    assert _reflect_lines(SimpleNamespace(phases={}), ("explore-model",)) == []
