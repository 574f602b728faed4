"""Episode-tree state of the materializer fold: branches, their own steps, and validation.

An :class:`EpisodeTree` holds one open episode: its ``EpisodeStarted``, every branch (root ``b0``
plus one per ``Branch`` event) with the steps it took itself, the reflection ids seen and the event
ids already applied. Branch geometry (``leafe.protocol.events``): a branch ``b`` with parent ``p``
and rollback point ``tau`` shares ``p``'s path ``0..tau-1``; its own steps start at ``t = tau``.
:meth:`EpisodeTree.path` rebuilds the full path of any branch from that alone, walking up its
ancestors in a loop: the depth of a tree is input, so nothing here recurses on it (a chain of
thousands of Branch events is just long).

:meth:`EpisodeTree.add` validates an event before recording it and raises :class:`ReplayError` (a
Step for an unknown branch or out of order, a Branch before its Reflection, a second Outcome, an
episode past ``max_branches`` or ``max_events``...), leaving the tree unchanged.
:meth:`EpisodeTree.is_duplicate` tells a redelivery (same id, same content) from a conflict (same
id, other content: rejected). Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from leafe.protocol.events import (
    ROOT_BRANCH,
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
)
from leafe.protocol.prompt import HistoryEntry

__all__ = ["BranchNode", "EpisodeFailed", "EpisodeTree", "ReplayError", "history_entry"]


def _short(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


class ReplayError(ValueError):
    """An event the fold cannot apply (unknown episode/branch, out of order...); ``reason`` says why
    (text that may quote the input), ``code`` which kind of refusal it is (``rejected``,
    ``episode_failed`` or a cap's, ``leafe.learner.materializers.lifecycle.CAP_CODES``): what tools
    decide on."""

    def __init__(self, event: EpisodeEvent, reason: str, code: str = "rejected") -> None:
        kind = type(event).__name__
        eid, episode = _short(event.event_id), _short(event.episode_id)
        super().__init__(f"rejected {kind} {eid} of episode {episode}: {reason}")
        self.event = event
        self.reason = reason
        self.code = code


class EpisodeFailed(ReplayError):
    """Folding ``event`` raised an unexpected exception; its episode was dropped (the cause is
    chained)."""

    def __init__(self, event: EpisodeEvent, reason: str, code: str = "episode_failed") -> None:
        super().__init__(event, reason, code)


def history_entry(step: Step) -> HistoryEntry:
    """How a past step appears in later prompts."""
    return HistoryEntry(step.action, step.raw_text, step.observation, step.feedback)


@dataclass
class BranchNode:
    """One branch of an episode tree: where it forks and the steps it took itself."""

    branch_id: str
    parent_id: str | None
    tau: int
    experience: str
    event_id: str | None = None
    reflection_event_id: str | None = None
    steps: list[Step] = field(default_factory=list)
    outcome: Outcome | None = None

    @property
    def next_t(self) -> int:
        """Index the branch's next step must carry."""
        return self.tau + len(self.steps)


@dataclass
class EpisodeTree:
    """Validated state of one open episode."""

    started: EpisodeStarted
    last_active: float
    max_branches: int = 2048
    max_events: int = 32_768
    branches: dict[str, BranchNode] = field(default_factory=dict)
    reflections: set[str] = field(default_factory=set)
    seen: dict[str, EpisodeEvent] = field(default_factory=dict)
    """Every applied event by id (to tell a redelivery from a conflicting copy)."""
    emitted: set[str] = field(default_factory=set)
    verified: set[str] = field(default_factory=set)
    finished: EpisodeFinished | None = None

    @classmethod
    def start(
        cls,
        event: EpisodeStarted,
        now: float,
        *,
        max_branches: int = 2048,
        max_events: int = 32_768,
    ) -> EpisodeTree:
        """A tree with its root branch ``b0``."""
        tree = cls(started=event, last_active=now, max_branches=max_branches, max_events=max_events)
        tree.branches[ROOT_BRANCH] = BranchNode(ROOT_BRANCH, None, 0, "")
        tree.seen[event.event_id] = event
        return tree

    def path(self, branch_id: str) -> list[Step]:
        """Every step of the branch's full history: the inherited prefix, then its own steps."""
        lineage = [self.branches[branch_id]]
        while lineage[-1].parent_id is not None:
            lineage.append(self.branches[lineage[-1].parent_id])
        out: list[Step] = []
        for node in reversed(lineage):  # root first; each keeps its parent's path up to its tau
            del out[node.tau :]
            out.extend(node.steps)
        return out

    def is_duplicate(self, event: EpisodeEvent) -> bool:
        """``event``'s id was applied already with the same content; a different content raises."""
        first = self.seen.get(event.event_id)
        if first is None:
            return False
        # Compared as bytes when fields differ: a NaN (reward, logprob) is unequal to itself.
        if first != event and msgspec.msgpack.encode(first) != msgspec.msgpack.encode(event):
            raise ReplayError(
                event, "conflict: its event id was applied with other content (first copy wins)"
            )
        return True

    def observation(self, path: Sequence[Step], t: int) -> str:
        """o_t on ``path``: the initial observation, or the observation after step t-1."""
        return self.started.observation if t == 0 else path[t - 1].observation

    def add(self, event: EpisodeEvent) -> None:
        """Validate ``event`` against the tree and record it; raises :class:`ReplayError`."""
        if event.run_id != self.started.run_id:
            run, ours = _short(event.run_id), _short(self.started.run_id)
            raise ReplayError(event, f"run {run} is not the episode's {ours}")
        if len(self.seen) >= self.max_events:
            raise ReplayError(
                event, f"the episode already has {len(self.seen)} events (max_episode_events)"
            )
        match event:
            case Step():
                self._add_step(event)
            case Reflection():
                self._branch(event, event.branch_id)
                self.reflections.add(event.event_id)
            case Rollback():
                self._branch(event, event.from_branch)
            case Branch():
                self._add_branch(event)
            case Outcome():
                node = self._branch(event, event.branch_id)
                if node.outcome is not None:
                    ended = node.outcome.event_id
                    raise ReplayError(event, f"branch {node.branch_id!r} already ended ({ended})")
                node.outcome = event
            case EpisodeFinished():
                self.finished = event
            case EpisodeStarted():
                raise ReplayError(event, f"episode already started by {self.started.event_id!r}")
        self.seen[event.event_id] = event

    def _branch(self, event: EpisodeEvent, branch_id: str) -> BranchNode:
        node = self.branches.get(branch_id)
        if node is None:
            known = sorted(self.branches)
            shown = ", ".join(known[:8]) + (f" and {len(known) - 8} more" if len(known) > 8 else "")
            raise ReplayError(event, f"unknown branch {_short(branch_id)} (known: {shown})")
        return node

    def _add_step(self, step: Step) -> None:
        node = self._branch(step, step.branch_id)
        if node.outcome is not None:
            raise ReplayError(
                step, f"step after branch {node.branch_id!r} ended ({node.outcome.event_id})"
            )
        if step.t != node.next_t:
            want, got = node.next_t, step.t
            raise ReplayError(
                step, f"out of order: branch {node.branch_id!r} expects t={want}, got t={got}"
            )
        node.steps.append(step)

    def _add_branch(self, event: Branch) -> None:
        if event.branch_id in self.branches:
            raise ReplayError(event, f"branch {_short(event.branch_id)} already exists")
        if len(self.branches) >= self.max_branches:
            raise ReplayError(
                event, f"the episode already has {len(self.branches)} branches (max_branches)"
            )
        parent = self._branch(event, event.parent_branch_id)
        if event.reflection_event_id not in self.reflections:
            raise ReplayError(
                event, f"Branch before its Reflection {_short(event.reflection_event_id)}"
            )
        available = parent.next_t  # the length of the parent's path: its tau plus its own steps
        if not 0 <= event.tau <= available:
            where = _short(parent.branch_id)
            raise ReplayError(event, f"tau={event.tau} outside 0..{available} (parent {where})")
        self.branches[event.branch_id] = BranchNode(
            event.branch_id,
            parent.branch_id,
            event.tau,
            event.experience,
            event_id=event.event_id,
            reflection_event_id=event.reflection_event_id,
        )
