"""What sandboxed code can see and reach, and that a sandbox without its isolation refuses to run.

The code must find no secret of its parent (environment, /proc), signal nothing outside, write only
in its own bounded tmpfs, and stay within the per-run memory budget. Without user namespaces (a
Kubernetes pod under RuntimeDefault seccomp), building a HumanEval env must fail with a clear error;
the explicit opt-out works and warns every time an env is built with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import structlog

from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.sandbox import launch as sandbox
from leafe.envs.sandbox.launch import SandboxConfig, SandboxUnavailable, probe, run_python

SECRET = "nats://leafe:hunter2-7f3a@nats.internal:4222"
FAST = SandboxConfig(wall_timeout_s=5.0, cpu_time_s=3, memory_mb=128, max_processes=3, disk_mb=8)


@pytest.fixture
def without_namespaces(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An ``unshare`` that fails the way it does in a pod (no user namespaces); the probe sees
    it."""
    fake = tmp_path / "unshare"
    fake.write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    if os.geteuid() != 0:
        pytest.skip("the sandbox runs only a root-owned unshare; the stand-in must be root's")
    monkeypatch.setattr(sandbox, "UNSHARE_PATHS", (str(fake),))
    probe.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    probe.cache_clear()


def test_the_default_config_fits_its_memory_budget_and_a_bigger_one_is_refused() -> None:
    """processes x memory + disk must fit the per-run budget; the old 16 x 512 MiB is refused by
    name."""
    c = SandboxConfig()
    assert c.max_processes * c.memory_mb + c.disk_mb <= c.memory_budget_mb <= 1024
    with pytest.raises(
        ValueError, match=r"16 \* 512 \+ 64 = 8256 MiB exceeds memory_budget_mb = 1024"
    ):
        SandboxConfig(max_processes=16, memory_mb=512)


def test_without_user_namespaces_building_the_env_refuses(without_namespaces: Path) -> None:
    """The probe sees unshare fail: the env refuses at construction, naming the cause and the way
    out."""
    assert not probe().namespaces and "Operation not permitted" in probe().reason
    with pytest.raises(SandboxUnavailable) as raised:
        HumanEvalEnv()
    message = str(raised.value)
    assert "Operation not permitted" in message and "user namespaces" in message
    assert "isolation = 'none'" in message
    with pytest.raises(SandboxUnavailable):
        run_python("print('must not run')", FAST)


def test_without_unshare_at_all_running_code_refuses(without_namespaces: Path) -> None:
    """No unshare at all is the same refusal, not a silent downgrade."""
    (without_namespaces / "unshare").unlink()
    probe.cache_clear()
    with pytest.raises(SandboxUnavailable, match="unshare` is missing"):
        run_python("print('must not run')", FAST)


def test_the_explicit_opt_out_runs_and_warns_on_every_env(without_namespaces: Path) -> None:
    """isolation = 'none' runs the code (development) and logs a warning each time an env is
    built."""
    config = HumanEvalConfig(num_test=164, sandbox=SandboxConfig(isolation="none"))
    with structlog.testing.capture_logs() as logs:
        env = HumanEvalEnv(config)
        HumanEvalEnv(config)
    warnings = [e for e in logs if e["event"] == "leafe.envs.sandbox.launch.isolation_disabled"]
    assert len(warnings) == 2 and all(e["log_level"] == "warning" for e in warnings)
    env.reset("humaneval/test/53")
    assert env.step("def add(x, y):\n    return x + y\n").success
    assert env.last_run is not None and "netns" not in env.last_run.isolation


def test_the_parents_environment_and_processes_are_invisible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The code's environment is the minimal one; /proc shows only the run (init and the code), so
    neither our environment nor the start-up environment of a process beside us can be read."""
    monkeypatch.setenv("LEAFE_NATS_URL", SECRET)
    bystander = subprocess.Popen(["sleep", "60"], env={"LEAFE_NATS_URL": SECRET})
    code = f"""import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
found = []
for pid in pids + [os.getppid(), {bystander.pid}, {os.getpid()}]:
    try:
        found.append(open(f'/proc/{{pid}}/environ', 'rb').read().decode(errors='replace'))
    except OSError as e:
        found.append(type(e).__name__)
print(pids, sorted(os.environ), found)
"""
    try:
        r = run_python(code, FAST)
    finally:
        bystander.kill()
        bystander.wait()
    assert r.status == "ok" and "hunter2" not in r.stdout + r.stderr
    assert r.stdout.startswith("[1, 2] ")
    assert "['LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONHASHSEED']" in r.stdout


def test_the_code_cannot_signal_anything_outside() -> None:
    """Signals to its parent (the init), to pid 1 and to a real process of ours by number reach
    nothing."""
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        code = f"""import os, signal
for pid in (os.getppid(), 1, {bystander.pid}, {os.getpid()}):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
            print('sent', pid)
        except OSError as e:
            print(type(e).__name__, pid)
"""
        r = run_python(code, FAST)
        assert r.status == "ok"
        assert bystander.poll() is None  # alive, as are we
    finally:
        bystander.kill()
        bystander.wait()


def test_the_code_writes_only_in_its_own_bounded_tmpfs() -> None:
    """Everything but /tmp is read-only or absent; /tmp is the run's own tmpfs (a host file at the
    same path stays untouched) and fills up at disk_mb."""
    sentinel = Path(tempfile.gettempdir()) / f"leafe-sentinel-{os.getpid()}"
    sentinel.write_text("actor data")
    sentinel.chmod(0o666)
    code = f"""import os
for path in ({str(sentinel)!r}, '/usr/x', '/etc/x', '/x', '/proc/x', '/dev/x', '/dev/shm/x', \
'/var/tmp/x'):
    try:
        open(path, 'w').write('pwned')
        print('wrote', path)
    except OSError as e:
        print('refused', path, e.errno)
total = 0
try:
    for i in range(100000):
        with open(f'/tmp/f{{i}}', 'wb') as f:
            f.write(b'x' * 60000)
        total += 60000
except OSError as e:
    print('full', e.errno)
print('total', total)
"""
    try:
        r = run_python(code, FAST)
        assert r.status == "ok"
        assert (
            sentinel.read_text() == "actor data"
        )  # its /tmp is its own tmpfs: the host's is not there
        assert [line for line in r.stdout.splitlines() if line.startswith("wrote")] == [
            f"wrote {sentinel}"
        ]
        total = int(r.stdout.split("total ")[1])
        assert (
            "full 28" in r.stdout and total <= FAST.disk_mb * 1024 * 1024
        )  # ENOSPC at the tmpfs size
    finally:
        sentinel.unlink()


def test_memory_is_bounded_per_run_not_per_process() -> None:
    """Children that each allocate until MemoryError together stay within processes x memory_mb."""
    config = msgspec.structs.replace(
        FAST, memory_mb=96, max_processes=3, disk_mb=8, memory_budget_mb=300
    )
    code = """import os
r, w = os.pipe()
def hog():
    chunks = []
    try:
        while True:
            chunks.append(bytearray(8 << 20))
    except MemoryError:
        pass
    os.write(w, f'{len(chunks) * 8}\\n'.encode())
for _ in range(20):
    try:
        if os.fork() == 0:
            hog()
            os._exit(0)
    except OSError:
        break
hog()
os.close(w)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
print(sum(int(x) for x in os.read(r, 10000).split()))
"""
    r = run_python(code, config)
    assert r.status == "ok", r.stderr
    assert 0 < int(r.stdout) <= config.max_processes * config.memory_mb <= config.memory_budget_mb


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become nobody"
)
def test_as_a_non_root_user_the_code_gets_a_user_namespace_and_no_capability() -> None:
    """The pod's path (not root): user + mount + PID + network namespaces, no capability, same
    view."""
    python = shutil.which("python3", path="/usr/bin")
    if python is None or "msgspec" not in sys.modules:
        pytest.skip("needs /usr/bin/python3")
    site = str(Path(msgspec.__file__).resolve().parents[1])
    # The venv's site directory through site.addsitedir, so that its path files (the editable
    # install's finder of the leafe namespace) take effect as they do in the venv.
    script = (
        f"import site; site.addsitedir({site!r})\n"
        + """import json
from leafe.envs.sandbox.launch import probe, run_python
code = "import os\\nprint(os.getpid(), \
open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
r = run_python(code)
print(json.dumps([probe().namespaces, probe().root, r.status, r.stdout, r.isolation]))
"""
    )
    env = {"PATH": "/usr/bin:/bin", "LEAFE_NATS_URL": SECRET}
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", python, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if out.returncode != 0 and "ModuleNotFoundError" in out.stderr:
        pytest.skip(f"the system python cannot import the venv's packages: {out.stderr[-200:]}")
    namespaces, root, status, stdout, isolation = json.loads(out.stdout.strip().splitlines()[-1])
    assert namespaces and not root and status == "ok"
    assert stdout.split() == ["2", "0000000000000000"]
    assert isolation.startswith("userns+mountns+pidns+netns")
