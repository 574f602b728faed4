"""The paper table's training children never outlive it (``experiments/paper/children.py``): a
cancelled phase stops its child, a SIGKILLed runner takes its child with it
(``leafe.services.lifetime``), and SIGTERM stops the runner and its child as Ctrl-C does
(``experiments.paper.runner.stop_on_sigterm``). Before, a SIGTERMed ``paper_table.py`` left ``leafe
train`` running for up to an hour on the cores of whatever came next."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.paper.children import REPO, run_logged

CHILD = ["sh", "-c", "echo $$; exec sleep 600"]
"""A child that writes its pid into its log, then sleeps under that pid."""

_RUNNER = """
import asyncio, sys
from experiments.paper.children import run_logged
from experiments.paper.runner import stop_on_sigterm
async def main():
    stop_on_sigterm()
    await run_logged({child!r}, __import__("pathlib").Path({log!r}), {{"PATH": "/usr/bin:/bin"}})
try:
    asyncio.run(main())
except asyncio.CancelledError:
    sys.exit(143)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _pid_in(log: Path, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.is_file() else ""
        if text.strip():
            return int(text.split()[0])
        time.sleep(0.05)
    raise AssertionError(f"the child never wrote its pid to {log}")


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_a_cancelled_run_stops_its_child(tmp_path: Path) -> None:
    log = tmp_path / "child.log"

    async def main() -> None:
        task = asyncio.create_task(run_logged(CHILD, log, {"PATH": "/usr/bin:/bin"}))
        pid = await asyncio.to_thread(_pid_in, log)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _alive(pid), "the child runs on after its phase was cancelled"

    asyncio.run(main())


def test_the_exit_code_comes_back(tmp_path: Path) -> None:
    code = asyncio.run(
        run_logged(["sh", "-c", "echo out; exit 3"], tmp_path / "x.log", {"PATH": "/bin"})
    )
    assert code == 3 and (tmp_path / "x.log").read_text() == "out\n"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_runner_takes_its_child_with_it(
    tmp_path: Path, env: dict[str, str], sig: int
) -> None:
    log = tmp_path / "child.log"
    script = _RUNNER.format(child=CHILD, log=str(log))
    runner = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO)
    try:
        pid = _pid_in(log)
        runner.send_signal(sig)
        code = runner.wait(timeout=30)
        assert _gone(pid), f"the child {pid} outlived its runner (signal {sig})"
        if sig == signal.SIGTERM:
            assert code == 143, "SIGTERM did not stop the runner through its cancellation path"
    finally:
        runner.kill()
        if log.is_file() and log.read_text().strip():
            pid = int(log.read_text().split()[0])
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_stop_minutes_stops_the_runner_and_lets_its_child_checkpoint(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """``--stop-minutes`` (``stop_on_sigterm(after_s)``) ends the runner as SIGTERM does, and its
    child gets SIGTERM and its grace: a ``leafe train`` child checkpoints the step it is in and
    exits 75."""
    log = tmp_path / "child.log"
    child = [
        "sh",
        "-c",
        "echo $$; trap 'kill $!; echo checkpointed; exit 75' TERM; sleep 600 & wait",
    ]
    script = _RUNNER.format(child=child, log=str(log)).replace(
        "stop_on_sigterm()", "stop_on_sigterm(1.0)"
    )
    runner = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO)
    try:
        pid = _pid_in(log)
        assert runner.wait(timeout=30) == 143
        assert _gone(pid) and log.read_text().split()[1:] == ["checkpointed"], log.read_text()
    finally:
        runner.kill()
