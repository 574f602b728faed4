"""SIGKILL of ``leafe run``'s supervisor in the middle of a continual run: its children (services in
their own sessions, the embedded nats-server) survive it, so the rerun must stop them before it
starts its own, then resume the run to the end with nothing lost (``services/run/orphans.py``). A
second supervisor of a live run is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from leafe.protocol.events import EpisodeFinished, EpisodeStarted
from leafe.services.eventlog.fileformat import read_events
from tests.support.leafe_run import leafe_run_argv, leafe_run_env

pytestmark = pytest.mark.integration


_FAST = """\
# redeliveries after the kill within seconds, and no held-out evaluation \
(not what this test is about)
[eval]
before = false
after = false
[actor]
ack_wait_s = 10.0
in_progress_interval_s = 3.0
[replayer]
ack_wait_s = 10.0
[learner]
ack_wait_s = 10.0
"""


def _argv(runs: Path) -> list[str]:
    config = runs / "fast.toml"
    config.write_text(_FAST)
    return leafe_run_argv(runs, "--config", str(config))


def _processes_of(run_dir: Path) -> dict[int, str]:
    """Live processes whose command line names the run directory (the run's services and
    nats-server)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir) in cmdline and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text(errors="replace") if path.is_file() else ""):
        assert proc.poll() is None, path.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.5)


def test_a_killed_supervisors_children_are_stopped_and_the_rerun_resumes(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Kill -9 the supervisor while round 0 explores: its services keep running (what a rerun must
    deal with). The rerun is refused nothing, stops every one of them first, and finishes both
    rounds: every explore task finished exactly once in the log, and the samples on the stream equal
    the offline rebuild."""
    runs, run_dir = tmp_path, tmp_path / "tiny"
    stderr = tmp_path / "first.stderr"
    with stderr.open("wb") as err:
        first = subprocess.Popen(
            [*_argv(runs), "--no-live"], env=leafe_run_env(cache_dir), stderr=err, stdout=err
        )
    try:
        _wait_for(stderr, "round 0: submitted", first)
        # a second supervisor of a live run is refused (it would start a second set of services)
        refused = subprocess.run(
            [*_argv(runs), "--no-live"],
            env=leafe_run_env(cache_dir),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2 and "already running" in refused.stderr, refused.stderr[
            -2000:
        ]
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        orphans = _processes_of(run_dir)
        assert any("nats-server" in c for c in orphans.values()), orphans
        assert any(" actor" in c for c in orphans.values()), orphans

        second = subprocess.run(
            [*_argv(runs), "--no-live"],
            env=leafe_run_env(cache_dir),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert second.returncode == 0, second.stderr[-4000:]
        assert "stopped what a killed supervisor left running" in second.stderr, second.stderr[
            -3000:
        ]
        assert not set(orphans) & set(_processes_of(run_dir)), (
            "a killed supervisor's child still runs"
        )
    finally:
        for pid in _processes_of(run_dir):
            os.kill(pid, signal.SIGKILL)

    report = json.loads((run_dir / "report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == [0, 1] and all(
        r["finished"] for r in report["rounds"]
    )
    assert report["dataset"]["identical"] and report["dataset"]["samples"] > 0, report["dataset"]
    events = list(read_events(run_dir / "events.leafelog"))
    keys = {
        e.episode_id: e.task_key
        for e in events
        if isinstance(e, EpisodeStarted) and e.mode == "explore"
    }
    finished = [
        keys[e.episode_id]
        for e in events
        if isinstance(e, EpisodeFinished) and e.episode_id in keys
    ]
    # 2 tasks x 2 rounds, none lost; an episode the kill cut short is started again, never finished
    # twice
    assert len(set(finished)) == 4 and len(finished) == 4, finished
