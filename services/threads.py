"""How many torch threads each process gets: the cores that are free, never ``nproc`` alone.

OpenMP threads that share a core spin against each other (measured here: a learner step with 2
threads while another process kept one of 2 cores busy took 100 s, with 1 thread 23 s), so every
process sizes its pool to the cores it can actually have. :func:`free_cores` counts the cores this
process may run on (``sched_getaffinity``) minus those other processes keep busy right now
(``/proc/stat`` sampled over a short window); :func:`plan_threads` splits them between the CPU
inference server and the learner of ``leafe run``: the engine gets every free core while the learner
is idle (the evaluations, a phased run's rounds), the learner gets every free core while the engines
idle (the warm start's demonstrations need no engine, a phased run trains between rounds), and the
two share them while both work (continuous rounds, draining).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ThreadPlan",
    "busy_cores",
    "default_threads",
    "free_cores",
    "plan_cores",
    "plan_threads",
    "usable_cores",
]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is
    unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_times(stat: Path) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``'s first line."""
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(window_s: float = 0.5, stat: Path = Path("/proc/stat")) -> float:
    """Cores kept busy by everything on the machine over ``window_s`` (0.0 where /proc/stat is
    missing).

    Call it while this process is idle: its own work counts as busy too."""
    try:
        b0, t0 = _cpu_times(stat)
        time.sleep(window_s)
        b1, t1 = _cpu_times(stat)
    except (OSError, ValueError, IndexError):
        return 0.0
    if t1 <= t0:
        return 0.0
    return (os.cpu_count() or 1) * (b1 - b0) / (t1 - t0)


def free_cores(window_s: float = 0.5) -> tuple[int, str]:
    """Cores not busy with other work (at least 1), and a sentence saying how that was decided."""
    usable = usable_cores()
    busy = busy_cores(window_s)
    taken = min(usable - 1, int(busy + 0.5))
    why = f"{usable} usable cores, {busy:.1f} busy with other processes"
    return usable - max(0, taken), why


def plan_cores(pinned: int = 0) -> tuple[int, str]:
    """The cores a run's thread plan divides, and why: ``pinned`` when > 0 (the same plan, hence the
    same arithmetic, whatever else runs), else the cores free right now."""
    if pinned > 0:
        return pinned, f"{pinned} cores as configured ({usable_cores()} usable)"
    return free_cores()


@dataclass(frozen=True)
class ThreadPlan:
    """Threads per process and stage for ``leafe run`` on ``cores`` free cores."""

    cores: int
    inference_alone: int
    """The CPU inference server while the learner is idle (evaluations before and after)."""
    inference_shared: int
    """The CPU inference server while the learner trains (exploring, draining, continual rounds)."""
    learner: int
    """The learner (``OMP_NUM_THREADS``) while it trains beside the engine."""
    learner_alone: int = 0
    """The learner while the engines idle (0: no learner)."""

    def describe(self) -> str:
        """One line for the console and the run's log."""
        alone = (
            f", learner {self.learner_alone} while the engines idle" if self.learner_alone else ""
        )
        return (
            f"threads on {self.cores} free cores: inference {self.inference_alone} while the "
            "learner is "
            f"idle, inference {self.inference_shared} + learner {self.learner} while both "
            f"work{alone}"
        )


def plan_threads(cores: int, *, learner: bool = True, learner_threads: int = 0) -> ThreadPlan:
    """Split ``cores`` between the engine and the learner so that the two never oversubscribe them
    (on one core both get 1: the only plan there is); whichever runs alone gets them all.
    ``learner_threads`` > 0 fixes the learner's count in both cases."""
    cores = max(1, cores)
    if not learner:
        return ThreadPlan(cores=cores, inference_alone=cores, inference_shared=cores, learner=0)
    share = learner_threads if learner_threads > 0 else max(1, cores // 2)
    share = min(share, max(1, cores - 1))
    alone = min(learner_threads, cores) if learner_threads > 0 else cores
    return ThreadPlan(
        cores=cores,
        inference_alone=cores,
        inference_shared=max(1, cores - share),
        learner=share,
        learner_alone=alone,
    )


def default_threads(requested: int = 0) -> tuple[int, str]:
    """Torch threads for a ``leafe train`` or ``leafe eval`` process, and why: ``requested`` when >
    0, else ``$OMP_NUM_THREADS`` when set, else the free cores divided among the ranks torchrun
    started on this node (``$LOCAL_WORLD_SIZE``), so that no two pools share a core."""
    if requested > 0:
        return requested, "as requested"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "from OMP_NUM_THREADS"
    cores, why = free_cores()
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    share = max(1, cores // ranks)
    return share, f"{why}" + (f", shared by {ranks} local ranks" if ranks > 1 else "")
