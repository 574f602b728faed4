"""``leafe run``'s report (services/run/report.py): data first, prose rendered from it, verdicts
honest."""

from __future__ import annotations

from leafe.actors.evaluate import EvalResult
from leafe.actors.passk import PassKDiff
from leafe.services.run.presets import resolve_run_config
from leafe.services.run.report_data import DatasetCheck, RunReport, RunSummary, part_comparisons
from leafe.services.run.report_md import render_report


def _eval(label: str, rate: float, successes: dict[str, list[bool]] | None = None) -> EvalResult:
    return EvalResult(
        label=label,
        run_id="r",
        env="sokoban",
        split="test",
        samples=2,
        task_ids=sorted(successes or {"a": []}),
        successes=successes or {"a": [True, False]},
        passk={1: rate, 2: rate},
        success_rate=rate,
        mean_steps=3.0,
        parse_failure_rate=0.1,
        mean_prompt_tokens=200.0,
        wall_s=10.0,
        weight_version=label.rsplit("-", 1)[-1],
        policy_versions=[label.rsplit("-", 1)[-1]],
        episodes=2,
        env_errors=0,
    )


def _report(comparisons: list[PassKDiff], **extra: object) -> RunReport:
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
    evals = {"before": _eval("before", 0.25), "after-v000003": _eval("after-v000003", 0.5)}
    return RunReport(
        run_id="r",
        model="tiny",
        env="sokoban",
        env_options={},
        materializer="leafe",
        evals=extra.pop("evals", evals),  # type: ignore[arg-type]
        comparisons=comparisons,
        run=run,
        timings={"total": 60.0},
        dataset=DatasetCheck(samples=2, content_sha256="ab" * 32, stream_samples=2, identical=True),
        **extra,  # type: ignore[arg-type]
    )


def test_an_interval_containing_zero_is_reported_as_within_noise() -> None:
    """A gain whose interval contains 0 reads "within noise", never as better; one above 0 reads
    better."""
    cfg = resolve_run_config("tiny").eval
    noisy = render_report(_report([PassKDiff(k=1, diff=0.25, lo=-0.1, hi=0.6, tasks=6)]), cfg)
    assert "| Pass@1 | +25.0 | [-10.0, +60.0] | within noise |" in noisy
    clear = render_report(_report([PassKDiff(k=2, diff=0.25, lo=0.05, hi=0.4, tasks=6)]), cfg)
    assert "| Pass@2 | +25.0 | [+5.0, +40.0] | better |" in clear
    assert "is identical to the 2 samples" in clear


def test_each_part_is_its_evaluation_minus_the_one_before_it_paired() -> None:
    """Before, after the warm start and after the rounds on the same tasks: the warm start's part is
    (warm - before), the rounds' part (after - warm), each a paired difference per k; a part whose
    two evaluations served the same weights says so; the parts add up to after - before."""
    tasks = [f"t{i}" for i in range(6)]
    before = _eval("before", 0.0, {t: [False, False] for t in tasks})
    warm = _eval("warm-v000002", 0.5, {t: [i % 2 == 0, False] for i, t in enumerate(tasks)})
    after = _eval("after-v000002", 0.5, dict(warm.successes))
    evals = {"before": before, "warm-v000002": warm, "after-v000002": after}
    warm_part, rounds = part_comparisons(evals, "explore")
    assert (warm_part.part, warm_part.label, warm_part.baseline) == (
        "warm start",
        "warm-v000002",
        "before",
    )
    assert (rounds.part, rounds.baseline, rounds.same_weights) == (
        "LEAFE rounds",
        "warm-v000002",
        True,
    )
    assert [d.k for d in warm_part.diffs] == [1, 2] and warm_part.diffs[0].diff == 0.25
    assert all(d.diff == 0 and d.within_noise for d in rounds.diffs)
    text = render_report(
        _report([], evals=evals, parts=[warm_part, rounds]), resolve_run_config("tiny").eval
    )
    assert (
        "## What each part did" in text
        and "**LEAFE rounds** (`after-v000002` - `warm-v000002`)" in text
    )
    assert "the same weights" in text and "| warm start | difference (points) |" in text
    assert part_comparisons({"before": before, "after-v000002": after}, "explore") == []


def test_the_report_says_what_bounded_the_run_and_what_a_budget_cut() -> None:
    """Without a budget the report says the work bounds the run; with one it names what it cut."""
    cfg = resolve_run_config("tiny").eval
    assert "| wall-clock budget | none: the work bounds the run |" in render_report(
        _report([]), cfg
    )
    cut = _report(
        [], budget_minutes=12.0, cuts=["round 0: 2 of 8 tasks finished"], schedule="phased"
    )
    text = render_report(cut, cfg)
    assert "| wall-clock budget | 12 min; it cut round 0: 2 of 8 tasks finished |" in text
    assert "| schedule | phased |" in text


def test_the_report_counts_the_learners_clipped_and_skipped_steps() -> None:
    """Issue 62: the learner's step counts are a line of report.md."""
    counts = {"taken": 9, "partial": 1, "grad_clipped": 2, "dual_clipped": 3, "skipped": 4}
    text = render_report(_report([], step_counts=counts), resolve_run_config("tiny").eval)
    assert (
        "Learner steps (its last process): 9 taken, of them 1 on a partial batch, 2 with the "
        "gradient norm clipped, 3 with a GRPO token dual-clipped; 4 batches skipped (nothing "
        "left to train)."
    ) in text
