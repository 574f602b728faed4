"""Run untrusted Python in a subprocess that cannot hang, fork-bomb, eat memory, flood output or leak.

Layers (each used where this machine allows it; :func:`probe` reports which):

- resource limits set before exec: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space),
  ``RLIMIT_FSIZE`` (stdout/stderr go to files, so this also caps output), ``RLIMIT_NPROC``
  (processes + threads), ``RLIMIT_CORE`` = 0; a wall-clock timeout on top;
- a new session, so the whole process group is SIGKILLed at the end;
- ``unshare --net --pid --fork --kill-child``: no network (only a down loopback) and a private PID
  namespace, so every process the code started dies with it, whatever it does with sessions;
- as root, ``RLIMIT_NPROC`` does not bind (root bypasses it), so the code runs under a fresh, unused
  uid (``unshare --setuid``): the process limit then counts only this run's processes, and a final
  sweep kills anything left with that uid;
- not root: no uid switch; ``RLIMIT_NPROC`` is set to the user's current task count plus the budget.
- the code's working directory is a fresh temp directory, removed afterwards.

Run ``python -m envs.sandbox`` to print what this machine supports and run a fork bomb safely.
"""

from __future__ import annotations

import functools
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec
import structlog

__all__ = ["SandboxConfig", "SandboxResult", "SandboxSupport", "probe", "run_python"]

log = structlog.get_logger(__name__)

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits of one sandboxed run."""

    wall_timeout_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed after it."""
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS)."""
    max_processes: int = 16
    """Processes and threads of the run (RLIMIT_NPROC, counted for the run's own uid)."""
    max_output_kb: int = 256
    """Largest file the code may write, stdout/stderr included (RLIMIT_FSIZE), in KiB."""
    isolate_network: bool = True
    """Run in new network and PID namespaces when ``unshare`` works here."""
    drop_privileges: bool = True
    """As root, run under a fresh unused uid so RLIMIT_NPROC applies."""


class SandboxResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a run did."""

    status: Status
    """``ok`` (exit 0), ``error`` (non-zero exit), ``timeout`` (wall or CPU limit), ``memory``
    (MemoryError or killed near the memory limit), ``output_limit`` (wrote past RLIMIT_FSIZE),
    ``killed`` (another signal)."""
    returncode: int | None
    """Exit code; negative = killed by that signal; None when the wall timeout killed it."""
    stdout: str
    """Captured stdout (at most ``max_output_kb``)."""
    stderr: str
    """Captured stderr (at most ``max_output_kb``)."""
    wall_s: float
    """Wall time of the run."""
    isolation: str
    """Which layers were active, e.g. ``rlimits+session+netns+pidns+uid``."""


class SandboxSupport(msgspec.Struct, frozen=True, kw_only=True):
    """What this machine allows (see :func:`probe`)."""

    unshare: bool
    """``unshare --net --pid --fork --kill-child`` works (with ``--setuid`` when root)."""
    root: bool
    """We run as root, so the code runs under a fresh uid."""
    python: str
    """Interpreter used for the code (one the fresh uid can execute)."""


@functools.cache
def probe() -> SandboxSupport:
    """Find out once per process which isolation layers work on this machine."""
    root = os.geteuid() == 0
    python = _python_for_others() if root else sys.executable
    unshare = shutil.which("unshare")
    works = False
    if unshare:
        cmd = [unshare, "--net", "--pid", "--fork", "--kill-child"]
        if root:
            cmd += ["--setuid", "65534", "--setgid", "65534"]
        else:
            cmd = [unshare, "--map-root-user", *cmd[1:]]
        try:
            works = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("envs.sandbox.unshare_unavailable", error=f"{type(e).__name__}: {e}")
    support = SandboxSupport(unshare=works, root=root, python=python or sys.executable)
    log.info("envs.sandbox.probe", **msgspec.to_builtins(support))
    return support


def _python_for_others() -> str | None:
    """An interpreter every user may execute (the venv's may live under a private home)."""
    for candidate in (
        sys.executable,
        getattr(sys, "_base_executable", sys.executable),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ):
        real = Path(candidate).resolve()
        if real.is_file() and _world_executable(real):
            return str(real)
    return None


def _world_executable(path: Path) -> bool:
    if not path.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def run_python(source: str, config: SandboxConfig | None = None, *, stdin: bytes = b"") -> SandboxResult:
    """Run ``source`` as a script in the sandbox and report how it ended; never raises for the code's sake."""
    config = config or SandboxConfig()
    support = probe()
    uid = _fresh_uid() if (support.root and config.drop_privileges and support.python) else None
    base = Path(tempfile.mkdtemp(prefix="leafe-sandbox-"))
    try:
        work = base / "work"
        work.mkdir()
        (work / "main.py").write_text(source, encoding="utf-8")
        if uid is not None:
            os.chmod(base, 0o711)  # the run's uid may pass through, not list or read our files
            os.chown(work, uid, uid)
            os.chown(work / "main.py", uid, uid)
        argv, layers = _command(support, config, uid)
        return _execute(argv, layers, work, base, config, uid, stdin)
    finally:
        _remove_tree(base)


def _remove_tree(path: Path) -> None:
    """Remove the run's directory even if the code took permissions away from its own files."""

    def make_writable_and_retry(func, target, _exc) -> None:  # shutil's onerror signature
        os.chmod(os.path.dirname(target), 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
        func(target)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _fresh_uid() -> int:
    """A uid no account uses (``/etc/passwd`` has none this high): its process count is ours alone."""
    return 200_000 + secrets.randbelow(1_000_000_000)


def _command(support: SandboxSupport, config: SandboxConfig, uid: int | None) -> tuple[list[str], list[str]]:
    layers = ["rlimits", "session"]
    argv: list[str] = []
    if config.isolate_network and support.unshare:
        argv = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
        if not support.root:
            argv.insert(1, "--map-root-user")
        layers += ["netns", "pidns"]
    if uid is not None:
        if argv:  # the uid switch must come after the namespaces are made, so unshare does it
            argv += ["--setuid", str(uid), "--setgid", str(uid)]
        layers.append("uid")  # without namespaces, _limit switches uid before exec
    python = support.python if uid is not None else sys.executable
    argv += [python, "-I", "-B", "main.py"]
    return argv, layers


def _execute(
    argv: list[str],
    layers: list[str],
    work: Path,
    base: Path,
    config: SandboxConfig,
    uid: int | None,
    stdin: bytes,
) -> SandboxResult:
    out_path, err_path, in_path = base / "stdout", base / "stderr", base / "stdin"
    in_path.write_bytes(stdin)
    nproc = config.max_processes if uid is not None else _user_tasks() + config.max_processes
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err, open(in_path, "rb") as fin:
        proc = subprocess.Popen(
            argv,
            cwd=work,
            stdin=fin,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(_limit, config, nproc, None if "netns" in layers else uid),
            close_fds=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=config.wall_timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _kill_tree(proc, uid)
    wall = time.monotonic() - start
    limit = config.max_output_kb * 1024
    stdout, stderr = _read(out_path, limit), _read(err_path, limit)
    status = _classify(returncode, stderr, out_path, err_path, config)
    return SandboxResult(
        status=status,
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        wall_s=wall,
        isolation="+".join(layers),
    )


def _limit(config: SandboxConfig, nproc: int, switch_uid: int | None) -> None:
    """Runs in the child between fork and exec: set the limits, then drop to ``switch_uid`` if given."""
    mem = config.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_time_s, config.cpu_time_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (config.max_output_kb * 1024,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if switch_uid is not None:
        os.setgroups([])
        os.setgid(switch_uid)
        os.setuid(switch_uid)


def _user_tasks() -> int:
    """Tasks (processes + threads) of our uid: RLIMIT_NPROC counts them all, not just the sandbox's."""
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue  # the process exited while we counted
    return count


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL the session, then (with a fresh uid) anything else still running under it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone
    proc.wait()
    if uid is not None:
        for _ in range(50):
            if not _kill_uid(uid):
                break
            time.sleep(0.01)


def _kill_uid(uid: int) -> int:
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        except OSError:
            continue  # it exited meanwhile
    return killed


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _classify(
    returncode: int | None, stderr: str, out_path: Path, err_path: Path, config: SandboxConfig
) -> Status:
    limit = config.max_output_kb * 1024
    if returncode is None or returncode == -signal.SIGXCPU:
        return "timeout"
    over = out_path.stat().st_size >= limit or err_path.stat().st_size >= limit
    if over or returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory"
    if returncode == 0:
        return "ok"
    return "killed" if returncode < 0 else "error"


def _demo() -> None:
    print(probe())
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    print(run_python(bomb, SandboxConfig(wall_timeout_s=2, cpu_time_s=2)))


if __name__ == "__main__":
    _demo()
