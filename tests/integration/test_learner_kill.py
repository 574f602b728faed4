"""A real SIGKILL of ``leafe train`` mid-run, then a rerun on the same ``--out``: it resumes from
the latest checkpoint and every later step has the loss an uninterrupted run has."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from leafe.learner.checkpoint import latest_checkpoint
from leafe.learner.config import TrainConfig, train_preset
from leafe.learner.offline import train
from leafe.services.config import load_config
from tests.support.learner import make_samples, write_shards

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CONFIG = """
epochs = 2
[trainer]
checkpoint_every = 1
push_every = 0
[trainer.optim]
lr = 1e-3
warmup_steps = 2
schedule = "cosine"
[trainer.batch]
global_batch = 4
"""


def _metrics(out: Path) -> dict[int, float]:
    """Loss per step; a step trained twice (after the kill, before its checkpoint) keeps its last
    loss."""
    return {
        m["step"]: m["loss"]
        for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }


def test_sigkill_then_resume_matches_an_uninterrupted_run(
    dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """Kill -9 after the second checkpoint; the rerun continues from the latest checkpoint (epoch
    and position inside the epoch included) and reproduces the uninterrupted run's losses step for
    step."""
    data = write_shards(tmp_path / "data", make_samples(24))
    cfg = load_config(TrainConfig, preset=train_preset("cpu"), overrides=tomllib.loads(CONFIG))
    straight = tmp_path / "straight"
    train(cfg, data, str(tiny_dir), straight, dist_env)
    expected = _metrics(straight)
    assert len(expected) == 12

    out = tmp_path / "killed"
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
        "--out",
        str(out),
        "--preset",
        "cpu",
        "--config",
        str(cfg_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).parents[2],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            latest = (
                latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else None
            )
            if latest is not None and latest.name >= "step_00000002":
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    killed_at = latest_checkpoint(out / "checkpoints")
    assert killed_at is not None
    resumed_from = int(killed_at.name.split("_")[1])
    assert resumed_from < 12

    result = train(cfg, data, str(tiny_dir), out, dist_env)
    assert result.steps == 12
    got = _metrics(out)
    for step in range(resumed_from + 1, 13):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
