"""The thread plan of ``leafe run`` and the free-core count (services/threads.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leafe.services.threads import busy_cores, plan_threads


@given(cores=st.integers(1, 256), learner=st.booleans(), fixed=st.integers(0, 300))
def test_the_plan_never_oversubscribes(cores: int, learner: bool, fixed: int) -> None:
    """Processes that run at the same time never get more threads than there are free cores (beyond
    the one thread each that a single core forces), and whichever runs alone gets every core (or the
    fixed count)."""
    plan = plan_threads(cores, learner=learner, learner_threads=fixed)
    assert plan.inference_alone == cores
    assert plan.inference_shared >= 1
    if learner:
        assert plan.learner >= 1
        assert plan.inference_shared + plan.learner <= max(cores, 2)
        assert 1 <= plan.learner_alone <= cores
        assert plan.learner_alone == (min(fixed, cores) if fixed else cores)
    else:
        assert plan.learner == plan.learner_alone == 0


def test_two_cores_split_one_and_one() -> None:
    """This machine's shape: two cores while evaluating, one each while both work, and two for the
    learner while the engines idle (the warm start: 1 thread while the other core idled, before)."""
    plan = plan_threads(2)
    assert (plan.inference_alone, plan.inference_shared, plan.learner) == (2, 1, 1)
    assert plan.learner_alone == 2
    assert "learner 2 while the engines idle" in plan.describe()


def test_busy_cores_reads_the_share_of_busy_jiffies(tmp_path: Path, monkeypatch: object) -> None:
    """Busy cores are (busy jiffies / all jiffies) x CPUs over the window; a missing /proc/stat is
    0."""
    import os

    stat = tmp_path / "stat"
    lines = iter(["cpu 100 0 0 100 0 0 0 0\n", "cpu 150 0 0 150 0 0 0 0\n"])

    class _Stat:
        def read_text(self) -> str:
            return next(lines)

    busy = busy_cores(0.0, stat=_Stat())  # type: ignore[arg-type]
    assert abs(busy - 0.5 * (os.cpu_count() or 1)) < 1e-9
    assert busy_cores(0.0, stat=stat) == 0.0


def test_default_threads_take_the_request_then_omp_then_the_free_cores_per_local_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``leafe train``/``leafe eval``: an explicit count wins, then $OMP_NUM_THREADS, then the free
    cores split among torchrun's local ranks (never fewer than 1), each with the reason it was
    chosen."""
    from leafe.services import threads

    monkeypatch.setattr(threads, "free_cores", lambda window_s=0.5: (4, "4 usable cores, 0.0 busy"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads(2) == (2, "as requested")
    assert threads.default_threads(0) == (3, "from OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.default_threads(0)[0] == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    n, why = threads.default_threads(0)
    assert n == 2 and "2 local ranks" in why
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads.default_threads(0)[0] == 1


def test_a_pinned_plan_ignores_what_else_keeps_the_cores_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``services.cores`` pins the cores the run's plan divides: a busy neighbour changes the time,
    not the plan (the learner's arithmetic depends on its thread count; a run compared with another
    must not split its cores differently because something else ran at its start)."""
    from leafe.services import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda window_s=0.5: 1.8)
    assert threads.plan_cores(0)[0] == 1
    cores, why = threads.plan_cores(2)
    assert cores == 2 and "as configured" in why
    assert threads.plan_threads(cores) == threads.plan_threads(2)
