"""The sandbox holds every namespace it claims, and the code inside cannot make new ones.

Code inside must not create a user namespace (where it would hold every capability again: mount,
...), nor any other namespace; ``unshare`` is the root-owned util-linux binary at a fixed path,
never one found on ``PATH``; and the isolation probe refuses a sandbox that lacks any namespace it
claims (a wrapper that drops ``--net``, ``--uts`` or ``--ipc`` is noticed, not trusted).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from leafe.envs.sandbox import launch as sandbox
from leafe.envs.sandbox.launch import SandboxConfig, probe, run_python

FAST = SandboxConfig(wall_timeout_s=5.0, cpu_time_s=3, memory_mb=128, max_processes=3, disk_mb=8)

NESTED_NAMESPACES = """import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x20000, 0x40000000, 17
for name, flags in (("user", CLONE_NEWUSER), ("user+mount", CLONE_NEWUSER | CLONE_NEWNS), \
("net", CLONE_NEWNET)):
    print("unshare", name, libc.unshare(flags), ctypes.get_errno())
if os.uname().machine == "x86_64":  # the raw clone(2) with a namespace flag, not only unshare(2)
    pid = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    print("clone", pid, ctypes.get_errno())
    if pid > 0:
        os.waitpid(pid, 0)
r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
print("unshare-command", r.returncode)
"""


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    probe.cache_clear()
    yield
    probe.cache_clear()


def test_code_inside_cannot_create_a_namespace() -> None:
    """unshare(2) and clone(2) with namespace flags fail inside (EPERM), and so does the unshare
    command; ordinary forks and threads still work."""
    r = run_python(NESTED_NAMESPACES, FAST)
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    for line in lines:
        if line.startswith("unshare "):
            assert line.split()[2:] == ["-1", "1"], line  # -1, EPERM
    if platform.machine() == "x86_64":
        assert "clone -1 1" in lines
    assert "unshare-command 0" not in lines and any(
        line.startswith("unshare-command") for line in lines
    )
    threads = run_python(
        "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n", FAST
    )
    assert threads.status == "ok", threads.stderr


def test_an_unshare_planted_on_path_is_not_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_probe: None
) -> None:
    """A PATH entry ahead of /usr/bin with its own ``unshare`` (one that would drop --net) changes
    nothing: the sandbox runs the root-owned util-linux binary and the code sees no network."""
    fake = tmp_path / "unshare"
    fake.write_text(f'#!/bin/sh\ntouch {tmp_path}/used\nexec /usr/bin/unshare "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    support = probe()
    assert support.namespaces, support.reason
    assert support.unshare is not None and Path(support.unshare).parent != tmp_path
    r = run_python("import socket\nprint([n for _, n in socket.if_nameindex()])\n", FAST)
    assert r.status == "ok" and r.stdout.strip() == "['lo']", r
    assert not (tmp_path / "used").exists()


@pytest.mark.parametrize(
    ("dropped", "named"), [("--net", "network"), ("--uts", "uts"), ("--ipc", "ipc")]
)
def test_the_probe_refuses_a_sandbox_missing_a_namespace(
    tmp_path: Path, dropped: str, named: str
) -> None:
    """An ``unshare`` that silently drops one namespace makes the probe fail, naming the
    namespace."""
    wrapper = tmp_path / "unshare"
    wrapper.write_text(
        f'#!/bin/sh\nfor a; do shift; [ "$a" = "{dropped}" ] || set -- "$@" "$a"; done\n'
        'exec /usr/bin/unshare "$@"\n'
    )
    wrapper.chmod(0o755)
    support = msgspec.structs.replace(probe(), unshare=str(wrapper))
    reason = sandbox._try_namespaces(support)
    assert named in reason.lower(), reason
    assert sandbox._try_namespaces(probe()) == ""


def test_unshare_is_refused_unless_root_owns_it(tmp_path: Path) -> None:
    """The fixed candidates are checked: a binary (or a directory above it) someone else may replace
    is not used; a missing one is named."""
    fake = tmp_path / "bin" / "unshare"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(fake, 65534, 65534)
        path, reason = sandbox._trusted_unshare((str(fake),))
        assert path is None and "owned by uid 65534" in reason
        os.chown(fake, 0, 0)
        fake.parent.chmod(0o777)
        path, reason = sandbox._trusted_unshare((str(fake),))
        assert path is None and "writable" in reason
    path, reason = sandbox._trusted_unshare((str(tmp_path / "missing"),))
    assert path is None and "missing" in reason
