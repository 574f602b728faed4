"""``leafe run`` as a user runs it, in a child process: the command line and its environment (the tests of
the supervisor: ``tests/integration/test_run_e2e.py``, ``test_run_supervisor_kill.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["leafe_run_argv", "leafe_run_env"]


def leafe_run_argv(runs: Path, *args: str, preset: str = "tiny") -> list[str]:
    """``leafe run --preset PRESET --runs-dir RUNS ARGS...`` through this interpreter."""
    return [sys.executable, "-m", "services.cli", "run", "--preset", preset, "--runs-dir", str(runs), *args]


def leafe_run_env(cache_dir: Path) -> dict[str, str]:
    """This environment with the tests' model cache, and without a NATS URL (the run embeds its own)."""
    env = {**os.environ, "LEAFE_CACHE": str(cache_dir)}
    env.pop("LEAFE_NATS_URL", None)
    return env
