"""The state of one exploration tree while ``actors/explorer.py`` grows it: a branch's path with its
env snapshots, the queue of rollback requests its reflections made, and the episode's counters.
Plain data, no I/O."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from leafe.protocol.prompt import HistoryEntry

__all__ = ["PathStep", "TreeBranch", "TreeCounters", "TreeRequest"]


@dataclass(slots=True, frozen=True)
class PathStep:
    """One step on a branch's path, as the agent's history shows it plus its outcome."""

    entry: HistoryEntry
    score: float
    done: bool
    success: bool


@dataclass(slots=True)
class TreeBranch:
    """A branch being explored: its place in the tree and the path it has walked."""

    branch_id: str
    depth: int
    tau: int
    experience: str | None
    path: list[PathStep]
    snapshots: list[Any]
    """``snapshots[t]``: env state after t actions of ``path`` (empty when snapshots are
    unsupported)."""


@dataclass(slots=True, frozen=True)
class TreeRequest:
    """A rollback the tree still owes: branch from ``parent`` at ``tau`` with ``experience``."""

    parent: TreeBranch
    tau: int
    experience: str
    reflection_event_id: str


@dataclass(slots=True)
class TreeCounters:
    """What the episode has spent and found so far, and its queue of requests (breadth-first)."""

    actions: int = 0
    reflections: int = 0
    replay_steps: int = 0
    parse_failures: int = 0
    branches: int = 0
    calls: int = 0
    diverged: int = 0
    success: bool = False
    corrections: int = 0
    """Rolled-back branches that succeeded (counterfactual instances)."""
    duplicates: int = 0
    """Reflections not queued: their (parent, tau, e) was already requested."""
    stopped: bool = False
    error: str = ""
    queue: deque[TreeRequest] = field(default_factory=deque)
    requested: set[tuple[str, int, str]] = field(default_factory=set)
    """(parent branch, tau, e) of every request queued, so no two branches repeat one."""
