"""The paper table's runner and report with fake phase results: the protocol and the skeleton are
written before any phase runs, finished phases are skipped on a rerun, the time box and failures
leave honest reports, and every comparison carries a verdict from its paired interval."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from experiments.paper.config import PaperConfig
from experiments.paper.estimate import estimate_plan, unit_costs
from experiments.paper.runner import Runner


def _few_rows(cfg: PaperConfig) -> PaperConfig:
    """The same protocol with three rows (a quicker plan for tests that do not look at every
    row)."""
    return msgspec.structs.replace(cfg, rows=["base", "sft", "iwm"], table3=False)


def _run(cfg: PaperConfig, tmp_path: Path, steps: Any, deadline: float = 1e18) -> Runner:
    runner = Runner(cfg, tmp_path / "work", tmp_path / "results", deadline)
    asyncio.run(runner.run(steps))
    return runner


def test_protocol_and_skeleton_are_written_before_any_phase(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """When the first phase starts, the report already names the test tasks and seeds, and lists
    every row as pending; the protocol is registered in the work dir."""
    seen: dict[str, str] = {}

    def look() -> None:
        seen["md"] = (tmp_path / "results" / "t_report.md").read_text()
        seen["protocol"] = (tmp_path / "work" / "protocol.json").read_text()

    _run(small_cfg, tmp_path, fake_steps(on_first=look))
    md = seen["md"]
    assert "tasks 0..7 (8 tasks) x 4 samples" in md and "sampling seed 12345" in md
    assert "Base + SFT, other sampling seeds (noise check)" in md and md.count("| pending |") >= 10
    assert "Phases finished: 0 of" in md
    protocol = json.loads(seen["protocol"])["protocol"]
    assert protocol["test"] == {"split": "test", "first": 0, "tasks": 8, "samples": 4}
    assert protocol["seeds"]["noise_check"] == 12345 + small_cfg.reseed_offset


def test_verdicts_follow_the_paired_intervals(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """A row that solves every sample beats one that solves none ("better"); same results are
    "within noise"; the report, json and png are written."""
    wins = {"sft": 1.0, "base": 0.0, "sft-reseed": 1.0, "grpo": 1.0, "iwm": 0.0}
    _run(small_cfg, tmp_path, fake_steps(wins=wins))
    blob = json.loads((tmp_path / "results" / "t_report.json").read_text())
    verdicts = {(c["a"], c["b"], c["k"]): c["verdict"] for c in blob["comparisons"]}
    assert verdicts["sft", "base", 1] == "sft better"
    assert verdicts["sft-reseed", "sft", 1] == "within noise"
    assert verdicts["leafe", "grpo", 1] == "leafe worse"  # 25% vs 100% on every task
    md = (tmp_path / "results" / "t_report.md").read_text()
    assert "| Base + SFT - Base | 1 | +100.0 |" in md and "within noise" in md
    assert (tmp_path / "results" / "t_report.png").is_file()
    assert f"Phases finished: {len(blob['plan'])} of {len(blob['plan'])}" in md


def test_reproduction_script_replays_every_training_and_evaluation(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """The script rebuilds each dataset from its exported log, filters where the phase filtered,
    trains from the weights the run used, and evaluates with the protocol's seeds."""
    runner = _run(_few_rows(small_cfg), tmp_path, fake_steps())
    script = (tmp_path / "results" / "t_report_repro.sh").read_text()
    trains = [p.name for p in runner.state.plan if p.name.startswith(("sft-", "train-"))]
    assert script.count("leafe replay --from $LOGS/") == len(trains) == script.count("leafe train ")
    assert (
        "--from $LOGS/logs/demos-a.leafelog.gz --materializer sft" in script
    )  # <experiment>/<log>
    assert "leafe eval --model" in script and "--seed 12345 " in script and "--seed 777 " in script
    assert "--rollout-option horizon=8" in script
    # Nothing of this machine's paths: weights the run made are under $OUT, the base model is
    # $MODEL.
    assert str(tmp_path) not in script and str(tmp_path.resolve()) not in script, script
    # The learner's arithmetic depends on its thread count: each training runs with the run's.
    trained = [line for line in script.splitlines() if line.startswith("leafe train ")]
    assert trained and all(
        line.endswith(f"--threads {runner.cfg.training.threads}") for line in trained
    )


def test_rerun_skips_finished_phases(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """Each finished phase left done.json; a second invocation runs none of them again."""
    cfg = _few_rows(small_cfg)
    first = fake_steps()
    runner = _run(cfg, tmp_path, first)
    assert first.calls == [p.name for p in runner.state.plan]
    assert all((tmp_path / "work" / n / "done.json").is_file() for n in first.calls)
    second = fake_steps()
    again = _run(cfg, tmp_path, second)
    assert second.calls == [] and set(again.state.phases) == set(first.calls)


def test_time_box_skips_and_a_failure_blocks_only_what_needs_it(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """Past the deadline nothing starts (and the report says so); a failed training blocks its
    evaluation while later phases that do not need it still run."""
    cfg = _few_rows(small_cfg)
    boxed = _run(cfg, tmp_path / "a", fake_steps(), deadline=0.0)
    assert boxed.state.skipped == [p.name for p in boxed.state.plan] and not boxed.state.phases
    assert "Not started (time box" in (tmp_path / "a" / "results" / "t_report.md").read_text()
    steps = fake_steps(fail=("train-iwm",))
    runner = _run(cfg, tmp_path / "b", steps)
    assert "train-iwm" in runner.state.failed and "eval-iwm" in runner.state.blocked
    assert (
        "eval-iwm" not in steps.calls
        and "val-base-b" in steps.calls
        and "probe-humaneval" in steps.calls
    )
    md = (tmp_path / "b" / "results" / "t_report.md").read_text()
    assert "train-iwm FAILED" in md and "blocked: needs train-iwm (failed)" in md


def test_a_failure_report_starts_with_its_cause(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """A child's error is its cause, then the tail of its log; the report cuts what it shows, so it
    must keep the cause (it showed the middle of a log line when the runner kept only the message's
    end)."""
    steps = fake_steps()
    run = steps.run

    async def broken(phase: Any) -> dict[str, Any]:
        if phase.name == "train-iwm":
            raise RuntimeError("leafe train was killed by SIGKILL; log x\n" + "a log line\n" * 500)
        return await run(phase)

    steps.run = broken
    runner = _run(_few_rows(small_cfg), tmp_path, steps)
    assert runner.state.failed["train-iwm"].startswith(
        "RuntimeError: leafe train was killed by SIGKILL; log x\n"
    )
    md = (tmp_path / "results" / "t_report.md").read_text()
    assert "train-iwm FAILED**: `RuntimeError: leafe train was killed by SIGKILL" in md


def test_a_changed_protocol_is_refused(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """Once registered, the test range and seeds cannot move under the same work dir."""
    _run(small_cfg, tmp_path, fake_steps(), deadline=0.0)
    moved = msgspec.structs.replace(small_cfg, test_tasks=16, eval_seed=1)
    with pytest.raises(ValueError, match=r"differs in .*seeds.*test"):
        Runner(moved, tmp_path / "work", tmp_path / "results", 1e18)


def test_estimate_scales_the_measured_unit_costs(
    small_cfg: PaperConfig, tmp_path: Path, fake_steps: Any
) -> None:
    """From a finished run, every phase of a bigger plan gets an estimate; evaluations scale with
    episodes."""
    runner = _run(_few_rows(small_cfg), tmp_path, fake_steps())
    for (
        name,
        r,
    ) in runner.state.phases.items():  # the runner records the measured (here ~0 s) phase wall
        r["wall_s"] = 60.0 if name.startswith(("eval-", "val-")) else 30.0
    units = unit_costs(runner.state)
    assert units["eval_s_per_episode"]["eval"] == pytest.approx(60.0 / 32)
    bigger = msgspec.structs.replace(
        _few_rows(small_cfg), test_tasks=64, eval_samples=16, ks=[1, 16]
    )
    est = {p.name: s for p, s in estimate_plan(bigger, units)}
    assert est["eval-base"] == pytest.approx(64 * 16 * 60.0 / 32)
    assert all(s is not None for s in est.values())


def test_an_sr_evaluation_that_would_cut_off_the_trained_answers_is_refused(
    small_cfg: PaperConfig, tmp_path: Path
) -> None:
    """The cap on generated tokens must cover the longest trained completion (reflection +
    action)."""
    from types import SimpleNamespace

    from experiments.paper.phases import EvalSpec
    from experiments.paper.steps import Steps

    data = tmp_path / "train-sr" / "dataset"
    data.mkdir(parents=True)
    rows = [{"completion_ids": list(range(n))} for n in (4, 104, 30)]
    (data / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = Steps(small_cfg, SimpleNamespace(work=tmp_path), [], lambda name: None)  # type: ignore[arg-type]
    cut = EvalSpec(model="train:train-sr", split="test", rollout={"max_new_tokens": 64})
    with pytest.raises(RuntimeError, match=r"up to 104 tokens.*max_new_tokens=64"):
        steps.check_token_budget(cut)
    steps.check_token_budget(
        EvalSpec(model="train:train-sr", split="test", rollout={"max_new_tokens": 128})
    )
    steps.check_token_budget(EvalSpec(model="sft", split="test", rollout={"max_new_tokens": 8}))


def test_reproduction_paths_name_no_directory_of_the_machine_that_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record holds absolute paths under the work dir (given relative to the runner): the script
    names them under ``$OUT``, and the base model's export under the work dir as ``$MODEL`` (its
    script named /work/effect/... for every training started from Base or W)."""
    from experiments.paper.repro import _path

    monkeypatch.chdir(tmp_path)
    work, base = "runs/paper/x", str(tmp_path / "cache" / "models" / "m")
    assert (
        _path(str(tmp_path / work / "warm-train" / "train" / "final"), work, base)
        == "$OUT/warm-train/train/final"
    )
    assert _path(str(tmp_path / work / "base-weights"), work, base) == "$MODEL"
    assert _path(base, work, base) == "$MODEL"
    assert _path("runs/paper/x/train-a/train/final", work, base) == "$OUT/train-a/train/final"


def test_the_committed_effect_hard_script_names_logs_that_exist_and_mixes_as_the_run_did(
    tmp_path: Path,
) -> None:
    """The reproduction script written from effect-hard's committed records: every ``--from`` names
    a log the repository holds (W's logs are the inherited experiment's, under
    ``paper_logs/effect/``; the script named them under ``effect-hard/``), and W's training set is
    the run's: the demonstrations together with the reflect and follow samples of the label trees,
    combined in the run's order (the script trained W on the demonstrations alone)."""
    import re
    import shutil

    from experiments.paper.config import load_paper_config, scale_path
    from experiments.paper.repro import repro_script

    repo = Path(__file__).resolve().parents[2]
    logs = repo / "experiments" / "results" / "paper_logs"
    for name in ("effect", "effect-hard"):
        shutil.copytree(logs / name / "state", tmp_path / "results" / "paper_logs" / name / "state")
    cfg = load_paper_config(scale_path("effect-hard"), {"training.threads": 2})
    runner = Runner(cfg, tmp_path / "work", tmp_path / "results", deadline=0.0, carried=True)
    script = repro_script(cfg, runner.state, runner.work, "base")
    sources = re.findall(r"--from (\S+)", script)
    assert sources and all(s.startswith("$LOGS/") for s in sources), sources
    missing = [s for s in sources if not (logs / s.removeprefix("$LOGS/")).is_file()]
    assert not missing, missing
    warm = script.split("# warm-train:")[1].split("\n# ")[0]
    replays = re.findall(r"--from \$LOGS/(\S+) --materializer (\w+)", warm)
    assert replays == [
        ("effect/demos-6x6-l8-w2.leafelog.gz", "sft"),
        ("effect/labels.leafelog.gz", "reflect"),
        ("effect/labels.leafelog.gz", "follow"),
    ]
    combined = (
        "$OUT/warm-train/dataset-filtered', '$OUT/warm-train/dataset-mix0', "
        "'$OUT/warm-train/dataset-mix1'"
    )
    assert combined in warm and "--data $OUT/warm-train/dataset-mixed " in warm, warm
