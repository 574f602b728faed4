"""End to end: ``leafe run --preset tiny`` runs every service for real (nats-server, CPU inference
server with the tiny model, actor, replayer, learner, weight sync); the assertions read
``report.json``, the report's data, the learner's TensorBoard event files and each service's last
/metrics. The resume test is slow (a second full run) and runs with ``make test-slow``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from leafe.protocol.events import EpisodeStarted
from leafe.services.bus.auth import ROLES
from leafe.services.eventlog.fileformat import read_events
from leafe.services.run.metrics import parse_samples
from leafe.services.run.router import router_available
from tests.support.leafe_run import Throttle, leafe_run_argv, leafe_run_env
from tests.support.nats_auth import SEED_PATTERN

pytestmark = pytest.mark.integration


def _leafe_run(
    runs: Path, run_id: str, cache_dir: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        leafe_run_argv(runs, "--run-id", run_id, "--no-live", *args),
        env=leafe_run_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=900,
    )


def _report(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "report.json").read_text())  # type: ignore[no-any-return]


def _explore_episodes(run_dir: Path) -> int:
    events = read_events(run_dir / "events.leafelog")
    return sum(isinstance(e, EpisodeStarted) and e.mode == "explore" for e in events)


def _learner_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every ``loss/total`` scalar in the learner's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard" / "learner"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss/total")]


def _check_observability(run_dir: Path, stderr: str, learner_step: int) -> None:
    """The TensorBoard line is printed, the progress reads as log lines, the learner's loss of every
    step is in TensorBoard, and each service's last /metrics shows its work."""
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in stderr
    progress = [
        line for line in stderr.splitlines() if line.startswith("[") and " episodes " in line
    ]
    assert progress and not any(ch in stderr for ch in "┃━┏┗"), stderr[-2000:]
    losses = _learner_losses(run_dir)
    assert [step for step, _ in losses] == list(range(1, learner_step + 1)), losses
    assert all(loss > 0 for _, loss in losses)
    last = {p.stem: parse_samples(p.read_text()) for p in (run_dir / "metrics").glob("*.prom")}
    routed = {"router"} if router_available() else set()
    services = {"actor-0", "replayer", "learner", "weight-sync", "inference", "inference-1", "run"}
    assert set(last) == services | routed, set(last)
    if routed:  # every generation of the actors and evaluations went through the router
        generated = sum(
            v for k, v in last["router"].items() if k.startswith("smg_router_requests_total")
        )
        assert generated > 0, last["router"]
    assert (
        sum(v for k, v in last["actor-0"].items() if k.startswith("leafe_actor_episodes_total"))
        >= 2
    )
    assert last["replayer"]["leafe_replayer_events_total"] > 0
    assert last["learner"]["leafe_learner_step"] == learner_step
    assert (
        max(v for k, v in last["weight-sync"].items() if k.startswith("leafe_weight_sync_version"))
        >= 1
    )
    assert (
        sum(last[s]["leafe_inference_decode_tokens_total"] for s in ("inference", "inference-1"))
        > 0
    )


def _assert_no_credential_in_logs(run_dir: Path) -> None:
    """The run's NATS ran with one nkey user per role and one per actor, ``actor.<id>`` (seeds 0600
    in nats-keys/), and no log file holds a seed: neither a role's own nor anything shaped like one
    (``SU`` + 56 base32 characters); nor the engines' API or admin key, nor the router's control
    key (0600 in secrets/)."""
    seeds = {p.stem: p for p in (run_dir / "nats-keys").iterdir()}
    assert set(seeds) == set(ROLES) - {"actor"} | {f"actor.{run_dir.name}-actor-0"}
    assert all(p.stat().st_mode & 0o077 == 0 for p in seeds.values())
    secrets = [p.read_text(encoding="utf-8").strip() for p in seeds.values()]
    assert all(SEED_PATTERN.fullmatch(s) for s in secrets)
    assert (run_dir / "nats" / "nats-server.conf").read_text().count("nkey:") == len(seeds)
    logs = [p for p in (run_dir / "logs").rglob("*") if p.is_file()]
    assert {"run.jsonl", "nats.log", "actor-0.log", "replayer.log", "learner.log"} <= {
        p.name for p in logs
    }
    keys = {p.name: p for p in (run_dir / "secrets").iterdir()}
    expected = {"engine-api-key", "engine-admin-key"}
    assert set(keys) == expected | ({"router-control-key"} if router_available() else set())
    assert all(p.stat().st_mode & 0o077 == 0 for p in keys.values())
    engine_keys = [p.read_text(encoding="utf-8").strip() for p in keys.values()]
    for path in logs:
        text = path.read_text(encoding="utf-8", errors="replace")
        assert not any(s in text for s in secrets), f"a NATS seed is in {path}"
        assert not SEED_PATTERN.search(text), f"something shaped like an nkey seed is in {path}"
        assert not any(k in text for k in engine_keys), f"an engine or router key is in {path}"


def _tiny_run(runs: Path, cache_dir: Path, *, slow_learner: bool = False) -> tuple[Path, str]:
    """The tiny preset through sglang-router 0.3.2 (``services.router``, the gpu overlay's topology)
    when the dev extra installed it; ``slow_learner``: the learner process is stopped 3 s of every 4
    (a learner on a 4x slower machine). Returns the run directory and the run's stderr."""
    runs.mkdir(parents=True, exist_ok=True)
    routed = runs / "router.toml"
    # Both runs divide the same 2 cores, whatever else keeps them busy: the learner's arithmetic
    # depends on its thread count, so a free-core count that differed between the runs could change
    # the weights.
    routed.write_text(
        f"[services]\ncores = 2\nrouter = {'true' if router_available() else 'false'}\n"
    )
    with Throttle(runs / "e2e" / "pids" / "learner.pid", enabled=slow_learner) as throttle:
        done = _leafe_run(runs, "e2e", cache_dir, "--config", str(routed))
    assert done.returncode == 0, done.stderr[-4000:]
    assert throttle.stopped_s >= (20 if slow_learner else 0), throttle.stopped_s
    return runs / "e2e", done.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, str]:
    """One tiny run shared by the tests of this module (its run directory and stderr)."""
    return _tiny_run(tmp_path_factory.mktemp("tiny"), cache_dir)


def test_tiny_run_end_to_end(tiny_run: tuple[Path, str], tmp_path: Path) -> None:
    """The tiny run warms up on demonstrations, explores, materializes, trains, pushes and serves
    new weights, evaluates before, after the warm start and after the rounds (with a paired interval
    per k for each part), and its offline-rebuilt dataset equals what the learner consumed; every
    service ran as its own NATS role and no credential reached a log."""
    run_dir, stderr = tiny_run
    report = _report(run_dir)
    assert report["dataset"]["identical"] and report["dataset"]["samples"] > 0, report["dataset"]
    assert report["dataset"]["samples"] == report["dataset"]["stream_samples"]
    assert report["run"]["weights_version"] != "default" and report["run"]["learner_step"] > 0
    labels = list(report["evals"])
    assert labels[0] == "before" and labels[-1] == f"after-{report['run']['weights_version']}", (
        labels
    )
    assert labels[1].startswith("warm-v") and len(labels) == 3, labels
    assert [(p["part"], p["baseline"], p["label"]) for p in report["parts"]] == [
        ("warm start", "before", labels[1]),
        ("LEAFE rounds", labels[1], labels[2]),
    ]
    assert all([d["k"] for d in p["diffs"]] == [1, 2] for p in report["parts"])
    assert report["schedule"] == "phased" and report["budget_minutes"] == 0 and report["cuts"] == []
    assert [c["k"] for c in report["comparisons"]] == [1, 2]
    assert all(c["lo"] <= c["diff"] <= c["hi"] for c in report["comparisons"])
    assert (run_dir / "passk.png").is_file() and (run_dir / "tree.png").is_file()
    assert _explore_episodes(run_dir) >= 2
    assert report["run"]["learner_loss"] is not None  # read from the learner's /metrics
    _check_observability(run_dir, stderr, report["run"]["learner_step"])
    _assert_no_credential_in_logs(run_dir)
    _check_continual(run_dir, report)
    _check_offline_eval_equals_the_runs(run_dir, report, tmp_path / "offline-eval")


def _check_continual(run_dir: Path, report: dict[str, Any]) -> None:
    """Two rounds of the pool with fresh seeds, a validation point after each (steps never go back),
    and a lag histogram that counts exactly the samples the learner trained."""
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == [0, 1] and all(r["finished"] for r in rounds), rounds
    seeds = [
        e.seed
        for e in read_events(run_dir / "events.leafelog")
        if isinstance(e, EpisodeStarted) and e.mode == "explore"
    ]
    assert len(seeds) == len(set(seeds)) == 4, seeds
    curve = report["curve"]
    assert [p["round"] for p in curve] == [-1, 0, 1], curve
    assert curve[0]["learner_step"] <= curve[1]["learner_step"] <= curve[2]["learner_step"]
    assert all(set(p["passk"]) == {"1", "2"} for p in curve)
    assert (run_dir / "learning_curve.png").is_file() and (
        run_dir / "eval" / "val-r1.json"
    ).is_file()
    run_metrics = parse_samples(
        (run_dir / "metrics" / "run.prom").read_text()
    )  # the supervisor's /metrics
    assert run_metrics["leafe_run_validation_points_total"] == len(curve)
    assert run_metrics['leafe_run_validation_passk{k="1"}'] == curve[-1]["passk"]["1"]
    assert run_metrics["leafe_run_validation_learner_step"] == curve[-1]["learner_step"]
    lines = (run_dir / "logs" / "learner.log").read_text().splitlines()
    steps = [json.loads(line) for line in lines if line.startswith("{")]
    trained = sum(e["samples"] for e in steps if e.get("event") == "learner.step")
    # The expert's demonstrations carry version "expert": trained, but no lag to histogram.
    expert = sum(
        e["unknown_version"] for e in steps if e.get("event") == "learner.samples.filtered"
    )
    lagged = sum(report["policy_lag"].values())
    assert lagged == trained - expert > 0 and expert > 0, (report["policy_lag"], trained, expert)


def _same_weights(a: Path, b: Path) -> bool:
    """The two exports hold equal tensors (not equal files: safetensors writes its metadata header
    in a hash map's order, so the same weights can hash differently)."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _without_clock(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.endswith("wall_s")} for row in rows]


def test_a_slow_learner_changes_the_time_never_the_result(
    tiny_run: tuple[Path, str], tmp_path: Path, cache_dir: Path
) -> None:
    """Work, not the wall clock, bounds the run: the tiny config again, its learner stopped 3 s of
    every 4 (start-up included), gives the same samples (the rebuilt dataset's digest), the same
    learner steps, pushes and final weights, the same rounds, and the same figures: every
    evaluation's successes sample for sample and the learning curve. Before, actors sampled from
    whatever version the learner had pushed by then, and a 4-minute budget cut the rounds."""
    fast_dir, _ = tiny_run
    slow_dir, _ = _tiny_run(tmp_path, cache_dir, slow_learner=True)
    fast, slow = _report(fast_dir), _report(slow_dir)
    assert slow["dataset"]["content_sha256"] == fast["dataset"]["content_sha256"], (slow, fast)
    assert slow["run"]["samples"] == fast["run"]["samples"]
    assert slow["threads"] == fast["threads"] and "2 cores as configured" in fast["threads"], fast[
        "threads"
    ]
    version = fast["run"]["weights_version"]
    assert (slow["run"]["learner_step"], slow["run"]["weights_version"]) == (
        fast["run"]["learner_step"],
        version,
    )
    assert _same_weights(slow_dir / "weights" / version, fast_dir / "weights" / version)
    assert list(slow["evals"]) == list(fast["evals"])
    for label, result in fast["evals"].items():
        for field in ("successes", "passk", "mean_steps", "parse_failure_rate", "policy_versions"):
            assert slow["evals"][label][field] == result[field], (label, field)
    assert _without_clock(slow["rounds"]) == _without_clock(fast["rounds"])
    assert _without_clock(slow["curve"]) == _without_clock(fast["curve"])
    assert slow["parts"] == fast["parts"]


@pytest.mark.slow
def test_tiny_run_resumes_without_redoing_finished_work(tmp_path: Path, cache_dir: Path) -> None:
    """Rerunning with the same id resumes: no finished explore task is explored again, and the
    evaluations that finished are not redone (their files are kept)."""
    run_dir = tmp_path / "e2e"
    assert _leafe_run(tmp_path, "e2e", cache_dir).returncode == 0
    n_explore, before = _explore_episodes(run_dir), (run_dir / "eval" / "before.json").read_bytes()
    second = _leafe_run(tmp_path, "e2e", cache_dir)
    assert second.returncode == 0, second.stderr[-4000:]
    assert _explore_episodes(run_dir) == n_explore, "a resumed run re-explored finished tasks"
    assert (run_dir / "eval" / "before.json").read_bytes() == before


def _offline_eval(model: Path, label: str, result: dict[str, Any], out: Path) -> dict[str, Any]:
    """``leafe eval`` (its own in-process server) of ``model`` on exactly the run's tasks, samples
    and seed."""
    from leafe.services.run.presets import resolve_run_config
    from leafe.services.run.stages import rollout_overrides

    cfg = resolve_run_config("tiny")
    split, ids = result["split"], result["task_ids"]
    first = int(ids[0].rsplit("/", 1)[1])
    assert ids == [f"sokoban/{split}/{first + i}" for i in range(len(ids))], ids
    argv = [
        sys.executable, "-m", "leafe.services.cli", "eval", "--model", str(model), "--label", label,
        "--split", split, "--task-offset", str(first), "--tasks", str(len(ids)),
        "--samples", str(result["samples"]), "--k", ",".join(str(k) for k in result["passk"]),
        "--seed", str(cfg.eval.seed if split == "test" else cfg.online_eval.seed),
        "--concurrency", str(cfg.eval.concurrency), "--out", str(out), "--no-progress",
        *(a for k, v in cfg.env.options.items() for a in ("--env-option", f"{k}={v}")),
        *(a for k, v in rollout_overrides(cfg).items() for a in ("--rollout-option", f"{k}={v}")),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (offline,) = json.loads((out / "eval.json").read_text())["results"]
    return offline  # type: ignore[no-any-return]


def _check_offline_eval_equals_the_runs(run_dir: Path, report: dict[str, Any], out: Path) -> None:
    """The run's own evaluations (the online evaluator's curve points and the after-evaluation share
    one code path) equal an offline ``leafe eval`` of the same weights on the same tasks and seeds:
    the same success of every sample, and the same steps, unparseable answers and prompt tokens
    (which follow every sampled token), so the curve can be read against any offline row. Checked
    for the final version, the warm start's, and every curve point served by one version whose
    weights are still in the store."""
    store = run_dir / "weights"
    final = f"after-{report['run']['weights_version']}"
    warm = [label for label in report["evals"] if label.startswith("warm-")]
    checked = [final, *(label for label in warm if (store / label.removeprefix("warm-")).is_dir())]
    for point in report["curve"]:
        version = point["weight_version"]
        if point["policy_versions"] == [version] and (store / version).is_dir():
            checked.append("val-warm" if point["round"] < 0 else f"val-r{point['round']}")
    for label in checked:
        run = json.loads((run_dir / "eval" / f"{label}.json").read_text())
        (version,) = run["policy_versions"]
        offline = _offline_eval(store / version, label, run, out / label)
        assert offline["policy_versions"] == [version]
        for field in ("task_ids", "successes", "passk", "mean_steps", "parse_failure_rate"):
            assert offline[field] == run[field], (label, field, offline[field], run[field])
        assert offline["mean_prompt_tokens"] == pytest.approx(run["mean_prompt_tokens"]), label


@pytest.mark.slow
def test_tiny_run_pushes_weights_over_the_wire(tmp_path: Path, cache_dir: Path) -> None:
    """``services.weight_transport = "distributed"``: the first version reaches the fresh servers
    from disk (the record), later ones over their gloo group with weight sync as rank 0, and the run
    ends with its final version served."""
    config = tmp_path / "wire.toml"
    config.write_text('[services]\ncores = 2\nweight_transport = "distributed"\n')
    done = _leafe_run(tmp_path / "runs", "wire", cache_dir, "--config", str(config))
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "runs" / "wire"
    report = _report(run_dir)
    assert report["run"]["weights_version"] != "default" and report["run"]["learner_step"] > 0
    lines = (run_dir / "logs" / "weight-sync.log").read_text().splitlines()
    updates = [
        e
        for e in (json.loads(line) for line in lines if line.startswith("{"))
        if e.get("event") == "weight_sync.server.updated"
    ]
    by = {e["transport"] for e in updates}
    assert by == {"disk", "distributed"}, updates
    assert updates[-1]["version"] == report["run"]["weights_version"], updates[-1]
