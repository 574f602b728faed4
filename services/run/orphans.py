"""One supervisor per run directory, and nothing left running by one that was killed.

Every child of ``leafe run`` (the services, the embedded nats-server) runs in its own session, so a Ctrl-C
reaches only the supervisor, which drains them. A supervisor killed with SIGKILL (the OOM killer, a node
drain, ``kill -9``) drains nothing: its children keep running, an actor still taking tasks and a learner
still training, and a resumed run would start a second set beside them on the same store. So:

- the supervisor holds an exclusive lock on ``<runs_dir>/.<run_id>.lock`` for its whole life (the kernel
  drops it when the process dies, however it dies; the descriptor is not inherited by children); a second
  ``leafe run`` of the same run id is refused while the first lives;
- each child's pid is recorded in ``<run_dir>/pids/<name>.pid`` with its start time (``/proc``), so a pid
  reused by an unrelated process is never taken for a child;
- a supervisor that holds the lock and finds a recorded child still alive knows its supervisor died:
  it SIGKILLs the child's process group (its sandboxed subprocesses too) before anything else starts. To
  the pipeline that is one more crash, which it survives without loss (at-least-once delivery, idempotent
  folding, checkpoints).

Linux only (``/proc``); elsewhere the lock still holds and no pid is recorded.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path

import structlog

__all__ = ["RunLocked", "lock_run", "reap_orphans", "record_child"]

log = structlog.get_logger(__name__)
PID_DIR = "pids"


class RunLocked(RuntimeError):
    """Another ``leafe run`` of the same run id is alive."""


def lock_run(runs_dir: Path, run_id: str) -> int:
    """Take the run's lock (a descriptor to keep open while the run lives); :class:`RunLocked` if taken."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = runs_dir / f".{run_id}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunLocked(
            f"run {run_id!r} is already running (supervisor pid {holder}, lock {path}): "
            "stop it first, or use another --run-id"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); ``None`` if it
    is gone or a zombie (or there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the fields after "(comm)", from field 3 (the state) on
    return None if fields[0] in "ZX" else fields[19]


def record_child(run_dir: Path, name: str, pid: int) -> None:
    """Remember a child (``pid`` and start time) so a later supervisor can reap it as an orphan."""
    start = _start_time(pid)
    if start is None:
        return
    pids = run_dir / PID_DIR
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"{name}.pid").write_text(f"{pid} {start}\n", encoding="utf-8")


def reap_orphans(run_dir: Path, *, timeout_s: float = 10.0) -> list[str]:
    """SIGKILL every recorded child that is still alive (call with the run's lock held: then no live
    supervisor owns them); returns their names. Records of children that are gone are removed."""
    pids = run_dir / PID_DIR
    killed: list[str] = []
    for path in sorted(pids.glob("*.pid")) if pids.is_dir() else []:
        try:
            pid_text, start = path.read_text(encoding="utf-8").split()
            pid = int(pid_text)
        except (OSError, ValueError):
            log.warning("run.orphans.bad_record", path=str(path))
            path.unlink(missing_ok=True)
            continue
        if _start_time(pid) == start:
            log.warning("run.orphans.kill", service=path.stem, pid=pid)
            try:
                os.killpg(pid, signal.SIGKILL)  # a session leader: its group is the child and its own
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout_s
            while _start_time(pid) == start and time.monotonic() < deadline:
                time.sleep(0.05)
            killed.append(path.stem)
        path.unlink(missing_ok=True)
    return killed
