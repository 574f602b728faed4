"""bench/paper/online.py: run reports side by side with paired intervals and throughput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.paper.online import compare_runs, main


def _report(name: str, p: float, *, tasks: int = 20) -> dict[str, Any]:
    successes = {f"sokoban/test/{i}": [i < p * tasks] * 4 for i in range(tasks)}
    rate = sum(v[0] for v in successes.values()) / tasks
    ev = {"passk": {"1": rate}, "successes": successes}
    return {
        "run_id": name,
        "evals": {"before": {"passk": {"1": 0.1}, "successes": {}}, "after-v000004": ev},
        "timings": {"total": 600.0},
        "run": {
            "samples": {"sft": 100, "cf": 20},
            "learner_step": 10,
            "weights_version": "v000004",
            "episodes": 8,
        },
        "rounds": [{"episodes": 8}, {"episodes": 8}],
        "policy_lag": {"0": 30, "1": 10, "2-3": 0},
        "stale_dropped": 2,
        "curve": [{"wall_s": 60.0, "passk": {"1": 0.2}}],
    }


def test_a_clear_gap_is_decided_and_equal_runs_tie() -> None:
    """All-or-nothing tasks 80% vs 20% solved: a decided difference of +60 points; equal runs tie."""
    r = compare_runs(
        {"leafe": _report("leafe", 0.8), "grpo": _report("grpo", 0.2), "same": _report("s", 0.8)}
    )
    by = {(p["a"], p["b"]): p for p in r["pairs"]}
    assert (
        by[("leafe", "grpo")]["diff"] == pytest.approx(0.6)
        and by[("leafe", "grpo")]["verdict"] == "leafe better"
    )
    assert by[("leafe", "same")]["verdict"] == "tie (within noise)"
    t = r["throughput"]["leafe"]
    assert (t["episodes_per_min"], t["samples_per_min"], t["learner_steps_per_min"], t["pushes"]) == (
        1.6,
        12.0,
        1.0,
        4,
    )
    assert t["mean_policy_lag"] == 0.25


def test_runs_on_different_tasks_are_refused_and_the_cli_writes_three_files(tmp_path: Path) -> None:
    """No paired comparison across different task sets; the CLI writes md, json and png."""
    with pytest.raises(ValueError, match="different tasks"):
        compare_runs({"a": _report("a", 0.5), "b": _report("b", 0.5, tasks=10)})
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(_report(name, 0.5)))
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out" / "t")]) == 0
    assert all((tmp_path / "out" / f"t.{ext}").is_file() for ext in ("md", "json", "png"))
