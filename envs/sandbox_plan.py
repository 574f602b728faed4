"""What the sandbox's boot stage is told to build, per isolation mode and privilege, and how it is started.

:func:`boot_plan` is the JSON plan ``envs/sandbox_boot.py`` executes (what the new root shows, the limits,
the uid); :func:`command` is the command line around it (``unshare`` with the namespaces to create, or
the boot stage alone for isolation ``none``) and the names of the layers it adds up to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from envs.sandbox import SandboxConfig

__all__ = ["BINDS", "BOOT", "ENV", "SandboxSupport", "boot_plan", "command"]

BOOT = Path(__file__).with_name("sandbox_boot.py")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of the code (and of ``unshare`` and the boot stage): nothing is inherited."""
BINDS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
"""What the new root shows of the host (read-only), besides the interpreter's own prefix."""


class SandboxSupport(msgspec.Struct, frozen=True, kw_only=True):
    """What this machine allows (see ``envs.sandbox.probe``)."""

    namespaces: bool
    """Isolation ``namespaces`` works here (a probe run succeeded)."""
    reason: str
    """Why it does not ('' when it does)."""
    root: bool
    """We run as root: no user namespace is needed and the code runs under a fresh uid."""
    python: str
    """Interpreter used for the boot stage and the code (one the run's uid can execute)."""
    unshare: str | None
    """Path of util-linux ``unshare``; None when it is not on PATH."""


def boot_plan(
    config: SandboxConfig, support: SandboxSupport, base: Path, main: Path, uid: int | None
) -> dict:
    """What the boot stage does (see envs/sandbox_boot.py); the caller adds the two pipe fds."""
    namespaces = config.isolation == "namespaces"
    userns = namespaces and not support.root
    if uid is not None:
        nproc = config.max_processes  # counted for the fresh uid: this run only
    elif userns:
        # counted in the fresh user namespace, where unshare and the run's init are too
        nproc = config.max_processes + 2
    else:
        nproc = _user_tasks() + config.max_processes  # isolation none, not root: our uid's tasks + the run's
    memory = config.memory_mb * 1024 * 1024
    prefix = str(Path(support.python).resolve().parent.parent)
    binds = [*BINDS, *([] if any(prefix == b or prefix.startswith(b + "/") for b in BINDS) else [prefix])]
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
            "RLIMIT_CPU": (config.cpu_time_s, config.cpu_time_s + 1),  # SIGXCPU first, SIGKILL a second later
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
    argv = [support.unshare, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", *boot]
    if support.root:
        return argv, "mountns+pidns+netns+ipcns+utsns+rootfs+uid+rlimits"
    argv[1:1] = ["--user", "--map-root-user"]
    return argv, "userns+mountns+pidns+netns+ipcns+utsns+rootfs+nocaps+rlimits"


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
