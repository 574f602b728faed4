"""``report.md`` of ``leafe run``, rendered from the report's data
(``services/run/report_data.py``): the Pass@k table with a paired interval and verdict per k, what
each part of the run did, the run's counters, the rounds and learning curve, and whether the offline
rebuild equals what the learner was fed."""

from __future__ import annotations

from typing import Any

from leafe.actors.passk import PassKDiff
from leafe.services.figures import passk_markdown
from leafe.services.run.report_data import PartComparison, RunReport

__all__ = ["render_report"]


def _verdict(d: PassKDiff) -> str:
    if d.within_noise:
        return "within noise"
    return "better" if d.diff > 0 else "worse"


def _eval_lines(r: RunReport, cfg_eval: Any) -> list[str]:
    table = {label: e.passk for label, e in r.evals.items()}
    title = (
        f"Pass@k on {cfg_eval.tasks} {cfg_eval.split} tasks, "
        f"n = {cfg_eval.samples} samples each (%)"
    )
    lines = [passk_markdown(table, title=title), "![Pass@k](passk.png)", ""]
    for label, e in r.evals.items():
        lines.append(
            f"- {label}: weights `{e.weight_version}`, success rate {100 * e.success_rate:.1f}%, "
            f"{e.mean_steps:.1f} actions/episode, {100 * e.parse_failure_rate:.0f}% unparseable, "
            f"{e.mean_prompt_tokens:.0f} prompt tokens/step, {e.wall_s:.0f} s"
        )
    if r.comparisons:
        lines += ["", *_diff_table("after - before", r.comparisons)]
        lines += [
            "",
            f"Two-level bootstrap over the {r.comparisons[0].tasks} tasks and their samples. "
            '"within noise": the '
            "interval contains 0, so these evaluations cannot tell the weights apart; evaluate "
            "more tasks "
            "(`[eval] tasks`) for a verdict that means something.",
        ]
    return [*lines, ""]


def _diff_table(title: str, diffs: list[PassKDiff]) -> list[str]:
    lines = [f"| {title} | difference (points) | 95% interval | verdict |", "|---|---|---|---|"]
    for d in diffs:
        lines.append(
            f"| Pass@{d.k} | {100 * d.diff:+.1f} | [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}] | "
            f"{_verdict(d)} |"
        )
    return lines


def _parts_lines(parts: list[PartComparison]) -> list[str]:
    """What each part did: one paired table per part (its evaluation minus the one before it)."""
    if not parts:
        return []
    lines = [
        "## What each part did",
        "",
        "Each part's evaluation on the held-out tasks minus the one before it, paired (same tasks, "
        "same "
        "sampling seeds); the parts add up to after - before.",
        "",
    ]
    for p in parts:
        same = (
            " (the same weights: this part changed nothing the engines serve)"
            if p.same_weights
            else ""
        )
        lines += [f"**{p.part}** (`{p.label}` - `{p.baseline}`){same}", ""]
        lines += [*_diff_table(p.part, p.diffs), ""]
    return lines


def _budget(r: RunReport) -> str:
    if r.budget_minutes <= 0:
        return "none: the work bounds the run"
    cut = "; ".join(r.cuts) if r.cuts else "nothing"
    return f"{r.budget_minutes:g} min; it cut {cut}"


def _continual_lines(r: RunReport) -> list[str]:
    """Rounds, the learning curve and the policy-lag histogram (when there are any)."""
    lines: list[str] = []
    if len(r.rounds) > 1 or r.curve:
        lines += [
            "## Continual rounds",
            "",
            "| round | tasks | finished | min | episodes (success) | learner step | weights |",
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        for x in r.rounds:
            lines.append(
                f"| {x.round} | {x.tasks} | {'yes' if x.finished else 'cut'} | {x.wall_s / 60:.1f} "
                "| "
                f"{x.episodes} ({x.successes}) | {x.learner_step} | {x.weights_version} |"
            )
        lines.append("")
    if r.curve:
        ks = sorted({k for p in r.curve for k in p.passk})
        head = " | ".join(f"Pass@{k}" for k in ks)
        lines += [
            "## Learning curve (validation slice of the train split)",
            "",
            f"| round | min | learner step | version | {head} | unparseable | eval s |",
        ]
        lines += ["|---" * (6 + len(ks)) + "|"]
        for p in r.curve:
            cells = " | ".join(f"{100 * p.passk.get(k, 0.0):.1f}" for k in ks)
            mixed = "" if len(p.policy_versions) <= 1 else " (mixed)"
            lines.append(
                f"| {p.round} | {p.wall_s / 60:.1f} | {p.learner_step} | {p.weight_version}{mixed} "
                f"| {cells} | "
                f"{100 * p.parse_failure_rate:.0f}% | {p.eval_wall_s:.0f} |"
            )
        lines += ["", "![learning curve](learning_curve.png)", ""]
    if r.policy_lag or r.stale_dropped:
        hist = ", ".join(f"{k}: {v}" for k, v in r.policy_lag.items() if v)
        lines += [
            "Policy lag of the trained samples (versions behind the learner's latest push): "
            f"{hist or 'none'}; "
            f"dropped as stale (past max_policy_lag): {r.stale_dropped}.",
            "",
        ]
    if r.step_counts:
        c = r.step_counts
        lines += [
            f"Learner steps (its last process): {c.get('taken', 0)} taken, of them "
            f"{c.get('partial', 0)} on a partial batch, {c.get('grad_clipped', 0)} with the "
            f"gradient norm clipped, {c.get('dual_clipped', 0)} with a GRPO token dual-clipped; "
            f"{c.get('skipped', 0)} batches skipped (nothing left to train).",
            "",
        ]
    return lines


def render_report(r: RunReport, cfg_eval: Any) -> str:
    """``report.md`` from the report's data."""
    lines = [f"# leafe run `{r.run_id}`", ""]
    lines += [
        f"Model `{r.model}`, environment `{r.env}` {r.env_options}, materializer "
        f"`{r.materializer}`.",
        "",
    ]
    if r.evals:
        lines += _eval_lines(r, cfg_eval)
    lines += _parts_lines(r.parts)
    u = r.run
    samples = ", ".join(f"{k} {v}" for k, v in u.samples.items()) or "0"
    lines += [
        "## Run",
        "",
        "| what | value |",
        "|---|---|",
        f"| wall time | {r.timings.get('total', 0) / 60:.1f} min |",
        f"| schedule | {r.schedule} |",
        f"| wall-clock budget | {_budget(r)} |",
        f"| threads | {r.threads or 'not recorded'} |",
        f"| training episodes (success) | {u.episodes} ({u.successes}) |",
        f"| policy steps (unparseable) | {u.steps} ({u.unparseable}) |",
        f"| reflections / rollbacks / branches | {u.reflections} / {u.rollbacks} / {u.branches} |",
        f"| env steps spent replaying | {u.replay_steps} |",
        f"| events in the log | {u.events} |",
        f"| samples | {samples} |",
        f"| learner steps, last loss | {u.learner_step}, {u.learner_loss} |",
        f"| weight versions pushed | {u.weights_version} |",
        "",
        "Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.timings.items()),
        "",
    ]
    lines += _continual_lines(r)
    d = r.dataset
    verdict = "identical to" if d.identical else "DIFFERENT from"
    lines += [
        f"The dataset rebuilt offline from `events.leafelog` (`dataset/`, {d.samples} samples, "
        "sha256 "
        f"{d.content_sha256[:16]}...) is {verdict} the {d.stream_samples} samples the replayer "
        "published to "
        "the learner.",
        "",
        "![exploration tree](tree.png)",
        "",
    ]
    return "\n".join(lines)
