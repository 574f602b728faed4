"""The online comparison: ``leafe run`` directories side by side (online LEAFE vs online GRPO, ...).

Each run directory holds ``report.json`` (``services/run/report.py``). This script puts their final
held-out evaluations side by side with paired bootstrap intervals (the runs must have evaluated the
same tasks with the same seeds: the presets do), their learning curves in one figure, and where each
run's time went: episodes, samples and learner steps per minute, pushes, the mean policy lag of
trained samples.

    .venv/bin/python -m experiments.paper.online runs/leafe runs/grpo \
        --out experiments/results/online_table
    # with rows of the offline paper table (the runs must have evaluated its test tasks and seeds):
    .venv/bin/python -m experiments.paper.online runs/online-paper-leafe runs/online-paper-grpo \
        --paper experiments/results/paper_table.json --rows leafe,grpo,sft \
        --out experiments/results/online_paper
    # a run whose final evaluation ran standalone (``leafe eval`` of its last weights, in task
    # chunks):
    .venv/bin/python -m experiments.paper.online runs/leafe runs/grpo \
        --final-eval grpo=chunks/tasks-0.json,chunks/tasks-16.json \
        --out experiments/results/online_table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from leafe.actors.passk import paired_difference, pass_at_k_table
from leafe.learner.weight_store import version_index

__all__ = ["chunked_final_eval", "compare_runs", "main", "offline_rows", "throughput"]


def _final_eval(report: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    after = [label for label in report["evals"] if label.startswith("after-")]
    if not after:
        raise ValueError(f"run {report['run_id']!r} has no after-evaluation")
    return after[-1], report["evals"][after[-1]]


_SAME = ("label", "env", "split", "samples", "ks", "rollout_overrides", "weight_version")


def chunked_final_eval(report: dict[str, Any], files: list[Path]) -> dict[str, Any]:
    """A run's final evaluation put together from standalone ``leafe eval`` outputs (``eval.json``,
    each on its own slice of the test tasks, e.g. ``--tasks 16 --task-offset 32``) of the run's last
    weights.

    For a run whose in-run evaluation did not finish. The chunks must agree on everything but their
    tasks, share no task, and have evaluated the weights the run ended with, in the run's
    environment; Pass@k is scored again over the union (the mean over tasks, not over chunks)."""
    chunks = []
    for f in files:
        doc = json.loads(f.read_text())
        evals = [r for r in doc["results"] if "successes" in r]
        if len(evals) != 1:
            raise ValueError(
                f"{f}: want one evaluation with per-task successes, found {len(evals)}"
            )
        chunks.append((f, doc, evals[0]))
    if not chunks:
        raise ValueError("no chunk files")
    f0, doc0, ev0 = chunks[0]
    want = {"env": report["env"], "env_options": report["env_options"]}
    for f, doc, ev in chunks:
        got = {"env": doc["env"], "env_options": doc["env_options"]}
        if got != want:
            raise ValueError(f"{f}: evaluated {got}, the run {report['run_id']!r} ran {want}")
        for key in _SAME:
            if (ev | doc).get(key) != (ev0 | doc0).get(key):
                raise ValueError(f"{f} and {f0} differ in {key!r}: not chunks of one evaluation")
    if ev0["weight_version"] != report["run"]["weights_version"]:
        raise ValueError(
            f"the chunks evaluated {ev0['weight_version']}, the run {report['run_id']!r} ended at "
            f"{report['run']['weights_version']}"
        )
    successes: dict[str, list[bool]] = {}
    for f, _, ev in chunks:
        if twice := sorted(set(ev["successes"]) & set(successes)):
            raise ValueError(f"{f}: tasks {twice[:3]} are in another chunk too")
        successes |= ev["successes"]
    passk = pass_at_k_table(successes, doc0["ks"])
    return {
        "label": ev0["label"],
        "run_id": report["run_id"],
        "env": doc0["env"],
        "split": ev0["split"],
        "samples": ev0["samples"],
        "task_ids": list(successes),
        "successes": successes,
        "passk": {str(k): v for k, v in passk.items()},
        "success_rate": passk.get(1),
        "wall_s": round(sum(float(ev["wall_s"]) for _, _, ev in chunks), 3),
        "weight_version": ev0["weight_version"],
        "episodes": sum(int(ev["episodes"]) for _, _, ev in chunks),
        "env_errors": sum(int(ev.get("env_errors", 0)) for _, _, ev in chunks),
        "reproducible": "yes"
        if all(ev.get("reproducible") == "yes" for _, _, ev in chunks)
        else "unknown",
        "source": f"standalone leafe eval in {len(chunks)} chunks: "
        + ", ".join(f.name for f in files),
    }


def _mean_lag(histogram: dict[str, int]) -> float | None:
    """Mean policy lag from the report's per-bucket counts (a bucket ``lo-hi`` counts as its
    middle)."""
    total = sum(histogram.values())
    if not total:
        return None
    acc = 0.0
    for name, n in histogram.items():
        if name.startswith(">"):
            mid = float(name[1:]) + 1
        elif "-" in name:
            lo, hi = name.split("-")
            mid = (float(lo) + float(hi)) / 2
        else:
            mid = float(name)
        acc += mid * n
    return round(acc / total, 2)


def throughput(report: dict[str, Any]) -> dict[str, Any]:
    """Where a run's time went."""
    minutes = max(1e-9, report["timings"].get("total", 0.0) / 60)
    run = report["run"]
    samples = sum(run["samples"].values())
    episodes = sum(r["episodes"] for r in report.get("rounds", [])) or run["episodes"]
    return {
        "wall_min": round(minutes, 1),
        "stage_s": report["timings"],
        "episodes_per_min": round(episodes / minutes, 2),
        "samples_per_min": round(samples / minutes, 2),
        "learner_steps_per_min": round(run["learner_step"] / minutes, 2),
        "pushes": version_index(run["weights_version"]) or 0,
        "mean_policy_lag": _mean_lag(report.get("policy_lag", {})),
        "stale_dropped": report.get("stale_dropped", 0),
        "samples": run["samples"],
    }


def offline_rows(paper_json: Path, rows: list[str]) -> dict[str, dict[str, Any]]:
    """Rows of the offline paper table (``experiments/results/paper_table.json``): each row's test
    evaluation (``eval-<row>``: per-task successes, so an online run evaluated on the same tasks and
    seeds pairs with it) and its weights cost in minutes (every phase its weights needed, as the
    table counts it)."""
    table = json.loads(paper_json.read_text())
    deps = {p["name"]: p["deps"] for p in table["plan"]}
    out = {}
    for row in rows:
        phase = f"eval-{row}"
        if phase not in table["phases"]:
            raise ValueError(f"{paper_json} has no finished {phase!r}: rows are {sorted(deps)}")
        need, todo = set(), list(deps[phase])
        while todo:
            name = todo.pop()
            if name not in need:
                need.add(name)
                todo += deps[name]
        cost_s = sum(
            float(table["phases"][n].get("wall_s", 0.0)) for n in need if n in table["phases"]
        )
        out[f"offline-{row}"] = {"eval": table["phases"][phase], "cost_min": round(cost_s / 60, 1)}
    return out


def _weights_minutes(report: dict[str, Any]) -> float:
    """Minutes the run took to make its final weights: its whole wall time less its held-out
    evaluations (the offline table's weights cost leaves a row's own test evaluation out too)."""
    t = report["timings"]
    return round(
        (t.get("total", 0.0) - t.get("eval_before", 0.0) - t.get("eval_after", 0.0)) / 60, 1
    )


def compare_runs(
    reports: dict[str, dict[str, Any]], offline: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Final Pass@k per run (and per offline row), each pair's paired difference per k, and each
    run's throughput."""
    finals = {name: _final_eval(r) for name, r in reports.items()}
    finals |= {name: (row["eval"]["label"], row["eval"]) for name, row in (offline or {}).items()}
    rows = {
        name: {
            "label": label,
            "passk": ev["passk"],
            "before": reports[name]["evals"].get("before", {}).get("passk")
            if name in reports
            else None,
            "wall_min": (
                _weights_minutes(reports[name])
                if name in reports
                else (offline or {})[name]["cost_min"]
            ),
            "seed": ev.get("seed"),
            "source": ev.get("source", "in-run" if name in reports else "offline table"),
        }
        for name, (label, ev) in finals.items()
    }
    names = list(finals)
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a not in reports and b not in reports:
                continue  # two offline rows: the paper table has their comparison
            ea, eb = finals[a][1], finals[b][1]
            if sorted(ea["successes"]) != sorted(eb["successes"]):
                raise ValueError(f"{a} and {b} evaluated different tasks: no paired comparison")
            ks = sorted({int(k) for k in ea["passk"]} & {int(k) for k in eb["passk"]})
            for k in ks:
                d = paired_difference(ea["successes"], eb["successes"], k)
                verdict = (
                    "tie (within noise)"
                    if d.within_noise
                    else (f"{a} better" if d.diff > 0 else f"{b} better")
                )
                pairs.append(
                    {
                        "a": a,
                        "b": b,
                        "k": k,
                        "diff": d.diff,
                        "lo": d.lo,
                        "hi": d.hi,
                        "verdict": verdict,
                    }
                )
    return {
        "rows": rows,
        "pairs": pairs,
        "throughput": {name: throughput(r) for name, r in reports.items()},
        "curves": {name: r.get("curve", []) for name, r in reports.items()},
    }


def _markdown(result: dict[str, Any]) -> str:
    ks = sorted({int(k) for row in result["rows"].values() for k in row["passk"]})
    lines = [
        "# Online runs side by side",
        "",
        "| run | min to the weights | " + " | ".join(f"Pass@{k}" for k in ks) + " |",
    ]
    lines.append("|---|---|" + "---|" * len(ks))
    for name, row in result["rows"].items():
        cells = [
            f"{100 * float(v):.1f}"
            if (v := row["passk"].get(str(k), row["passk"].get(k))) is not None
            else ""
            for k in ks
        ]
        lines.append(f"| {name} ({row['label']}) | {row['wall_min']} | " + " | ".join(cells) + " |")
    notes = [
        f"- {name}: final evaluation {row['source']}"
        for name, row in result["rows"].items()
        if row.get("source", "in-run") not in ("in-run", "offline table")
    ]
    lines += (["", *notes] if notes else []) + [
        "",
        "| comparison | k | difference (points) | 95% interval | verdict |",
        "|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        lines.append(
            f"| {p['a']} - {p['b']} | {p['k']} | {100 * p['diff']:+.1f} | [{100 * p['lo']:+.1f}, "
            f"{100 * p['hi']:+.1f}] | {p['verdict']} |"
        )
    lines += [
        "",
        "| run | min | episodes/min | samples/min | learner steps/min | pushes | mean lag "
        "| stale |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for name, t in result["throughput"].items():
        lines.append(
            f"| {name} | {t['wall_min']} | {t['episodes_per_min']} | {t['samples_per_min']} | "
            f"{t['learner_steps_per_min']} | {t['pushes']} | {t['mean_policy_lag']} | "
            f"{t['stale_dropped']} |"
        )
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, test) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in result["curves"].items():
        if points:
            ax.plot(
                [p["wall_s"] / 60 for p in points],
                [100 * p["passk"]["1"] for p in points],
                marker="o",
                label=name,
            )
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("validation Pass@1 (%)")
    ax.set_title("learning curves (validation slice)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for name, row in result["rows"].items():
        p1 = 100 * float(row["passk"].get("1", row["passk"].get(1, 0.0)))
        offline = name not in result["curves"]
        test.scatter([row["wall_min"]], [p1], marker="s" if offline else "o", label=name)
        if offline:
            test.axhline(
                p1, linestyle="--", linewidth=0.8, color=test.collections[-1].get_facecolor()[0]
            )
    test.set_xlabel("wall time to the weights (min; offline: the table's weights cost)")
    test.set_ylabel("test Pass@1 (%)")
    test.set_title("held-out test Pass@1 (same tasks and seeds)", fontsize=9)
    test.grid(alpha=0.3)
    test.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "runs", nargs="+", type=Path, help="leafe run directories (each with report.json)"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="output stem: writes .md, .json and .png"
    )
    p.add_argument(
        "--paper", type=Path, default=None, help="paper_table.json whose rows join the comparison"
    )
    p.add_argument(
        "--rows", default="leafe,grpo,sft", help="with --paper: its rows (comma-separated)"
    )
    p.add_argument(
        "--final-eval",
        action="append",
        default=[],
        metavar="RUN=FILE[,FILE...]",
        help="take RUN's final evaluation from standalone `leafe eval` chunk outputs (eval.json) "
        "of its last weights, for a run whose in-run evaluation did not finish (repeatable)",
    )
    args = p.parse_args(argv)
    reports = {d.name: json.loads((d / "report.json").read_text()) for d in args.runs}
    for spec in args.final_eval:
        name, _, files = spec.partition("=")
        if name not in reports or not files:
            p.error(
                f"--final-eval {spec!r}: want RUN=FILE[,FILE...] with RUN one of {sorted(reports)}"
            )
        ev = chunked_final_eval(reports[name], [Path(f) for f in files.split(",")])
        reports[name]["evals"][ev["label"]] = ev
    offline = offline_rows(args.paper, args.rows.split(",")) if args.paper else None
    result = compare_runs(reports, offline)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(result))
    _plot(result, args.out.with_suffix(".png"))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
