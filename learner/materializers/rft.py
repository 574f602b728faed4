"""Rejection-sampling SFT baseline (RFT): every step of a successful plain rollout becomes a sample.

On the ``Outcome`` of a successful branch of an eligible episode (``rollout`` mode by default), each
step of the branch's path is an ``rft`` sample ``(q + h_t, a_t)`` with ``reward`` 1.0 (the
successful trajectory's return). Prompts are rebuilt without experience (plain rollouts have none).
Unparsable completions are skipped by default.
"""

from __future__ import annotations

import msgspec

from leafe.learner.materializers.base import CommonOptions, Materializer, path_entries
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.samples import Sample

__all__ = ["RftMaterializer", "RftOptions"]


class RftOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``rft`` materializer."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["rollout"])
    """Episode modes whose successful trajectories are kept."""
    weight: float = 1.0
    """Loss weight of every sample."""


class RftMaterializer(Materializer):
    """Successful trajectories, step by step."""

    name = "rft"
    version = 1
    Options = RftOptions
    options: RftOptions

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        outcome = node.outcome
        assert outcome is not None
        if not outcome.success:
            return []
        path = tree.path(node.branch_id)
        entries = path_entries(path)
        ids = [tree.started.event_id, *(s.event_id for s in path)]
        out: list[Sample] = []
        for t in range(len(path)):
            sample = self.build_sample(
                tree,
                kind="rft",
                path=path,
                t=t,
                entries=entries,
                source_event_ids=ids[: t + 2],
                weight=self.options.weight,
                reward=1.0,
            )
            if sample is not None:
                out.append(sample)
        return out
