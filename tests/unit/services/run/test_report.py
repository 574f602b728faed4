"""``leafe run``'s report (services/run/report.py): data first, prose rendered from it, verdicts honest."""

from __future__ import annotations

from actors.evaluate import EvalResult
from actors.passk import PassKDiff
from services.run.presets import resolve_run_config
from services.run.report import DatasetCheck, RunReport, RunSummary, render_report


def _eval(label: str, rate: float) -> EvalResult:
    return EvalResult(
        label=label,
        run_id="r",
        env="sokoban",
        split="test",
        samples=2,
        task_ids=["a"],
        successes={"a": [True, False]},
        passk={1: rate, 2: rate},
        success_rate=rate,
        mean_steps=3.0,
        parse_failure_rate=0.1,
        mean_prompt_tokens=200.0,
        wall_s=10.0,
        weight_version=label,
        policy_versions=[label],
        episodes=2,
        env_errors=0,
    )


def _report(comparisons: list[PassKDiff]) -> RunReport:
    run = RunSummary(
        episodes=4,
        successes=1,
        steps=30,
        unparseable=5,
        reflections=2,
        rollbacks=2,
        branches=2,
        replay_steps=0,
        events=60,
        samples={"cf": 2},
        learner_step=3,
        learner_loss=1.5,
        weights_version="v000003",
    )
    return RunReport(
        run_id="r",
        model="tiny",
        env="sokoban",
        env_options={},
        materializer="leafe",
        evals={"before": _eval("before", 0.25), "after-v000003": _eval("after-v000003", 0.5)},
        comparisons=comparisons,
        run=run,
        timings={"total": 60.0},
        dataset=DatasetCheck(samples=2, content_sha256="ab" * 32, stream_samples=2, identical=True),
    )


def test_an_interval_containing_zero_is_reported_as_within_noise() -> None:
    """A gain whose interval contains 0 reads "within noise", never as better; one above 0 reads better."""
    cfg = resolve_run_config("tiny").eval
    noisy = render_report(_report([PassKDiff(k=1, diff=0.25, lo=-0.1, hi=0.6, tasks=6)]), cfg)
    assert "| Pass@1 | +25.0 | [-10.0, +60.0] | within noise |" in noisy
    clear = render_report(_report([PassKDiff(k=2, diff=0.25, lo=0.05, hi=0.4, tasks=6)]), cfg)
    assert "| Pass@2 | +25.0 | [+5.0, +40.0] | better |" in clear
    assert "is identical to the 2 samples" in clear
