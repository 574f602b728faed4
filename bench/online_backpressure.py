"""The staleness gate (issue 62's backpressure, ``actors/staleness.py``) against actors that run
ahead: the same continuous ``leafe run`` twice, ``explore.backpressure`` off (before) and on
(after), reading each report's samples dropped as stale, samples trained, and trained samples per
minute of the explore stage.

    python -m bench.online_backpressure            # the grpo preset, SmolLM2, 2 x --minutes
    python -m bench.online_backpressure --quick    # the tiny random model, about a minute a run

Full mode is the ``grpo`` preset at its concurrency (1 actor x 8 episodes, groups of 4 rollouts)
without its warm start and evaluations, for ``--minutes`` of exploring each; the learner's staleness
bound is scaled down (``--push-every``, ``--max-policy-lag``) so a short run reaches the steady
state a 35-minute run reaches after its first versions: the share dropped depends on how much faster
the actors make samples than the learner trains them, not on the bound, which only delays when
dropping starts. The learner is run ``--slow`` (5) times slower by stopping it (SIGSTOP) 4 s of
every 5: the shipped GRPO run's learner on one core trained 41% of what its actors made, and on this
shared machine the actors alone are slower than they were there. ``--quick`` (the test) runs the
tiny model on the same pool; its figures are not SmolLM2 measurements. Saves
``bench/results/online_backpressure.json`` (``--out``) with the host's CPU; timings on a shared
machine are noisy, so both arms run in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import tomli_w

from bench.host import host_record

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "online_backpressure.json"


def _config(args: argparse.Namespace, backpressure: bool) -> dict[str, Any]:
    """The run's TOML overrides for one arm."""
    explore: dict[str, Any] = {"demos": 0, "rounds": 0, "backpressure": backpressure}
    cfg: dict[str, Any] = {
        "budget_minutes": args.minutes,
        "explore": explore,
        "online_eval": {"every_rounds": 0},
        "eval": {"before": False, "after": False, "after_warm_start": False},
        "learner": {
            "max_policy_lag": args.max_policy_lag,
            "trainer": {"push_every": args.push_every, "checkpoint_every": args.push_every},
        },
    }
    if args.quick:
        cfg["model"] = "tiny"
        explore.update(samples=4, rounds=0)  # the preset's pool: 16 tasks x 4 a round
        cfg["services"] = {"actor_concurrency": 4, "inference_max_batch": 4, "inference_servers": 1}
        cfg["learner"]["trainer"]["batch"] = {"global_batch": 16}  # a version >= one group
        # the random model never solves a room: keep zero-variance groups (advantage 0) as samples
        cfg["replayer"] = {"options": {"min_std": 0.0}}
    return cfg


class LearnerThrottle:
    """Stop the run's learner (``<run dir>/pids/learner.pid``) for ``stop_s`` of every ``stop_s +
    run_s`` seconds: a learner that many times slower than the actors, as the shipped online GRPO
    run's learner on one core was (it trained 41% of what the actors made)."""

    def __init__(self, pid_file: Path, stop_s: float, run_s: float) -> None:
        self.pid_file, self.stop_s, self.run_s = pid_file, stop_s, run_s
        self.stopped_s = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> LearnerThrottle:
        if self.stop_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self.stop_s > 0:
            self._thread.join()

    def _pid(self) -> int | None:
        try:
            pid, start = self.pid_file.read_text().split()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            return None
        return int(pid) if fields[0] not in "ZX" and fields[19] == start else None

    def _loop(self) -> None:
        while not self._done.is_set():
            pid = self._pid()
            if pid is None:
                self._done.wait(0.2)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            t0 = time.monotonic()
            self._done.wait(self.stop_s)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stopped_s += time.monotonic() - t0
            self._done.wait(self.run_s)


def _run_arm(args: argparse.Namespace, runs: Path, backpressure: bool) -> dict[str, Any]:
    name = "bp-on" if backpressure else "bp-off"
    conf = runs / f"{name}.toml"
    conf.write_text(tomli_w.dumps(_config(args, backpressure)), encoding="utf-8")
    argv = [
        sys.executable,
        "-m",
        "leafe.services.cli",
        "run",
        "--preset",
        "grpo",
        "--config",
        str(conf),
        "--run-id",
        name,
        "--runs-dir",
        str(runs),
        "--fresh",
        "--no-live",
    ]
    t0 = time.monotonic()
    throttle = LearnerThrottle(runs / name / "pids" / "learner.pid", args.slow - 1.0, 1.0)
    with (runs / f"{name}.console.log").open("w") as console, throttle:
        subprocess.run(argv, check=True, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    report = json.loads((runs / name / "report.json").read_text())
    return {
        **_figures(report, runs / name, backpressure, wall),
        "learner_stopped_s": throttle.stopped_s,
    }


def _prom(path: Path, name: str) -> float:
    """The value of metric ``name`` in a saved Prometheus scrape (0 when absent)."""
    if not path.is_file():
        return 0.0
    for line in path.read_text().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _figures(
    report: dict[str, Any], run_dir: Path, backpressure: bool, wall: float
) -> dict[str, Any]:
    trained = sum(report.get("policy_lag", {}).values())
    stale = int(report.get("stale_dropped", 0))
    explore_s = float(report["timings"].get("explore", 0.0)) + float(
        report["timings"].get("drain", 0.0)
    )
    made = sum(report["run"]["samples"].values())
    return {
        "backpressure": backpressure,
        "episodes": report["run"]["episodes"],
        "samples_made": made,
        "samples_trained": trained,
        "stale_dropped": stale,
        "stale_share": stale / (stale + trained) if stale + trained else 0.0,
        "learner_steps": report["run"]["learner_step"],
        "step_counts": report.get("step_counts", {}),
        "explore_and_drain_s": round(explore_s, 1),
        "trained_per_minute": 60.0 * trained / explore_s if explore_s else 0.0,
        "made_per_minute": 60.0 * made / explore_s if explore_s else 0.0,
        "gate_wait_s": _prom(
            run_dir / "metrics" / "actor-0.prom", "leafe_actor_gate_wait_seconds_total"
        ),
        "gate_lent": _prom(run_dir / "metrics" / "actor-0.prom", "leafe_actor_gate_lent_total"),
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", "--smoke", action="store_true", help="tiny model, about a minute")
    p.add_argument("--minutes", type=float, default=None, help="explore budget per arm")
    p.add_argument("--push-every", type=int, default=2, help="learner steps per push")
    p.add_argument("--max-policy-lag", type=int, default=None, help="staleness bound (2; quick 1)")
    p.add_argument(
        "--slow",
        type=float,
        default=None,
        help="run the learner this many times slower (SIGSTOP 1 - 1/slow of the time; 5; quick 1)",
    )
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {OUT})")
    p.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = p.parse_args(argv)
    if args.minutes is None:
        args.minutes = 1.5 if args.quick else 8.0
    if args.slow is None:
        args.slow = 1.0 if args.quick else 5.0
    if args.max_policy_lag is None:
        args.max_policy_lag = 1 if args.quick else 2
    out = args.out or OUT
    with tempfile.TemporaryDirectory(prefix="leafe-bp-") as tmp:
        runs = args.keep or Path(tmp)
        runs.mkdir(parents=True, exist_ok=True)
        arms = [_run_arm(args, runs, bp) for bp in (False, True)]
    before, after = arms
    result = {
        "host": host_record(),
        "shared_machine": True,
        "quick": args.quick,
        "preset": "grpo",
        "minutes": args.minutes,
        "push_every": args.push_every,
        "max_policy_lag": args.max_policy_lag,
        "learner_slowed": args.slow,
        "before": before,
        "after": after,
        "trained_per_minute_ratio": (
            after["trained_per_minute"] / before["trained_per_minute"]
            if before["trained_per_minute"]
            else None
        ),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for arm in arms:
        print(
            f"backpressure {'on ' if arm['backpressure'] else 'off'}: stale share "
            f"{arm['stale_share']:.0%} ({arm['stale_dropped']} of "
            f"{arm['stale_dropped'] + arm['samples_trained']}), "
            f"{arm['trained_per_minute']:.1f} samples trained a minute, "
            f"gate wait {arm['gate_wait_s']:.0f} s"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
