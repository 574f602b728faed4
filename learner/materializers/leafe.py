"""LEAFE Stage-2 datasets: counterfactual (D_cf) and rehearsal (D_reh) samples, as a fold over
events.

- **D_cf** (kind ``cf``): for each branch ``b`` that ends in success (``cf_only_successful``), the
  input is the task q plus the *parent's* history up to ``tau``, rendered **without** the experience
  e (test time has no e), and the target is ``b``'s first action ``a'_tau`` (the step with ``t ==
  tau`` on ``b``) with its exact token ids. This is the paper's core idea: the correction produced
  with e in context becomes the policy's reflex without it.
- **D_reh** (kind ``reh``): ``(q + h_t, a_t)`` for the steps of successful paths (inherited prefix
  plus the branch's own steps; prompts rebuilt without e). A seeded fraction is kept, decided by
  hashing ``(seed, key)`` so the choice does not depend on event order: with ``rehearsal_unit =
  "path"`` the key is the successful branch's Outcome and a kept path gives all its steps (the
  paper: "a random 20% of successful rollouts"); with ``"step"`` (the default, as earlier logs were
  replayed) each step is its own key. A step shared by two successful paths yields one sample.

Samples are emitted at the branch's ``Outcome`` (everything they need is in the log by then),
weighted ``cf_weight`` and ``rehearsal_weight`` (beta in L = L_cf + beta * L_reh).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from leafe.learner.materializers.base import (
    CommonOptions,
    Materializer,
    path_entries,
    selected_fraction,
)
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.samples import Sample

__all__ = ["LeafeMaterializer", "LeafeOptions"]


class LeafeOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``leafe`` materializer (defaults follow the paper where it says something)."""

    cf_only_successful: bool = True
    """Only branches whose Outcome is a success yield a counterfactual sample."""
    cf_drop_repeated_action: bool = False
    """Drop a counterfactual whose target action equals the parent's action at tau: the branch
    repeated the very move the reflection blamed, so the sample corrects nothing (its steps still
    count for rehearsal). Off by default, as in the paper, which keeps every successful branch."""
    rehearsal_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.2
    """Fraction of the successful paths (or of their steps, see ``rehearsal_unit``) kept for D_reh
    (paper: 20% of successful rollouts)."""
    rehearsal_unit: Literal["step", "path"] = "step"
    """What the fraction selects: whole successful paths (``path``, the paper) or single steps
    (``step``)."""
    rehearsal_seed: int = 0
    """Seed of the rehearsal selection."""
    cf_weight: float = 1.0
    """Loss weight of counterfactual samples."""
    rehearsal_weight: float = 1.0
    """Loss weight of rehearsal samples (beta; not published in the paper)."""


class LeafeMaterializer(Materializer):
    """Counterfactual + rehearsal samples from explore trees."""

    name = "leafe"
    version = 1
    Options = LeafeOptions
    options: LeafeOptions

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        assert node.outcome is not None
        success = node.outcome.success
        out: list[Sample] = []
        if node.parent_id is not None and (success or not self.options.cf_only_successful):
            cf = self._counterfactual(tree, node)
            if cf is not None:
                out.append(cf)
        if success and self.options.rehearsal_fraction > 0:
            out += self._rehearsal(tree, node)
        return out

    def _counterfactual(self, tree: EpisodeTree, node: BranchNode) -> Sample | None:
        if not node.steps:
            self.stats.skipped_no_target += 1
            return None
        path = tree.path(node.branch_id)
        tau = node.tau
        if self.options.cf_drop_repeated_action and node.parent_id is not None:
            parent_path = tree.path(node.parent_id)
            if tau < len(parent_path) and parent_path[tau].action == path[tau].action:
                self.stats.skipped_repeated_action += 1
                return None
        sources = [tree.started.event_id, *(s.event_id for s in path[: tau + 1])]
        sources += [x for x in (node.event_id, node.reflection_event_id) if x is not None]
        return self.build_sample(
            tree,
            kind="cf",
            path=path,
            t=tau,
            entries=path_entries(path[:tau]),
            source_event_ids=sources,
            weight=self.options.cf_weight,
        )

    def _rehearsal(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        opts = self.options
        path = tree.path(node.branch_id)
        if opts.rehearsal_unit == "path":
            assert node.outcome is not None
            keep = selected_fraction(
                opts.rehearsal_seed, node.outcome.event_id, opts.rehearsal_fraction
            )
            chosen = list(range(len(path))) if keep else []
        else:
            chosen = [
                t
                for t, s in enumerate(path)
                if selected_fraction(opts.rehearsal_seed, s.event_id, opts.rehearsal_fraction)
            ]
        if not chosen:
            return []
        entries = path_entries(path[: chosen[-1]])
        ids = [tree.started.event_id, *(s.event_id for s in path)]
        out: list[Sample] = []
        for t in chosen:
            sample = self.build_sample(
                tree,
                kind="reh",
                path=path,
                t=t,
                entries=entries,
                source_event_ids=ids[: t + 2],
                weight=opts.rehearsal_weight,
            )
            if sample is not None:
                out.append(sample)
        return out
