"""A real SIGTERM to ``leafe train`` mid-run (a preempted node, a scheduler's time limit): the run
ends after the step it is in with a checkpoint of it and exit code 75, and a rerun on the same
``--out`` loses no step: every later step has the loss an uninterrupted run has, and the exports are
the same."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from leafe.learner.checkpoint import latest_checkpoint
from leafe.learner.config import TrainConfig, train_preset
from leafe.learner.offline import train
from leafe.services.config import load_config
from leafe.services.learner.train import EXIT_STOPPED
from tests.support.learner import make_samples, write_shards

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

CONFIG = """
epochs = 2
[trainer]
checkpoint_every = 100
push_every = 0
[trainer.optim]
lr = 1e-3
[trainer.batch]
global_batch = 4
"""


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return (
        [json.loads(line)["step"] for line in path.read_text().splitlines()]
        if path.is_file()
        else []
    )


def _losses(out: Path) -> dict[int, float]:
    return {
        m["step"]: m["loss"]
        for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }


def _signal_after_two_steps(
    cmd: list[str], out: Path, target: Callable[[subprocess.Popen[str]], int], stderr: int | None
) -> tuple[subprocess.Popen[str], str]:
    """Start ``cmd`` (a training into ``out``), SIGTERM the pid ``target`` picks once two steps are
    logged, and return the process and its stdout once it has exited."""
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and len(_steps(out)) < 2:
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be stopped"
        os.kill(target(proc), signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, output


def test_sigterm_checkpoints_the_step_it_is_in_and_the_rerun_loses_nothing(
    dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    data = write_shards(tmp_path / "data", make_samples(24))
    cfg = load_config(TrainConfig, preset=train_preset("cpu"), overrides=tomllib.loads(CONFIG))
    whole = train(cfg, data, str(tiny_dir), tmp_path / "whole", dist_env)
    assert whole.steps == 12

    out = tmp_path / "stopped"
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(CONFIG)
    cmd = [
        sys.executable,
        "-m",
        "leafe.services.learner.train",
        "--data",
        str(data),
        "--model",
        str(tiny_dir),
    ]
    cmd += ["--out", str(out), "--preset", "cpu", "--config", str(cfg_path)]
    proc, stdout = _signal_after_two_steps(cmd, out, lambda p: p.pid, subprocess.DEVNULL)
    assert proc.returncode == EXIT_STOPPED
    result = json.loads(stdout.strip().splitlines()[-1])
    taken = _steps(out)
    assert result["stopped"] and result["steps"] == taken[-1] < 12 and result["final_dir"] == ""
    assert latest_checkpoint(out / "checkpoints").name == f"step_{taken[-1]:08d}"  # type: ignore[union-attr]
    assert not (out / "final").exists()

    resumed = train(cfg, data, str(tiny_dir), out, dist_env)
    assert resumed.steps == 12 and resumed.final_sha256 == whole.final_sha256
    assert _steps(out) == list(range(1, 13))  # no step trained twice: none was lost to the stop
    expected, got = _losses(tmp_path / "whole"), _losses(out)
    assert all(got[s] == pytest.approx(expected[s], abs=1e-6) for s in range(1, 13))


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.is_file() else []


def test_one_rank_signalled_stops_both_at_the_same_step(tiny_dir: Path, tmp_path: Path) -> None:
    """Under torchrun only rank 1 gets SIGTERM (a signal need not reach every rank at once): both
    ranks stop before the same step and save its checkpoint together (a rank that went on alone
    would hang in the next collective), with exit code 75."""
    from leafe.services.bus.nats_server import free_port

    data = write_shards(tmp_path / "data", make_samples(48))
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(CONFIG)
    out = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={free_port()}",
    ]
    cmd += [
        "-m",
        "leafe.services.learner.train",
        "--data",
        str(data),
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
    ]
    cmd += ["--preset", "cpu", "--config", str(cfg_path)]

    def rank_1(p: subprocess.Popen[str]) -> int:
        workers = sorted(_children(p.pid))
        assert len(workers) == 2, workers
        return workers[1]

    proc, output = _signal_after_two_steps(cmd, out, rank_1, subprocess.STDOUT)
    taken = _steps(out)
    assert taken and taken[-1] < 24, output[-3000:]
    assert latest_checkpoint(out / "checkpoints").name == f"step_{taken[-1]:08d}", output[-3000:]  # type: ignore[union-attr]
    assert not (out / "final").exists()
    assert output.count('"train.stopped"') == 2, output[-3000:]
    # torchrun reports the first rank to exit (75) and SIGTERMs the other, which may already be
    # leaving
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*75", output), output[-3000:]
