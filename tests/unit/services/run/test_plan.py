"""The plan of a run and the time left (services/run/plan.py): every stage's planned work from the
config, work done counted from the log, and estimates only from rates this run measured."""

from __future__ import annotations

from leafe.services.run.plan import RunPlan, plan_stages, stage_key
from leafe.services.run.presets import resolve_run_config
from leafe.services.run.progress import RunProgress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_default_run_plans_every_stage_with_its_work() -> None:
    """make run's plan: 96 held-out episodes before, 128 demonstrations and their training, the
    held-out evaluation after the warm start, 8 trees and their training, the drain, the evaluation
    after and the report; training steps are not known before the samples are."""
    cfg = resolve_run_config("default")
    plan = [(s.key, s.unit, s.planned) for s in plan_stages(cfg)]
    assert plan == [
        ("evaluating before", "episodes", 96),
        ("warm start", "episodes", 128),
        ("training warm start pass 0", "steps", None),
        ("evaluating warm", "episodes", 96),
        ("exploring round 0", "episodes", 8),
        ("training round 0", "steps", None),
        ("draining", "", None),
        ("evaluating after", "episodes", 96),
        ("finishing", "", None),
    ]
    assert stage_key("evaluating warm-v000012") == "evaluating warm"


def test_progress_says_work_done_of_planned_and_time_left_from_measured_rates() -> None:
    """Each stage counts its own work from the log's counters; the time left of a stage and of the
    run comes from the rate of the same kind of work measured so far, and stages whose kind has no
    rate yet are counted as not yet timed, never guessed."""
    clock, p = Clock(), RunProgress(run_id="r")
    plan = RunPlan(plan_stages(resolve_run_config("default")), clock=clock)
    p.episodes_finished = {"eval": 0}
    plan.enter("evaluating before", p)
    assert plan.line() == "0/96 episodes | run: 9 stages not yet timed"
    clock.t, p.episodes_finished = 60.0, {"eval": 24}
    plan.update(
        p
    )  # 24 episodes in 60 s: 0.4 per second; 72 left here, 96 + 96 in later evaluations
    assert plan.line() == "24/96 episodes, ~03:00 left | run ~11:00 left + 6 stages not yet timed"
    clock.t, p.episodes_finished = 240.0, {"eval": 96}
    plan.enter("warm start", p)
    clock.t, p.episodes_finished = 250.0, {"eval": 96, "demo": 64}
    plan.update(p)
    assert plan.line().startswith("64/128 episodes, ~00:10 left | run ~08:10 left + 5 stages")
    plan.enter("training warm start pass 0", p)
    plan.expect("training warm start pass 0", 12)
    assert plan.line().startswith("0/12 steps | run ~08:00 left")
