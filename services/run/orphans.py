"""One supervisor per run directory, and nothing left running by one that was killed.

Every child of ``leafe run`` (the services, the embedded nats-server) runs in its own session, so a
Ctrl-C reaches only the supervisor, which drains them. A supervisor killed with SIGKILL (the OOM
killer, a node drain, ``kill -9``) drains nothing: its children keep running, an actor still taking
tasks and a learner still training, and a resumed run would start a second set beside them on the
same store. So:

- the supervisor holds an exclusive lock on ``<runs_dir>/.<run_id>.lock`` for its whole life (the
  kernel drops it when the process dies, however it dies; the descriptor is not inherited by
  children); a second ``leafe run`` of the same run id is refused while the first lives. Taking it
  makes the run directory private (0700, refused when it is a symlink or another user's) and marks
  the supervisor's environment with ``LEAFE_RUN=<run dir>`` (:data:`RUN_MARKER`), which every child
  it starts inherits;
- each child's pid is recorded in ``<run_dir>/pids/<name>.pid`` with its start time (``/proc``), so
  a pid reused by an unrelated process is never taken for a child;
- a supervisor that holds the lock and finds a recorded child still alive knows its supervisor died:
  it SIGKILLs the child's process group (its sandboxed subprocesses too) before anything else
  starts. To the pipeline that is one more crash, which it survives without loss (at-least-once
  delivery, idempotent folding, checkpoints).

Whoever can write the runs directory could once plant records: a record naming any process-group
leader got its group killed. The reaper now kills only what it can prove is the run's own: a record
that is a regular file of this user reached without following a symlink (run dir, ``pids/``, the
file), a process of this user that leads its group, has the recorded start time and carries the
run's marker in its environment. The lock and the records are opened without following links, so a
planted symlink redirects no write.

Linux only (``/proc``); elsewhere the lock still holds and no pid is recorded.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import time
from pathlib import Path

import structlog

__all__ = ["RUN_MARKER", "RunLocked", "lock_run", "reap_orphans", "record_child"]

log = structlog.get_logger(__name__)
PID_DIR = "pids"
RUN_MARKER = "LEAFE_RUN"
"""Environment variable naming the run directory in every process a supervisor starts."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RunLocked(RuntimeError):
    """Another ``leafe run`` of the same run id is alive."""


def _marker(run_dir: Path) -> str:
    return str(run_dir.resolve())


def _own(fd: int, what: str, kind: int) -> None:
    """Refuse ``fd`` unless it is a ``kind`` (``stat.S_IFDIR``/``S_IFREG``) owned by this user."""
    st = os.fstat(fd)
    if stat.S_IFMT(st.st_mode) != kind or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(
            f"{what} is not this user's own {'directory' if kind == stat.S_IFDIR else 'file'}"
        )


def _private_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` 0700, or make an existing one so; refused when it is a symlink or not
    ours."""
    run_dir.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(run_dir, _DIR_FLAGS)
    except OSError as e:
        raise PermissionError(
            f"run directory {run_dir} is a symlink or unreadable: {e.strerror}"
        ) from None
    _own(fd, f"run directory {run_dir}", stat.S_IFDIR)
    os.fchmod(fd, 0o700)
    os.close(fd)


def lock_run(runs_dir: Path, run_id: str) -> int:
    """Take the run's lock (a descriptor to keep open while the run lives); :class:`RunLocked` if
    taken. Also makes the run directory private and marks this process's environment (see the
    module)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    _private_run_dir(runs_dir / run_id)
    path = runs_dir / f".{run_id}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise PermissionError(f"run lock {path} is a symlink or unusable: {e.strerror}") from None
    _own(fd, f"run lock {path}", stat.S_IFREG)
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
    os.environ[RUN_MARKER] = _marker(runs_dir / run_id)
    return fd


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); ``None``
    if it is gone or a zombie (or there is no /proc)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat_line.rsplit(")", 1)[
        1
    ].split()  # the fields after "(comm)", from field 3 (the state) on
    return None if fields[0] in "ZX" else fields[19]


def _pid_dir(run_dir: Path, *, create: bool) -> int | None:
    """A descriptor of ``run_dir/pids`` reached without following a symlink and owned by this user,
    or ``None``."""
    try:
        run_fd = os.open(run_dir, _DIR_FLAGS)
    except OSError:
        return None
    try:
        if create:
            try:
                os.mkdir(PID_DIR, 0o700, dir_fd=run_fd)
            except FileExistsError:
                pass
        fd = os.open(PID_DIR, _DIR_FLAGS, dir_fd=run_fd)
    except OSError:
        return None
    finally:
        os.close(run_fd)
    try:
        _own(fd, f"{run_dir / PID_DIR}", stat.S_IFDIR)
    except PermissionError:
        return None
    return fd


def record_child(run_dir: Path, name: str, pid: int) -> None:
    """Remember a child (``pid`` and start time) so a later supervisor can reap it as an orphan; the
    record is a new file (an existing entry, a planted symlink included, is removed first, never
    written through)."""
    start = _start_time(pid)
    if start is None:
        return
    dir_fd = _pid_dir(run_dir, create=True)
    if dir_fd is None:
        raise PermissionError(
            f"{run_dir / PID_DIR} is a symlink or unusable: no pid recorded for {name}"
        )
    try:
        try:
            os.unlink(f"{name}.pid", dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(f"{name}.pid", flags, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{pid} {start}\n")
    finally:
        os.close(dir_fd)


def _read_record(dir_fd: int, entry: str) -> tuple[int, str] | None:
    """``(pid, start)`` of a record that is this user's regular file (not a symlink), or
    ``None``."""
    try:
        fd = os.open(
            entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
        )
    except OSError:
        return None
    try:
        _own(fd, entry, stat.S_IFREG)
    except PermissionError:
        return None
    with os.fdopen(fd, "rb") as f:
        text = f.read(64).decode(errors="replace")
    try:
        pid_text, start = text.split()
        return int(pid_text), start
    except ValueError:
        return None


def _ours(pid: int, start: str, marker: str) -> bool:
    """Whether live process ``pid`` is a child this run started: this user's, the recorded start
    time, a process-group leader (what is killed is its group), the run's marker in its
    environment."""
    proc = Path(f"/proc/{pid}")
    try:
        if proc.stat().st_uid != os.geteuid() or os.getpgid(pid) != pid:
            return False
        environ = (proc / "environ").read_bytes()
    except OSError:
        return False
    return _start_time(pid) == start and f"{RUN_MARKER}={marker}".encode() in environ.split(b"\0")


def reap_orphans(run_dir: Path, *, timeout_s: float = 10.0) -> list[str]:
    """SIGKILL every recorded child that is still alive and provably the run's (call with the run's
    lock held: then no live supervisor owns them); returns their names. Every record is removed; one
    that is not a plain record of this user, or names a process that is not the run's, is logged and
    left alone."""
    pids = run_dir / PID_DIR
    if not os.path.lexists(pids):
        return []
    dir_fd = _pid_dir(run_dir, create=False)
    if dir_fd is None:
        log.warning(
            "run.orphans.refused", path=str(pids), reason="a symlink, or not this user's directory"
        )
        return []
    killed: list[str] = []
    marker = _marker(run_dir)
    try:
        for entry in sorted(e for e in os.listdir(dir_fd) if e.endswith(".pid")):
            name = entry.removesuffix(".pid")
            record = _read_record(dir_fd, entry)
            os.unlink(entry, dir_fd=dir_fd)
            if record is None:
                log.warning("run.orphans.bad_record", path=str(run_dir / PID_DIR / entry))
                continue
            pid, start = record
            if _start_time(pid) != start:
                continue  # gone: nothing to do
            if not _ours(pid, start, marker):
                log.warning("run.orphans.not_ours", service=name, pid=pid)
                continue
            log.warning("run.orphans.kill", service=name, pid=pid)
            try:
                os.killpg(
                    pid, signal.SIGKILL
                )  # a session leader: its group is the child and its own
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout_s
            while _start_time(pid) == start and time.monotonic() < deadline:
                time.sleep(0.05)
            killed.append(name)
    finally:
        os.close(dir_fd)
    return killed
