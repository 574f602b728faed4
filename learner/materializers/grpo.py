"""GRPO baseline dataset: groups of n plain rollouts of one task, with group-normalised advantages.

Rollout episodes carry ``EpisodeStarted.group_id`` and ``group_size``. When every member of a group
has finished, each trajectory's return r_i (``reward``: ``success`` 1/0 by default, ``score``,
``success_plus_score`` or ``sum`` of step rewards) becomes the advantage ``(r_i - mean) / (std +
eps)`` (population std over the group) and every step of the trajectory becomes one ``grpo`` sample
carrying that advantage, the return, the behaviour logprobs and the group id. The prompt is the
exact behaviour prompt (experience kept if it was there), since the policy gradient is taken w.r.t.
what was sampled. Groups whose returns have zero variance carry no signal and produce nothing
(counted).

Members are keyed by ``task_key``: when a task was redelivered and two attempts finish, the one with
the smaller episode id is used. A member's events stay needed (its anchor unreleased) until the
group is emitted or dropped; a group with no activity for the stale timeout is dropped. A rollout
that cannot join its group (the group was already emitted, or it declares another ``group_size``, as
when a task batch was resubmitted with another n under the same run) gives no samples and is counted
(``group_outsiders``) and logged with the reason: use a new run id for a new group size.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
import structlog

from leafe.learner.materializers.base import CommonOptions, Materializer, path_entries
from leafe.learner.materializers.tree import EpisodeTree
from leafe.protocol.events import ROOT_BRANCH, EpisodeEvent, Step
from leafe.protocol.samples import Sample

__all__ = ["GrpoMaterializer", "GrpoOptions"]

log = structlog.get_logger(__name__)


class GrpoOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``grpo`` materializer."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["rollout"])
    """Episode modes that form groups (plain rollouts)."""
    skip_unparsed_targets: bool = False
    """Unparsable completions keep their (usually negative) advantage: that is how format is
    learnt."""
    reward: Literal["success", "score", "success_plus_score", "sum"] = "success"
    """Trajectory return: Outcome success 1/0, Outcome score, both added, or the sum of step
    rewards."""
    eps: float = 1e-6
    """Added to the group's std in the advantage's denominator."""
    min_std: float = 1e-8
    """Groups whose return std is below this produce no samples."""


@dataclass
class _Trajectory:
    tree: EpisodeTree
    path: list[Step]
    ret: float
    outcome_id: str


@dataclass
class _Group:
    size: int
    last_active: float
    members: dict[str, _Trajectory] = field(default_factory=dict)
    episodes: set[str] = field(default_factory=set)
    open: set[str] = field(default_factory=set)


class GrpoMaterializer(Materializer):
    """Group-normalised advantages over plain rollouts."""

    name = "grpo"
    version = 1
    Options = GrpoOptions
    options: GrpoOptions

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._groups: dict[tuple[str, str], _Group] = {}
        self._emitted_groups: OrderedDict[tuple[str, str], int] = OrderedDict()
        """Recently emitted (or dropped) groups -> their size."""
        self._clock = 0.0

    def _group_key(self, tree: EpisodeTree) -> tuple[str, str] | None:
        s = tree.started
        if s.group_id is None or not self.eligible(tree):
            return None
        return (s.run_id, s.group_id)

    def _on_started(self, tree: EpisodeTree) -> list[Sample]:
        key = self._group_key(tree)
        if key is None:
            return []
        size = max(1, tree.started.group_size)
        group = self._groups.get(key)
        if key in self._emitted_groups or (group is not None and group.size != size):
            why = (
                "its group was already emitted"
                if group is None
                else f"group_size {size} != the group's {group.size}"
            )
            self.stats.group_outsiders += 1
            log.warning(
                "replay.grpo.group_outsider",
                episode_id=tree.started.episode_id,
                group_id=key[1],
                reason=why,
            )
            return []
        group = self._groups.setdefault(key, _Group(size=size, last_active=0.0))
        group.last_active = max(group.last_active, tree.last_active)
        group.episodes.add(tree.started.episode_id)
        group.open.add(tree.started.episode_id)
        return []

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        key = self._group_key(tree)
        group = self._groups.get(key) if key is not None else None
        if key is None or group is None or tree.started.episode_id not in group.episodes:
            return []
        group.last_active = max(group.last_active, tree.last_active)
        root = tree.branches[ROOT_BRANCH]
        traj = _Trajectory(
            tree,
            tree.path(ROOT_BRANCH),
            self._return(tree),
            root.outcome.event_id if root.outcome else "",
        )
        task_key = tree.started.task_key
        held = group.members.get(task_key)
        if held is not None:
            self.stats.late_attempts += 1
            if held.tree.started.episode_id < tree.started.episode_id:
                return []
        group.members[task_key] = traj
        if len(group.members) < group.size:
            return []
        return self._emit(key, group)

    def _on_closed(self, tree: EpisodeTree, abandoned: bool) -> list[Sample]:
        eid = tree.started.episode_id
        key = self._group_key(tree)
        group = self._groups.get(key) if key is not None else None
        if group is None or eid not in group.episodes:
            self._release(eid)
        else:
            group.open.discard(eid)
            # An abandoned member's task is redelivered: give the retry a full timeout to finish.
            group.last_active = max(group.last_active, self._clock, tree.last_active)
        return []

    def _return(self, tree: EpisodeTree) -> float:
        outcome = tree.branches[ROOT_BRANCH].outcome
        success = (
            outcome.success
            if outcome is not None
            else bool(tree.finished and tree.finished.success)
        )
        score = outcome.score if outcome is not None else 0.0
        match self.options.reward:
            case "success":
                return float(success)
            case "score":
                return float(score)
            case "success_plus_score":
                return float(success) + float(score)
            case "sum":
                return float(sum(s.reward for s in tree.path(ROOT_BRANCH)))

    def _emit(self, key: tuple[str, str], group: _Group) -> list[Sample]:
        self._finish_group(key, group)
        members = sorted(group.members.values(), key=lambda m: m.tree.started.episode_id)
        returns = np.array([m.ret for m in members], dtype=np.float64)
        std = float(returns.std())
        if std < self.options.min_std:
            self.stats.groups_zero_variance += 1
            return []
        self.stats.groups_emitted += 1
        advantages = (returns - returns.mean()) / (std + self.options.eps)
        group_sources = sorted(m.outcome_id or m.tree.started.event_id for m in members)
        out: list[Sample] = []
        for member, adv in zip(members, advantages, strict=True):
            out += self._trajectory_samples(member, float(adv), group_sources, key[1])
        return out

    def _trajectory_samples(
        self, member: _Trajectory, advantage: float, group_sources: list[str], group_id: str
    ) -> list[Sample]:
        tree, path = member.tree, member.path
        entries = path_entries(path)
        ids = [tree.started.event_id, *(s.event_id for s in path)]
        out: list[Sample] = []
        for t, step in enumerate(path):
            sample = self.build_sample(
                tree,
                kind="grpo",
                path=path,
                t=t,
                entries=entries,
                source_event_ids=[*ids[: t + 2], *group_sources],
                keep_experience=True,
                advantage=advantage,
                reward=member.ret,
                behaviour_logprobs=list(step.logprobs) if step.logprobs is not None else None,
                group_id=group_id,
            )
            if sample is not None:
                out.append(sample)
        return out

    def _finish_group(self, key: tuple[str, str], group: _Group) -> None:
        del self._groups[key]
        self._emitted_groups[key] = group.size
        while len(self._emitted_groups) > self.options.closed_memory:
            self._emitted_groups.popitem(last=False)
        for eid in sorted(group.episodes - group.open):
            self._release(eid)
        # Members still open are released by their own close (they are no longer in a pending
        # group).
        for eid in group.open:
            group.episodes.discard(eid)

    def apply(self, event: EpisodeEvent, *, now: float = 0.0) -> list[Sample]:
        """Fold one event (see :meth:`Materializer.apply`); also advances the group clock."""
        self._clock = max(self._clock, now)
        return super().apply(event, now=now)

    def close_stale(self, now: float, timeout: float) -> list[Sample]:
        """Close idle episodes, then drop groups idle for ``timeout`` with no member still open."""
        self._clock = max(self._clock, now)
        return super().close_stale(now, timeout)

    def _close_stale_extra(self, now: float, timeout: float) -> list[Sample]:
        for key in sorted(self._groups):
            group = self._groups[key]
            if not group.open and now - group.last_active > timeout:
                self._drop(key, group)
        return []

    def _close_all_extra(self) -> list[Sample]:
        for key in sorted(self._groups):
            self._drop(key, self._groups[key])
        return []

    def _drop(self, key: tuple[str, str], group: _Group) -> None:
        self.stats.groups_dropped += 1
        self._finish_group(key, group)
