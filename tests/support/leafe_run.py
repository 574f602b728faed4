"""``leafe run`` as a user runs it, in a child process: the command line and its environment (the
tests of the supervisor: ``tests/integration/test_run_e2e.py``, ``test_run_supervisor_kill.py``),
and a :class:`Throttle` that makes one of its services run as on a slower machine."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

__all__ = ["Throttle", "leafe_run_argv", "leafe_run_env"]


def leafe_run_argv(runs: Path, *args: str, preset: str = "tiny") -> list[str]:
    """``leafe run --preset PRESET --runs-dir RUNS ARGS...`` through this interpreter."""
    return [
        sys.executable,
        "-m",
        "leafe.services.cli",
        "run",
        "--preset",
        preset,
        "--runs-dir",
        str(runs),
        *args,
    ]


def leafe_run_env(cache_dir: Path) -> dict[str, str]:
    """This environment with the tests' model cache, and without a NATS URL (the run embeds its
    own)."""
    env = {**os.environ, "LEAFE_CACHE": str(cache_dir)}
    env.pop("LEAFE_NATS_URL", None)
    return env


class Throttle:
    """While in its ``with`` block, stop the process recorded in ``pid_file`` (``<run
    dir>/pids/<name>.pid``, written by the supervisor) for ``stop_s`` of every ``stop_s + run_s``
    seconds: that service runs as on a machine ``(stop_s + run_s) / run_s`` times slower, its
    start-up included. ``stopped_s`` says how long it was held stopped in all (a throttle that never
    caught the process would make a test vacuous)."""

    def __init__(
        self, pid_file: Path, *, enabled: bool = True, stop_s: float = 3.0, run_s: float = 1.0
    ):
        self.pid_file, self.enabled, self.stop_s, self.run_s = pid_file, enabled, stop_s, run_s
        self.stopped_s = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)

    def __enter__(self) -> Throttle:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._done.set()
        if self.enabled:
            self._thread.join()

    def _pid(self) -> int | None:
        """The recorded pid while that very process lives (its start time matches the record: a pid
        reused by another process after the service exited is never stopped)."""
        try:
            pid, start = self.pid_file.read_text().split()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return None
        fields = stat.rsplit(")", 1)[1].split()
        return int(pid) if fields[0] not in "ZX" and fields[19] == start else None

    def _run(self) -> None:
        while not self._done.is_set():
            pid = self._pid()
            if pid is None:
                self._done.wait(0.1)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # between two lives of the service, or after the run
                self._done.wait(0.1)
                continue
            t0 = time.monotonic()
            try:
                self._done.wait(self.stop_s)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.stopped_s += time.monotonic() - t0
            self._done.wait(self.run_s)
