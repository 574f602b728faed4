"""Run untrusted Python in a process that holds no secret, reaches nothing, and cannot outgrow its
budget.

Isolation ``namespaces`` (the default, required unless a config opts out) puts the code in new
mount, PID, network, IPC and UTS namespaces made by ``unshare`` (util-linux), plus a user namespace
when we are not root, and ``envs/sandbox/boot.py`` sets up the inside before the code runs:

- filesystem: a new root with read-only binds of ``/usr``, ``/lib*`` and the interpreter's prefix
  only; ``/tmp`` is a tmpfs of ``disk_mb`` (the working directory, the only writable place;
  ``RLIMIT_FSIZE`` caps each file); no ``/etc``, ``/home``, ``/run`` or ``/var``, so no mounted
  secret or socket file;
- processes: a fresh ``/proc`` of the new PID namespace, so the parent's ``/proc/<pid>/environ``
  does not exist there and no process outside can be signalled; an init (PID 1, no capability)
  reports the code's exit status, and everything dies with it;
- network and IPC: only a down loopback (no TCP, no abstract unix socket), no SysV/POSIX IPC object
  or hostname of the host, and a fresh session keyring;
- privileges: as root, the code runs under a fresh unused uid; in a user namespace, the secure bits
  and an empty capability bounding set leave it no capability; ``no_new_privs`` in both;
- no new namespaces (``nonewns``): a seccomp filter makes ``unshare``/``clone`` with a namespace
  flag and ``setns`` fail with EPERM (``clone3`` with ENOSYS, so libc falls back to ``clone``), so
  the code cannot make a user namespace of its own and hold every capability there;
- environment: only ``PATH``, ``LANG``, ``PYTHONHASHSEED`` and ``PYTHONDONTWRITEBYTECODE``, never
  the parent's variables;
- limits: ``RLIMIT_CPU``, ``RLIMIT_AS`` (``memory_mb`` per process), ``RLIMIT_NPROC``
  (``max_processes`` per run: the fresh uid, or the fresh user namespace, counts only this run's
  tasks), ``RLIMIT_FSIZE``, no core files, a wall-clock timeout, and the whole tree is SIGKILLed at
  the end.

Memory is bounded per run by ``max_processes x memory_mb + disk_mb <= memory_budget_mb`` (checked
when the config is built). We chose rlimits over a memory cgroup because a pod can rarely write its
cgroup tree (non-root, read-only ``/sys/fs/cgroup``) and rlimits behave the same on every machine;
the price is that threads count as processes and address space overstates resident memory, so the
budget is conservative.

``unshare`` is util-linux's at ``/usr/bin/unshare`` or ``/bin/unshare`` (never looked up on
``PATH``), used only if root owns it and every directory above it, none writable by others. The
probe runs a program in the sandbox and checks everything claimed: its own mount, PID, network, IPC
and UTS namespaces (and user namespace when not root) differ from ours, it is PID 2 beside its init,
``/usr`` is read-only, ``lo`` is its only network link and is down, and it cannot make a user
namespace.

Fail closed: when the required isolation is unavailable, :func:`check_isolation` (called when an env
is built) and every run raise :class:`SandboxUnavailable` naming what is missing; nothing degrades
silently. ``isolation = "none"`` runs with rlimits, a session and (as root) a fresh uid only; it is
for development and warns each time an env is built with it.

Kubernetes. The actor runs non-root there, so the user-namespace path applies. It needs no
capability in the pod's ``securityContext`` (``runAsNonRoot``, ``capabilities: drop: [ALL]`` and
``allowPrivilegeEscalation: false`` are all fine), but these system calls must be allowed to the
actor's container (checked on this machine as uid 65534; not tried on a cluster):

- ``unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWNET|CLONE_NEWIPC|CLONE_NEWUTS)``, writes
  to ``/proc/self/{setgroups,uid_map,gid_map}``, ``fork``/``clone``, ``execve``;
- inside the new user namespace (whose capabilities the boot stage holds, and nothing outside it):
  ``mount`` (tmpfs, proc, bind, remount), ``mount_setattr`` (kernel >= 5.12; without it, one remount
  per mount), ``pivot_root``, ``umount2``, ``prctl`` (``PR_SET_NO_NEW_PRIVS``,
  ``PR_SET_SECUREBITS``, ``PR_CAPBSET_DROP``, ``PR_CAP_AMBIENT``, ``PR_SET_DUMPABLE``), ``capset``,
  ``setrlimit``, and ``keyctl(KEYCTL_JOIN_SESSION_KEYRING)`` (optional: where it is refused, no
  keyring can leak either), and ``prctl(PR_SET_SECCOMP)`` (a filter installed after
  ``no_new_privs``; without it the run refuses).

What refuses them by default: the RuntimeDefault seccomp profile (``unshare``, ``mount``,
``umount2``, ``pivot_root`` and namespace flags of ``clone`` only with ``CAP_SYS_ADMIN``), the
runtime's default AppArmor profile (denies ``mount``), the masked ``/proc`` of a container (a user
namespace may mount a fresh ``/proc`` only where no part of the container's is hidden), and nodes
that forbid unprivileged user namespaces (``user.max_user_namespaces = 0``, Ubuntu's
``kernel.apparmor_restrict_unprivileged_userns``). So either:

- run the actor under gVisor (``runtimeClassName: gvisor``): its own kernel implements the
  namespaces, mounts and ``pivot_root``, and the host's seccomp and AppArmor never see these calls
  (``mount_setattr`` may be missing there, hence the fallback); or
- give the container that runs the sandbox (the actor) ``seccompProfile: Localhost`` with a profile
  that allows the calls above (or ``Unconfined``), ``appArmorProfile: Unconfined`` (or a profile
  allowing ``mount``, ``umount`` and ``pivot_root``), ``procMount: Unmasked`` (which needs
  ``hostUsers: false``), on nodes with ``user.max_user_namespaces > 0``.

The image needs util-linux ``unshare`` at ``/usr/bin`` or ``/bin`` and a Python interpreter under
``/usr`` (or under a prefix the run's uid can read). As root (this development machine) no user
namespace is needed: the namespaces are made with root's capabilities and the code runs under a
fresh uid.

Run ``python -m leafe.envs.sandbox.launch`` to print what this machine supports and run a fork bomb
safely.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import stat
import sys
import time
from pathlib import Path

import msgspec
import structlog

from leafe.envs.sandbox.plan import SandboxConfig, SandboxSupport
from leafe.envs.sandbox.process import (
    SandboxProcess,
    SandboxResult,
    SandboxUnavailable,
    Status,
    start,
)

__all__ = [
    "SandboxConfig",
    "SandboxProcess",
    "SandboxResult",
    "SandboxSupport",
    "SandboxUnavailable",
    "Status",
    "check_isolation",
    "open_python",
    "probe",
    "run_python",
]

log = structlog.get_logger(__name__)

UNSHARE_PATHS = ("/usr/bin/unshare", "/bin/unshare")
"""Where util-linux ``unshare`` is taken from (never ``PATH``): the first that exists, if root owns
it."""
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts")
"""The namespaces every run gets (plus ``user`` when we are not root), each checked by the probe."""
PROBE_CODE = """import ctypes, fcntl, json, os, socket, struct
ns = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("mnt", "pid", "net", "ipc", "uts", "user")}
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFFLAGS: IFF_UP is bit 0
    lo = struct.unpack("16sH", fcntl.ioctl(s.fileno(), 0x8913, struct.pack("16sH", b"lo", 0)))[1]
nested = ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0  # CLONE_NEWUSER
print(json.dumps({
    "pid": os.getpid(), "procs": sorted(p for p in os.listdir("/proc") if p.isdigit()),
    "usr_writable": os.access("/usr", os.W_OK), "ns": ns, \
"links": [n for _, n in socket.if_nameindex()],
    "lo_up": bool(lo & 1), "nested_userns": nested,
}))
"""
"""What the probe's code reports of its own view; :func:`_probe_findings` says what must hold."""


@functools.cache
def probe() -> SandboxSupport:
    """Find out once per process whether the ``namespaces`` isolation works here, by running it."""
    root = os.geteuid() == 0
    python = _python_for_others() if root else str(Path(sys.executable).resolve())
    unshare, unshare_problem = _trusted_unshare(UNSHARE_PATHS)
    support = SandboxSupport(
        namespaces=False, reason="", root=root, python=python or "", unshare=unshare
    )
    if python is None:
        reason = (
            "no Python interpreter that every user may execute "
            "(root runs the code under a fresh uid)"
        )
    elif unshare is None:
        reason = unshare_problem
    else:
        reason = _try_namespaces(msgspec.structs.replace(support, namespaces=True))
    support = msgspec.structs.replace(support, namespaces=not reason, reason=reason)
    log.info("leafe.envs.sandbox.launch.probe", **msgspec.to_builtins(support))
    return support


def _trusted_unshare(candidates: tuple[str, ...]) -> tuple[str | None, str]:
    """(absolute path, '') of the first candidate that exists, if root owns it and every directory
    above it and none of them is writable by anyone else (a sticky directory aside); else (None, why
    not)."""
    for candidate in candidates:
        real = Path(candidate).resolve()
        if not real.is_file():
            continue
        for path in (real, *real.parents):
            st = path.stat()
            if st.st_uid != 0:
                return None, f"{real} is not trusted: {path} is owned by uid {st.st_uid}, not root"
            sticky_dir = path != real and st.st_mode & stat.S_ISVTX
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
                return None, f"{real} is not trusted: {path} is writable by others than root"
        return str(real), ""
    return None, f"util-linux `unshare` is missing (looked for {', '.join(candidates)})"


def _try_namespaces(support: SandboxSupport) -> str:
    """'' when a trivial program run in the sandbox sees every namespace it claims, else why not."""
    try:
        result = _run(PROBE_CODE, SandboxConfig(wall_timeout_s=20), support, b"")
    except SandboxUnavailable as e:
        return str(e)
    try:
        seen = json.loads(result.stdout)
    except ValueError:
        seen = None
    if result.status != "ok" or not isinstance(seen, dict):
        return (
            f"the probe run ended {result.status}: {(result.stdout + result.stderr).strip()[:300]}"
        )
    problems = _probe_findings(seen, support)
    return f"the probe run lacks isolation: {'; '.join(problems)}" if problems else ""


def _probe_findings(seen: dict, support: SandboxSupport) -> list[str]:
    """What the probe's report shows missing: each namespace must differ from ours, the code must be
    PID 2 beside its init only, ``/usr`` read-only, only a down ``lo``, and no nested user namespace
    possible."""
    problems = []
    ours = {n: os.readlink(f"/proc/self/ns/{n}") for n in (*NAMESPACES, "user")}
    names = {
        "mnt": "mount",
        "pid": "PID",
        "net": "network",
        "ipc": "IPC",
        "uts": "UTS",
        "user": "user",
    }
    for n in (*NAMESPACES, *([] if support.root else ["user"])):
        if seen["ns"].get(n) == ours[n]:
            problems.append(f"no {names[n]} namespace of its own ({n} is {ours[n]}, the parent's)")
    if seen["pid"] != 2 or seen["procs"] != ["1", "2"]:
        problems.append(
            f"it is PID {seen['pid']} and sees processes {seen['procs'][:5]}, not 2 beside its init"
        )
    if seen["usr_writable"]:
        problems.append("/usr is writable")
    if seen["links"] != ["lo"] or seen["lo_up"]:
        problems.append(
            f"its network has links {seen['links']} (lo up: {seen['lo_up']}), not a down lo only"
        )
    if seen["nested_userns"]:
        problems.append("the code could create a user namespace of its own")
    return problems


def check_isolation(config: SandboxConfig) -> SandboxSupport:
    """Raise :class:`SandboxUnavailable` if ``config``'s isolation cannot be had here; warn if it is
    off."""
    support = probe()
    if config.isolation == "none":
        log.warning(
            "leafe.envs.sandbox.launch.isolation_disabled",
            detail=(
                "sandbox.isolation = 'none': untrusted code runs with rlimits only; "
                "development use only"
            ),
        )
    elif not support.namespaces:
        raise SandboxUnavailable(_unavailable(support))
    return support


def _unavailable(support: SandboxSupport) -> str:
    kinds = "mount, PID and network" if support.root else "user, mount, PID and network"
    return (
        f"the sandbox requires isolation 'namespaces' ({kinds} namespaces via unshare) and this "
        "machine "
        f"does not allow it: {support.reason}. Run where user namespaces may be created (a gVisor "
        "runtimeClass, or a container allowed to create them: see envs/sandbox/launch.py), or set "
        "sandbox.isolation = 'none' for development only"
    )


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


def _support(config: SandboxConfig) -> SandboxSupport:
    support = probe()
    if config.isolation == "namespaces" and not support.namespaces:
        raise SandboxUnavailable(_unavailable(support))
    return support


def run_python(
    source: str, config: SandboxConfig | None = None, *, stdin: bytes = b""
) -> SandboxResult:
    """Run ``source`` as a script in the sandbox and report how it ended.

    Never raises for the code's sake; raises :class:`SandboxUnavailable` when the isolation cannot
    be had.
    """
    config = config or SandboxConfig()
    return _run(source, config, _support(config), stdin)


def _run(
    source: str, config: SandboxConfig, support: SandboxSupport, stdin: bytes
) -> SandboxResult:
    with start(source, config, support, _fresh_uid(support), stdin=stdin) as proc:
        proc.wait()
        return proc.finish()


def open_python(source: str, config: SandboxConfig | None = None) -> SandboxProcess:
    """Start ``source`` in the sandbox with its stdin and stdout as pipes to us (use it as a context
    manager).

    For a conversation with the code (see ``leafe.envs.humaneval.judge``); the whole tree is killed
    when the context exits.
    """
    config = config or SandboxConfig()
    return start(source, config, _support(config), _fresh_uid(_support(config)), stdin=None)


def _fresh_uid(support: SandboxSupport) -> int | None:
    """As root, a uid no account uses (``/etc/passwd`` has none this high): its process count is
    ours alone."""
    return 200_000 + secrets.randbelow(1_000_000_000) if support.root and support.python else None


def _demo() -> None:
    support = probe()
    print(support)
    if not support.namespaces:
        print(f"isolation 'namespaces' is unavailable here: {support.reason}")
    config = SandboxConfig(
        wall_timeout_s=2, cpu_time_s=2, isolation="namespaces" if support.namespaces else "none"
    )
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    start_s = time.monotonic()
    print(run_python(bomb, config), f"({time.monotonic() - start_s:.2f} s)")


if __name__ == "__main__":
    _demo()
