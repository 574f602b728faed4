"""What the sandbox's boot stage is told to build, per isolation mode and privilege, and how it is
started.

:func:`boot_plan` is the JSON plan ``envs/sandbox/boot.py`` executes (what the new root shows, the
limits, the uid); :func:`command` is the command line around it (``unshare`` with the namespaces to
create, or the boot stage alone for isolation ``none``) and the names of the layers it adds up to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "BINDS",
    "BOOT",
    "ENV",
    "Isolation",
    "SandboxConfig",
    "SandboxSupport",
    "boot_plan",
    "command",
]

BOOT = Path(__file__).with_name("boot.py")
ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
}
"""The whole environment of the code (and of ``unshare`` and the boot stage): nothing is
inherited."""
BINDS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
"""What the new root shows of the host (read-only), besides the interpreter's own prefix."""


Isolation = Literal["namespaces", "none"]


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Isolation and limits of one sandboxed run."""

    isolation: Isolation = "namespaces"
    """``namespaces``: the layers of the module docstring, or refuse to run; ``none``: rlimits, a
    session and (as root) a fresh uid only, for development (warned about when an env is built)."""
    wall_timeout_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed after it."""
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 256
    """Address space per process in MiB (RLIMIT_AS)."""
    max_processes: int = 3
    """Processes and threads of the run, the first one included (RLIMIT_NPROC, counted for the run
    alone)."""
    disk_mb: int = 64
    """Size of the run's tmpfs working directory in MiB (it lives in memory, so it counts in the
    budget)."""
    memory_budget_mb: int = 1024
    """Memory one run may use at most: ``max_processes * memory_mb + disk_mb`` must not exceed
    it."""
    max_output_kb: int = 256
    """Largest file the code may write, stdout/stderr included (RLIMIT_FSIZE), in KiB."""

    def __post_init__(self) -> None:
        for name in (
            "wall_timeout_s",
            "cpu_time_s",
            "memory_mb",
            "max_processes",
            "disk_mb",
            "max_output_kb",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)}")
        used = self.max_processes * self.memory_mb + self.disk_mb
        if used > self.memory_budget_mb:
            raise ValueError(
                f"sandbox max_processes * memory_mb + disk_mb = {self.max_processes} * "
                f"{self.memory_mb} + "
                f"{self.disk_mb} = {used} MiB exceeds memory_budget_mb = {self.memory_budget_mb}"
            )


class SandboxSupport(msgspec.Struct, frozen=True, kw_only=True):
    """What this machine allows (see ``leafe.envs.sandbox.launch.probe``)."""

    namespaces: bool
    """Isolation ``namespaces`` works here (a probe run succeeded)."""
    reason: str
    """Why it does not ('' when it does)."""
    root: bool
    """We run as root: no user namespace is needed and the code runs under a fresh uid."""
    python: str
    """Interpreter used for the boot stage and the code (one the run's uid can execute)."""
    unshare: str | None
    """Absolute path of the root-owned util-linux ``unshare`` (never looked up on PATH); None when
    missing or not trusted."""


def boot_plan(
    config: SandboxConfig, support: SandboxSupport, base: Path, main: Path, uid: int | None
) -> dict:
    """What the boot stage does (see envs/sandbox/boot.py); the caller adds the two pipe fds."""
    namespaces = config.isolation == "namespaces"
    userns = namespaces and not support.root
    if uid is not None:
        nproc = config.max_processes  # counted for the fresh uid: this run only
    elif userns:
        # counted in the fresh user namespace, where unshare and the run's init are too
        nproc = config.max_processes + 2
    else:
        nproc = (
            _user_tasks() + config.max_processes
        )  # isolation none, not root: our uid's tasks + the run's
    memory = config.memory_mb * 1024 * 1024
    prefix = str(Path(support.python).resolve().parent.parent)
    binds = [
        *BINDS,
        *([] if any(prefix == b or prefix.startswith(b + "/") for b in BINDS) else [prefix]),
    ]
    return {
        "namespaces": namespaces,
        "userns": userns,
        "root": str(base / "root"),
        "binds": binds,
        "main": str(main),
        "work": str(main.parent),
        "uid": 0 if userns else uid or 0,
        "setuid": uid,
        "disk_kb": config.disk_mb * 1024,
        "disk_inodes": 4096,
        "rlimits": {
            "RLIMIT_CPU": (
                config.cpu_time_s,
                config.cpu_time_s + 1,
            ),  # SIGXCPU first, SIGKILL a second later
            "RLIMIT_AS": (memory, memory),
            "RLIMIT_FSIZE": (config.max_output_kb * 1024,) * 2,
            "RLIMIT_NPROC": (nproc, nproc),
            "RLIMIT_CORE": (0, 0),
        },
        "python": support.python,
        "env": ENV,
    }


def command(
    config: SandboxConfig, support: SandboxSupport, uid: int | None, plan: str
) -> tuple[list[str], str]:
    """The command line that starts the boot stage with ``plan``, and the layers it adds up to."""
    boot = [support.python, "-I", "-S", "-B", str(BOOT), plan]
    if config.isolation == "none":
        return boot, "rlimits+session" + ("+uid" if uid is not None else "")
    assert support.unshare is not None, "isolation 'namespaces' needs unshare (probe() checks)"
    argv = [
        support.unshare,
        "--mount",
        "--net",
        "--pid",
        "--ipc",
        "--uts",
        "--fork",
        "--kill-child",
        *boot,
    ]
    if support.root:
        return argv, "mountns+pidns+netns+ipcns+utsns+rootfs+uid+nonewns+rlimits"
    argv[1:1] = ["--user", "--map-root-user"]
    return argv, "userns+mountns+pidns+netns+ipcns+utsns+rootfs+nocaps+nonewns+rlimits"


def _user_tasks() -> int:
    """Tasks (processes + threads) of our uid: RLIMIT_NPROC counts them all, not just the
    sandbox's."""
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue  # the process exited while we counted
    return count
