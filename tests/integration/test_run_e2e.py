"""End to end: ``leafe run --preset tiny`` runs every service for real (nats-server, CPU inference server
with the tiny model, actor, replayer, learner, weight sync), and a second run with the same id resumes
without redoing finished work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.events import EpisodeStarted
from services.eventlog.fileformat import read_events

pytestmark = pytest.mark.integration


def _leafe_run(runs: Path, run_id: str, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LEAFE_CACHE": str(cache_dir)}
    env.pop("LEAFE_NATS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--preset", "tiny", "--runs-dir", str(runs),
         "--run-id", run_id, "--no-live"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_tiny_run_end_to_end_then_resume(tmp_path: Path, cache_dir: Path) -> None:
    """The tiny run explores, materializes, trains, pushes and serves new weights, evaluates before and
    after, and its offline-rebuilt dataset equals what the learner consumed; rerunning resumes."""
    first = _leafe_run(tmp_path, "e2e", cache_dir)
    run_dir = tmp_path / "e2e"
    assert first.returncode == 0, first.stderr[-4000:]
    report = (run_dir / "report.md").read_text()
    assert "is identical to the" in report, report
    assert (run_dir / "eval" / "before.json").is_file()
    after = sorted((run_dir / "eval").glob("after-v*.json"))
    assert after, f"no evaluation of pushed weights; report:\n{report}"
    assert (run_dir / "passk.png").is_file() and (run_dir / "tree.png").is_file()
    manifest = (run_dir / "dataset" / "manifest.json").read_text()
    assert re.search(r'"samples":\s*[1-9]', manifest), manifest

    def explore_episodes() -> int:
        events = read_events(run_dir / "events.leafelog")
        return sum(isinstance(e, EpisodeStarted) and e.mode == "explore" for e in events)

    n_explore = explore_episodes()
    assert n_explore >= 2
    second = _leafe_run(tmp_path, "e2e", cache_dir)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "already done" in second.stderr
    assert explore_episodes() == n_explore, "a resumed run re-explored finished tasks"
