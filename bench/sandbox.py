"""Cost of judging a HumanEval submission: the judge outside the sandbox vs the old in-sandbox
harness.

The baseline is the tree as it was just before the judge was added (as ``envs/judge.py``; now
``envs/humaneval/judge.py``) (read from git, so both run in this process, interleaved): there the
submission and the tests ran in one sandboxed process (network and PID namespaces, a fresh uid,
rlimits) and printed nonce-tagged results. Now the tests run in this process and the submission
answers calls from a sandbox with a read-only root, a fresh /proc, an init and no capability. A
third column runs the new judge with ``isolation = "none"`` to split the cost of the judge's round
trips from that of the isolation layers.

Each problem's canonical solution (and a wrong ``add``) is stepped ``--reps`` times per variant; the
figure is the median seconds per submission, and ratios are new / baseline on the same problems.

Run: ``.venv/bin/python -m bench.sandbox [--problems 16] [--reps 3]``; writes
bench/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.host import host_record
from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.sandbox.launch import SandboxConfig

ROOT = Path(__file__).resolve().parents[1]
OLD_FILES = ("base.py", "sandbox.py", "humaneval.py", "humaneval_harness.py")


def baseline_ref() -> str:
    """The commit before the one that added the judge (then ``envs/judge.py``)."""
    out = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", "envs/judge.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    first = out.stdout.split()[-1]
    return f"{first}^"


def load_baseline(ref: str, into: Path) -> Any:
    """Import the baseline's ``envs/humaneval.py`` as ``envs_old.humaneval`` from ``git show``."""
    package = into / "envs_old"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in OLD_FILES:
        text = subprocess.run(
            ["git", "show", f"{ref}:envs/{name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (package / name).write_text(re.sub(r"\bfrom envs\.", "from envs_old.", text))
    spec = importlib.util.spec_from_file_location(
        "envs_old", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    sys.modules["envs_old"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["envs_old"])
    return importlib.import_module("envs_old.humaneval")


def submissions(env: HumanEvalEnv, count: int) -> list[tuple[str, str]]:
    """(task id, reply): canonical solutions of the first ``count`` test problems, and a wrong
    add."""
    out = []
    for task_id in env.tasks("test")[:count]:
        problem = env.problem(task_id)
        out.append((task_id, problem.prompt + problem.canonical_solution))
    out.append(("humaneval/test/53", "def add(x, y):\n    return x - y\n"))
    return out


def step_s(env: Any, task_id: str, reply: str) -> tuple[float, bool]:
    env.reset(task_id)
    start = time.perf_counter()
    t = env.step(reply)
    return time.perf_counter() - start, t.success


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=16, help="canonical solutions to judge")
    parser.add_argument("--reps", type=int, default=3, help="steps per submission and variant")
    args = parser.parse_args(argv)
    ref = baseline_ref()
    host = host_record()
    with tempfile.TemporaryDirectory() as tmp:
        old = load_baseline(ref, Path(tmp))
        variants: dict[str, Any] = {
            "baseline": old.HumanEvalEnv(old.HumanEvalConfig(num_test=164)),
            "judge+namespaces": HumanEvalEnv(HumanEvalConfig(num_test=164)),
            "judge+none": HumanEvalEnv(
                HumanEvalConfig(num_test=164, sandbox=SandboxConfig(isolation="none"))
            ),
        }
        work = submissions(variants["judge+namespaces"], args.problems)
        times: dict[str, list[float]] = {name: [] for name in variants}
        verdicts: dict[str, list[bool]] = {name: [] for name in variants}
        for task_id, reply in work:
            for _ in range(args.reps):
                for (
                    name,
                    env,
                ) in variants.items():  # interleaved: the machine's noise hits all alike
                    seconds, success = step_s(env, task_id, reply)
                    times[name].append(seconds)
                    verdicts[name].append(success)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["baseline"]
    print(f"baseline = {ref} ({len(work)} submissions x {args.reps} reps, median s per submission)")
    print(f"{'variant':<18} {'median s':>9} {'mean s':>8} {'x baseline':>11} {'same verdicts':>14}")
    for name, ts in times.items():
        same = verdicts[name] == verdicts["baseline"]
        ratio = medians[name] / base
        print(
            f"{name:<18} {medians[name]:>9.3f} {statistics.mean(ts):>8.3f} {ratio:>11.2f} "
            f"{same!s:>14}"
        )
    result = {
        "baseline_ref": ref,
        "submissions": len(work),
        "reps": args.reps,
        "median_s": medians,
        "mean_s": {name: statistics.mean(ts) for name, ts in times.items()},
        "ratio_to_baseline": {name: m / base for name, m in medians.items()},
        "load_average_1m": os.getloadavg()[
            0
        ],  # the machine is shared: read the figures against this
        "host": host,
    }
    out = Path(__file__).parent / "results" / "sandbox.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
