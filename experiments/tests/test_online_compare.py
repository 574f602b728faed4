"""experiments/paper/online.py: run reports side by side with paired intervals and throughput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments.paper.online import compare_runs, main


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
    """All-or-nothing tasks 80% vs 20% solved: a decided difference of +60 points; equal runs
    tie."""
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
    assert (
        t["episodes_per_min"],
        t["samples_per_min"],
        t["learner_steps_per_min"],
        t["pushes"],
    ) == (
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
    assert (
        main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out" / "t")]) == 0
    )
    assert all((tmp_path / "out" / f"t.{ext}").is_file() for ext in ("md", "json", "png"))


def test_offline_paper_rows_pair_with_the_runs_and_carry_their_weights_cost(tmp_path: Path) -> None:
    """--paper: a row of paper_table.json joins as ``offline-<row>``, paired task by task with each
    run (never with another offline row), its wall time the sum of the phases its weights needed."""
    ev = _report("x", 0.2)["evals"]["after-v000004"]
    table = {
        "plan": [
            {"name": "sft", "deps": []},
            {"name": "grpo", "deps": ["sft"]},
            {"name": "eval-grpo", "deps": ["grpo"]},
            {"name": "eval-sft", "deps": ["sft"]},
        ],
        "phases": {
            "sft": {"wall_s": 600.0},
            "grpo": {"wall_s": 1200.0},
            "eval-grpo": {**ev, "label": "eval-grpo", "wall_s": 300.0},
            "eval-sft": {**ev, "label": "eval-sft", "wall_s": 300.0},
        },
    }
    paper = tmp_path / "paper_table.json"
    paper.write_text(json.dumps(table))
    from experiments.paper.online import offline_rows

    rows = offline_rows(paper, ["grpo", "sft"])
    assert rows["offline-grpo"]["cost_min"] == 30.0 and rows["offline-sft"]["cost_min"] == 10.0
    r = compare_runs({"leafe": _report("leafe", 0.8)}, rows)
    assert {(p["a"], p["b"]) for p in r["pairs"]} == {
        ("leafe", "offline-grpo"),
        ("leafe", "offline-sft"),
    }
    assert next(p for p in r["pairs"] if p["b"] == "offline-grpo")["verdict"] == "leafe better"
    assert r["rows"]["offline-grpo"]["wall_min"] == 30.0
    timed = _report("leafe", 0.8) | {
        "timings": {"total": 900.0, "eval_before": 120.0, "eval_after": 180.0}
    }
    assert (
        compare_runs({"leafe": timed})["rows"]["leafe"]["wall_min"] == 10.0
    )  # evaluations left out
    with pytest.raises(ValueError, match="no finished 'eval-rft'"):
        offline_rows(paper, ["rft"])
    (tmp_path / "leafe").mkdir()
    (tmp_path / "leafe" / "report.json").write_text(json.dumps(_report("leafe", 0.8)))
    out = tmp_path / "out" / "t"
    assert (
        main([str(tmp_path / "leafe"), "--paper", str(paper), "--rows", "grpo", "--out", str(out)])
        == 0
    )
    assert (
        "offline-grpo" in out.with_suffix(".md").read_text() and out.with_suffix(".png").is_file()
    )


def _chunk(tmp_path: Path, offset: int, solved: int, **over: Any) -> Path:
    """A standalone ``leafe eval`` output on tasks offset..offset+3 (4 samples each; ``solved`` of
    them solve every sample)."""
    tasks = [f"sokoban/test/{offset + i}" for i in range(4)]
    ev = {
        "label": "after-v000004",
        "split": "test",
        "samples": 4,
        "successes": {t: [i < solved] * 4 for i, t in enumerate(tasks)},
        "passk": {"1": solved / 4},
        "wall_s": 10.0,
        "weight_version": "v000004",
        "episodes": 16,
        "reproducible": "yes",
    } | over
    doc = {"env": "sokoban", "env_options": {"height": 7}, "ks": [1, 4], "results": [ev]}
    path = tmp_path / f"tasks-{offset}.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_final_eval_in_standalone_chunks_is_merged_and_paired_like_an_in_run_one(
    tmp_path: Path,
) -> None:
    """--final-eval: chunks of one standalone evaluation of the run's last weights become its final
    evaluation, Pass@k scored over all tasks; chunks that disagree, overlap, or evaluated other
    weights or another environment are refused."""
    from experiments.paper.online import chunked_final_eval

    run = _report("grpo", 0.0, tasks=8) | {
        "evals": {},
        "env": "sokoban",
        "env_options": {"height": 7},
    }
    a, b = _chunk(tmp_path, 0, 4), _chunk(tmp_path, 4, 0)
    ev = chunked_final_eval(run, [a, b])
    assert ev["passk"] == {"1": 0.5, "4": 0.5} and ev["episodes"] == 32 and ev["wall_s"] == 20.0
    assert (
        list(ev["successes"]) == [f"sokoban/test/{i}" for i in range(8)]
        and ev["reproducible"] == "yes"
    )
    leafe = _report("leafe", 1.0, tasks=8)
    r = compare_runs({"leafe": leafe, "grpo": run | {"evals": {ev["label"]: ev}}})
    one = next(p for p in r["pairs"] if p["k"] == 1)
    assert one["diff"] == pytest.approx(0.5) and r["rows"]["grpo"]["source"].startswith(
        "standalone"
    )
    with pytest.raises(ValueError, match="in another chunk"):
        chunked_final_eval(run, [a, a])
    with pytest.raises(ValueError, match="differ in 'samples'"):
        chunked_final_eval(run, [a, _chunk(tmp_path, 8, 0, samples=8)])
    with pytest.raises(ValueError, match="ended at v000004"):
        chunked_final_eval(run, [_chunk(tmp_path, 12, 0, weight_version="v000003")])
    with pytest.raises(ValueError, match="the run 'grpo' ran"):
        chunked_final_eval(run | {"env_options": {"height": 5}}, [a])
    for name, report in (("leafe", leafe), ("grpo", run)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(report))
    out = tmp_path / "out" / "t"
    argv = [str(tmp_path / "leafe"), str(tmp_path / "grpo"), "--out", str(out)]
    with pytest.raises(ValueError, match="no after-evaluation"):
        main(argv)
    assert main([*argv, "--final-eval", f"grpo={a},{b}"]) == 0
    assert (
        "grpo: final evaluation standalone leafe eval in 2 chunks"
        in out.with_suffix(".md").read_text()
    )
