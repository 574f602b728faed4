"""Start, talk to, stop and clean up one sandboxed process: the mechanics behind
``leafe.envs.sandbox.launch``.

:func:`start` writes the code and a plan into a private temp dir, starts ``envs/sandbox/boot.py``
(under ``unshare`` for isolation ``namespaces``), and waits for the boot stage to say ``ok`` on a
pipe the code never holds; anything else means the isolation could not be built, and raises
:class:`SandboxUnavailable` before the code ran. :class:`SandboxProcess` then exchanges lines with
the code (interactive runs) or waits for it, and kills the whole tree at the end: the session, the
PID namespace (its init dies with ``unshare``) and, as root, every process of the run's fresh uid.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from subprocess import PIPE
from typing import Literal

import msgspec

from leafe.envs.base import EnvError
from leafe.envs.sandbox.plan import ENV, SandboxConfig, SandboxSupport, boot_plan, command

__all__ = ["SandboxProcess", "SandboxResult", "SandboxUnavailable", "Status", "start"]

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]


class SandboxUnavailable(EnvError):
    """The isolation the config requires cannot be had here; the code was not run."""


class SandboxResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a run did."""

    status: Status
    """``ok`` (exit 0), ``error`` (non-zero exit), ``timeout`` (wall or CPU limit), ``memory``
    (MemoryError), ``output_limit`` (wrote past RLIMIT_FSIZE), ``killed`` (another signal, or
    stopped by us while still running)."""
    returncode: int | None
    """Exit code; negative = killed by that signal; None when it was still running when we killed
    it."""
    stdout: str
    """Captured stdout (at most ``max_output_kb``; '' for interactive runs, whose stdout is a
    pipe)."""
    stderr: str
    """Captured stderr (at most ``max_output_kb``)."""
    wall_s: float
    """Wall time of the run."""
    isolation: str
    """Which layers were active, e.g.
    ``userns+mountns+pidns+netns+ipcns+utsns+rootfs+nocaps+nonewns+rlimits``."""


class SandboxProcess:
    """One started run; use as a context manager so the tree is killed and the temp dir removed."""

    def __init__(
        self,
        proc: subprocess.Popen,
        base: Path,
        config: SandboxConfig,
        uid: int | None,
        layers: str,
    ):
        self.proc, self.base, self.config, self.uid, self.layers = proc, base, config, uid, layers
        self.status_fd: int | None = None
        """Read end of the pipe on which the run's init reports the code's exit status (namespaces
        only)."""
        self.started = time.monotonic()
        self.deadline = self.started + config.wall_timeout_s
        """Monotonic time at which the run is out of wall-clock time."""
        self._buffer = bytearray()
        self._result: SandboxResult | None = None

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> bool:
        """Write ``data`` to the code's stdin; False when it no longer reads (exited, closed stdin,
        stuck)."""
        assert self.proc.stdin is not None, "send() needs an interactive run (open_python)"
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            if not select.select([], [fd], [], max(0.0, self.deadline - time.monotonic()))[1]:
                return False
            try:
                view = view[os.write(fd, view[: 1 << 16]) :]
            except (BrokenPipeError, OSError):
                return False
        return True

    def read_line(self, timeout_s: float, limit: int) -> bytes:
        """The code's next stdout line (without its newline).

        Raises TimeoutError after ``timeout_s`` (or at the run's deadline), EOFError when the code
        closed its stdout, ValueError when a line exceeds ``limit`` bytes.
        """
        assert self.proc.stdout is not None, "read_line() needs an interactive run (open_python)"
        until = min(self.deadline, time.monotonic() + timeout_s)
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > limit:
                raise ValueError(f"line longer than {limit} bytes")
            left = until - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"no line within {timeout_s:.2f} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise EOFError("the code closed its stdout")
            self._buffer += chunk
        if end > limit:
            raise ValueError(f"line longer than {limit} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line

    def close_stdin(self) -> None:
        """Tell the code there is nothing more to read (an interactive run then ends by itself)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # it stopped reading already; finish() will see how it ended

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until the code exits, ``timeout_s`` passes, or the run's deadline."""
        left = self.deadline - time.monotonic()
        try:
            self.proc.wait(timeout=max(0.0, left if timeout_s is None else min(left, timeout_s)))
        except subprocess.TimeoutExpired:
            pass  # still running: finish() kills it and says so

    def finish(self) -> SandboxResult:
        """Kill the whole tree (if still running) and report how the run ended; idempotent."""
        if self._result is not None:
            return self._result
        returncode = self.proc.poll()
        expired = returncode is None and time.monotonic() >= self.deadline
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        _kill_tree(self.proc, self.uid)
        if (
            self.status_fd is not None
        ):  # unshare's own exit code says nothing reliable about the code's
            returncode = _code_status(self.status_fd)
            os.close(self.status_fd)
            self.status_fd = None
        wall = time.monotonic() - self.started
        limit = self.config.max_output_kb * 1024
        out_path, err_path = self.base / "stdout", self.base / "stderr"
        stdout = _read(out_path, limit) if out_path.exists() else ""
        stderr = _read(err_path, limit)
        sizes = [p.stat().st_size for p in (out_path, err_path) if p.exists()]
        status = _classify(returncode, expired, stderr, max(sizes) >= limit)
        self._result = SandboxResult(
            status=status,
            returncode=returncode,
            stdout=stdout,
            stderr=stderr,
            wall_s=wall,
            isolation=self.layers,
        )
        return self._result

    def close(self) -> None:
        """Finish the run and remove its temp dir."""
        try:
            self.finish()
        finally:
            _remove_tree(self.base)


def start(
    source: str,
    config: SandboxConfig,
    support: SandboxSupport,
    uid: int | None,
    *,
    stdin: bytes | None,
) -> SandboxProcess:
    """Start ``source``: with ``stdin`` bytes it reads them from a file and writes stdout to a file;
    with None both are pipes to us. Raises :class:`SandboxUnavailable` when the isolation cannot be
    built."""
    base = Path(tempfile.mkdtemp(prefix="leafe-sandbox-"))
    try:
        namespaces = config.isolation == "namespaces"
        main = base / "main.py"
        if not namespaces:
            main = base / "work" / "main.py"
            main.parent.mkdir()
        main.write_text(source, encoding="utf-8")
        if not namespaces and uid is not None:
            os.chmod(base, 0o711)  # the run's uid may pass through, not list or read our files
            os.chown(main.parent, uid, uid)
            os.chown(main, uid, uid)
        (base / "root").mkdir()
        (read_fd, ready_fd), (status_read, status_fd) = os.pipe(), os.pipe()
        plan = boot_plan(config, support, base, main, uid) | {
            "ready_fd": ready_fd,
            "status_fd": status_fd,
        }
        argv, layers = command(config, support, uid, json.dumps(plan))
        try:
            proc = _popen(argv, base, stdin, (ready_fd, status_fd))
        finally:
            os.close(ready_fd)
            os.close(status_fd)
        run = SandboxProcess(proc, base, config, uid, layers)
        if namespaces:
            run.status_fd = status_read
        else:
            os.close(status_read)
        _await_ready(run, read_fd)
        return run
    except BaseException:
        _remove_tree(base)
        raise


def _popen(
    argv: list[str], base: Path, stdin: bytes | None, fds: tuple[int, int]
) -> subprocess.Popen:
    """Start the boot stage with ``fds``: its ready and status pipes (closed on exec: the code never
    has them)."""
    with open(base / "stderr", "wb") as err:
        if stdin is None:
            return subprocess.Popen(
                argv,
                cwd=base,
                stdin=PIPE,
                stdout=PIPE,
                stderr=err,
                env=ENV,
                start_new_session=True,
                pass_fds=fds,
            )
        (base / "stdin").write_bytes(stdin)
        with open(base / "stdin", "rb") as fin, open(base / "stdout", "wb") as out:
            return subprocess.Popen(
                argv,
                cwd=base,
                stdin=fin,
                stdout=out,
                stderr=err,
                env=ENV,
                start_new_session=True,
                pass_fds=fds,
            )


def _await_ready(run: SandboxProcess, read_fd: int) -> None:
    """Wait for the boot stage's ``ok``; anything else kills the run and raises
    SandboxUnavailable."""
    message = b""
    try:
        while message != b"ok":
            left = run.deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                message += b" (the sandbox setup did not finish in time)"
                break
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            message += chunk
    finally:
        os.close(read_fd)
    if message == b"ok":
        return
    result = (
        run.finish()
    )  # the code never ran: what is on stderr comes from unshare or the boot stage
    why = (
        message.decode(errors="replace").strip()
        or result.stderr.strip()[-500:]
        or f"exit {result.returncode}"
    )
    raise SandboxUnavailable(f"the sandbox could not be set up ({run.layers}): {why}")


def _code_status(fd: int) -> int | None:
    """The code's exit code as the init reported it (negative: killed by that signal); None if it
    had none."""
    os.set_blocking(fd, False)
    try:
        text = os.read(fd, 64)
    except BlockingIOError:
        return None  # still running when we killed the tree
    return int(text) if text else None


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL the session (unshare's --kill-child takes the PID namespace along), then the fresh
    uid's rest."""
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


def _remove_tree(path: Path) -> None:
    """Remove the run's directory even if the code took permissions away from its own files."""

    def make_writable_and_retry(func, target, _exc) -> None:  # shutil's onerror signature
        os.chmod(os.path.dirname(target), 0o700)
        if os.path.isdir(target) and not os.path.islink(target):
            os.chmod(target, 0o700)
        func(target)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _classify(returncode: int | None, expired: bool, stderr: str, over: bool) -> Status:
    if returncode is None:
        return "timeout" if expired else "killed"
    if returncode == -signal.SIGXCPU:
        return "timeout"
    if over or returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"
    if "MemoryError" in stderr:
        return "memory"
    if returncode == 0:
        return "ok"
    return "killed" if returncode < 0 else "error"
