"""``services/run/orphans.py`` against someone who can write the runs directory: the reaper kills
only the run's own children, and the lock and pid records are never written through a planted
symlink.

Each case was a hole: a record holding the pid and start time of any process-group leader got its
whole group SIGKILLed, and so did a symlinked record or a symlinked ``pids/``; ``lock_run``
truncated and ``record_child`` rewrote a file elsewhere through a symlink planted in their place.
(Linux: ``/proc``.)
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from leafe.services.run.orphans import RUN_MARKER, lock_run, reap_orphans, record_child

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runs directory; the marker lock_run puts in this process's environment is undone
    afterwards."""
    monkeypatch.setenv(RUN_MARKER, "")
    yield tmp_path / "runs"


def _leader(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A process-group leader (as every child of ``leafe run`` is), with ``env`` added to ours."""
    return subprocess.Popen(
        ["sleep", "60"], start_new_session=True, env={**os.environ, **(env or {})}
    )


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def _locked(runs: Path, run_id: str = "r1") -> tuple[int, Path]:
    fd = lock_run(runs, run_id)
    return fd, runs / run_id


def test_only_a_process_the_run_started_is_killed(runs: Path) -> None:
    """Two group leaders recorded in pids/: the one carrying the run's marker (started after
    lock_run, as a supervisor's children are) is killed; an unrelated one with the right pid and
    start time is left alone, logged as not the run's. Both records are removed."""
    fd, run_dir = _locked(runs)
    try:
        child, stranger = _leader(), _leader({RUN_MARKER: ""})
        record_child(run_dir, "actor", child.pid)
        record_child(run_dir, "planted", stranger.pid)
        assert reap_orphans(run_dir, timeout_s=5) == ["actor"]
        child.wait(5)
        assert not _alive(child) and _alive(stranger)
        assert list((run_dir / "pids").iterdir()) == []
    finally:
        stranger.kill()
        os.close(fd)


def test_symlinked_records_and_pid_dirs_are_not_followed(runs: Path, tmp_path: Path) -> None:
    """A record that is a symlink to a true record of a marked child, and a pids/ that is a symlink
    to a directory of true records: neither gets anything killed, and the symlink's target
    survives."""
    fd, run_dir = _locked(runs)
    child = _leader()
    try:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        record_child(elsewhere, "actor", child.pid)
        (run_dir / "pids").mkdir()
        (run_dir / "pids" / "actor.pid").symlink_to(elsewhere / "pids" / "actor.pid")
        assert reap_orphans(run_dir, timeout_s=1) == []
        (run_dir / "pids").rmdir()  # the planted link was removed, its target kept
        (run_dir / "pids").symlink_to(elsewhere / "pids")
        assert reap_orphans(run_dir, timeout_s=1) == []
        assert _alive(child) and (elsewhere / "pids" / "actor.pid").is_file()
    finally:
        child.kill()
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_record_owned_by_another_user_is_not_trusted(runs: Path) -> None:
    """A true record of a marked child, but owned by another user: not trusted, nothing killed."""
    fd, run_dir = _locked(runs)
    child = _leader()
    try:
        record_child(run_dir, "actor", child.pid)
        os.chown(run_dir / "pids" / "actor.pid", 65534, 65534)
        assert reap_orphans(run_dir, timeout_s=1) == [] and _alive(child)
    finally:
        child.kill()
        os.close(fd)


def test_lock_and_records_are_never_written_through_a_symlink(runs: Path, tmp_path: Path) -> None:
    """The lock file planted as a symlink to a file elsewhere: lock_run refuses and the file keeps
    its bytes. A pid record planted as a symlink: record_child replaces the link, the file elsewhere
    keeps its bytes."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    runs.mkdir()
    (runs / ".r1.lock").symlink_to(victim)
    with pytest.raises(PermissionError, match="symlink"):
        lock_run(runs, "r1")
    assert victim.read_text() == "precious\n"
    (runs / ".r1.lock").unlink()
    fd, run_dir = _locked(runs)
    child = _leader()
    try:
        (run_dir / "pids").mkdir()
        (run_dir / "pids" / "actor.pid").symlink_to(victim)
        record_child(run_dir, "actor", child.pid)
        assert victim.read_text() == "precious\n"
        record = run_dir / "pids" / "actor.pid"
        assert not record.is_symlink() and record.read_text().split()[0] == str(child.pid)
    finally:
        child.kill()
        os.close(fd)


def test_the_run_directory_is_private_and_must_be_its_users(runs: Path, tmp_path: Path) -> None:
    """lock_run makes the run directory 0700 (an existing 0755 one too), and refuses a run directory
    that is a symlink to somewhere else."""
    runs.mkdir()
    (runs / "r1").mkdir(mode=0o755)
    fd, run_dir = _locked(runs)
    os.close(fd)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    (tmp_path / "target").mkdir()
    (runs / "r2").symlink_to(tmp_path / "target")
    with pytest.raises(PermissionError, match="symlink"):
        lock_run(runs, "r2")
