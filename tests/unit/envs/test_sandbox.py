"""The sandbox kills loops, fork bombs, memory hogs and output floods, and leaves nothing behind.

What the code can see and reach (secrets, files, signals, memory per run) and the fail-closed
behaviour are pinned in ``test_sandbox_isolation.py``.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import msgspec
import pytest

from leafe.envs.sandbox.launch import SandboxConfig, open_python, run_python

FAST = SandboxConfig(
    wall_timeout_s=2.0, cpu_time_s=1, memory_mb=256, max_processes=3, max_output_kb=64
)
PATIENT = msgspec.structs.replace(FAST, wall_timeout_s=10.0, cpu_time_s=5)
"""For runs that must end by a limit other than time, even on a loaded machine."""


def sandbox_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "leafe-sandbox-*")))


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(int(pid))
    return found


def wait_gone(marker: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_normal_code_runs_and_its_output_comes_back() -> None:
    """Exit 0 with stdout is ``ok``; an exception is ``error`` with the traceback on stderr."""
    ok = run_python("print('hello', 6 * 7)", FAST)
    assert ok.status == "ok" and ok.stdout == "hello 42\n" and ok.returncode == 0
    bad = run_python("raise ValueError('boom')", FAST)
    assert bad.status == "error" and "ValueError: boom" in bad.stderr


def test_infinite_loop_is_killed() -> None:
    """A busy loop ends as ``timeout`` (CPU or wall limit), not a hang."""
    r = run_python("while True:\n    pass\n", FAST)
    assert r.status == "timeout"


def test_sleeping_code_is_killed_at_the_wall_limit() -> None:
    """Code that blocks without using CPU is stopped by the wall-clock limit."""
    r = run_python("import time\ntime.sleep(600)\n", SandboxConfig(wall_timeout_s=1.0))
    assert r.status == "timeout" and r.returncode is None


@pytest.mark.parametrize("isolation", ["namespaces", "none"])
def test_fork_bomb_is_contained_and_killed(isolation: str) -> None:
    """A fork bomb hits the process limit, is killed with its whole tree, and leaves no process.

    With isolation "none" (development only) the guard is RLIMIT_NPROC under a fresh uid plus the
    uid sweep, which needs root; as a plain user RLIMIT_NPROC applies directly.
    """
    if isolation == "none" and os.geteuid() != 0:
        pytest.skip("the no-namespace guard under test here is the root-only fresh uid")
    marker = f"leafe-fork-bomb-7c1e-{isolation}"
    bomb = f"""import os, sys
said_forked = said_limit = False
while True:
    try:
        if os.fork() == 0:
            os.execv('/bin/sleep', ['/bin/sleep', '1000', {marker!r}])
        if not said_forked:
            said_forked = True
            print('forked', flush=True)
    except OSError:
        if not said_limit:
            said_limit = True
            print('limit', flush=True)
"""
    r = run_python(bomb, msgspec.structs.replace(FAST, isolation=isolation))
    assert r.status in ("timeout", "killed")
    assert "forked" in r.stdout and "limit" in r.stdout  # it did fork, and hit the process limit
    assert wait_gone(marker) == []


def test_detached_child_does_not_outlive_the_run() -> None:
    """A child that starts its own session (escaping the process group) is still killed."""
    marker = "leafe-daemon-51ab"
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['/bin/sleep', '1000', {marker!r}])\n"
        "print('parent done')\n"
    )
    r = run_python(code, FAST)
    assert r.status == "ok" and r.stdout == "parent done\n"
    assert wait_gone(marker) == []


def test_memory_hog_is_stopped() -> None:
    """Allocating without bound ends as ``memory`` (RLIMIT_AS makes the allocation fail)."""
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n", PATIENT)
    assert r.status == "memory"
    assert run_python("x = bytearray(10**10)", PATIENT).status == "memory"


def test_output_flood_is_capped() -> None:
    """Printing without end stops at the output limit and the captured text is bounded."""
    r = run_python("while True:\n    print('x' * 1000)\n", PATIENT)
    assert r.status == "output_limit"
    assert len(r.stdout) <= FAST.max_output_kb * 1024


def test_no_network() -> None:
    """In its network namespace, connecting anywhere (the internet, a local port) fails."""
    code = (
        "import socket\nfor addr in (('1.1.1.1', 53), ('127.0.0.1', 4222)):\n    try:\n"
        "        socket.create_connection(addr, timeout=2)\n        print('connected')\n"
        "    except OSError as e:\n        print('blocked', e.errno)\n"
    )
    r = run_python(code, FAST)
    assert r.status == "ok" and r.stdout.count("blocked") == 2 and "connected" not in r.stdout
    assert "netns" in r.isolation


@pytest.mark.parametrize("isolation", ["namespaces", "none"])
def test_code_runs_unprivileged_in_its_own_temp_dir_which_is_removed(isolation: str) -> None:
    """As root the code gets a fresh uid; its cwd is a temp dir that is gone afterwards, as are all
    dirs."""
    before = sandbox_dirs()
    config = msgspec.structs.replace(FAST, isolation=isolation)
    r = run_python(
        "import os\nprint(os.getuid())\nprint(os.getcwd())\nopen('f.txt', "
        "'w').write('x')\nos.chmod('.', 0)\n",
        config,
    )
    uid, cwd = r.stdout.split()
    if os.geteuid() == 0:
        assert int(uid) >= 200_000 and "uid" in r.isolation
    if isolation == "none":
        assert not os.path.exists(cwd)  # a host dir; with namespaces it is the run's own tmpfs /tmp
    assert sandbox_dirs() == before


def test_stdin_is_delivered() -> None:
    """Bytes given as stdin are readable by the code."""
    r = run_python("import sys\nprint(sys.stdin.read().upper())", FAST, stdin=b"abc")
    assert r.stdout == "ABC\n"


def test_without_namespaces_the_uid_sweep_still_kills_detached_children() -> None:
    """With namespaces off (as on machines that forbid them), a fresh uid still lets us find and
    kill all."""
    if os.geteuid() != 0:
        pytest.skip("the uid sweep is the root-only layer")
    marker = "leafe-daemon-nons-93d2"
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['/bin/sleep', '1000', {marker!r}])\n"
        "print('parent done')\n"
    )
    config = SandboxConfig(wall_timeout_s=2.0, isolation="none")
    r = run_python(code, config)
    assert r.status == "ok" and "netns" not in r.isolation and "uid" in r.isolation
    assert wait_gone(marker) == []


def test_a_conversation_over_pipes() -> None:
    """An interactive run answers line by line; silence times out, a line over the limit is refused,
    and a run that exits gives EOF."""
    echo = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n"
    with open_python(echo, FAST) as proc:
        for word in (b"abc", b"def"):
            assert proc.send(word + b"\n")
            assert proc.read_line(2.0, 100) == word.upper()
        with pytest.raises(TimeoutError):
            proc.read_line(0.2, 100)
        proc.close_stdin()
        with pytest.raises(EOFError):
            proc.read_line(2.0, 1000)
        proc.wait(2.0)
        assert proc.finish().status == "ok"
    with open_python(echo, FAST) as proc:
        assert proc.send(b"x" * 300 + b"\n")
        with pytest.raises(ValueError, match="longer than 100 bytes"):
            proc.read_line(2.0, 100)


def test_sandbox_dirs_are_removed_after_an_interactive_run() -> None:
    """The context manager kills a run that is still going and removes its directory."""
    before = sandbox_dirs()
    with open_python("import time\ntime.sleep(600)\n", FAST) as proc:
        pass
    assert proc.finish().status == "killed" and proc.finish().returncode is None
    assert sandbox_dirs() == before
