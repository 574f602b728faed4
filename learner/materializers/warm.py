"""The whole method in one log: a warm start from demonstrations, then LEAFE (or GRPO) on the same
run.

``leafe run --preset leafe`` submits the expert's demonstrations of train tasks first, then explore
rounds; one replayer folds both. These materializers are
:class:`~leafe.learner.materializers.leafe.LeafeMaterializer` and
:class:`~leafe.learner.materializers.grpo.GrpoMaterializer` that also read mode ``demo``: every
expert step of a successful demonstration is an ``sft`` sample (exactly what the ``sft``
materializer emits, see ``leafe.learner.materializers.sft``), every other episode is folded as the
base materializer folds it. Test-split demonstrations are refused by the options, as in ``sft``.

| name         | modes read           | samples                   |
|--------------|----------------------|---------------------------|
| `warm-leafe` | ``demo``, ``explore`` | ``sft``, then ``cf``, ``reh`` |
| `warm-grpo`  | ``demo``, ``rollout`` | ``sft``, then ``grpo``      |
"""

from __future__ import annotations

import msgspec

from leafe.learner.materializers.grpo import GrpoMaterializer, GrpoOptions
from leafe.learner.materializers.leafe import LeafeMaterializer, LeafeOptions
from leafe.learner.materializers.sft import demonstration_samples
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.samples import Sample

__all__ = ["WarmGrpoMaterializer", "WarmGrpoOptions", "WarmLeafeMaterializer", "WarmLeafeOptions"]


def _check_splits(splits: list[str]) -> None:
    if "test" in splits:
        raise ValueError(
            f"splits = {splits!r}: demonstrations and training never come from the test split"
        )


class WarmLeafeOptions(LeafeOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``leafe``'s options, plus the demonstrations' (as in ``sft``)."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["demo", "explore"])
    """Episode modes that produce samples."""
    only_successful: bool = True
    """Only demonstrations that solved their task yield ``sft`` samples."""
    demo_weight: float = 1.0
    """Loss weight of every demonstration (``sft``) sample."""

    def __post_init__(self) -> None:
        _check_splits(self.splits)


class WarmGrpoOptions(GrpoOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``grpo``'s options, plus the demonstrations' (as in ``sft``)."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["demo", "rollout"])
    """Episode modes that produce samples (demonstrations never form GRPO groups: they have no
    group)."""
    only_successful: bool = True
    """Only demonstrations that solved their task yield ``sft`` samples."""
    demo_weight: float = 1.0
    """Loss weight of every demonstration (``sft``) sample."""

    def __post_init__(self) -> None:
        _check_splits(self.splits)


class WarmLeafeMaterializer(LeafeMaterializer):
    """Demonstrations as ``sft`` samples, explore trees as LEAFE's ``cf`` and ``reh``."""

    name = "warm-leafe"
    version = 1
    Options = WarmLeafeOptions
    options: WarmLeafeOptions

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        if tree.started.mode == "demo":
            return demonstration_samples(self, tree, node, weight=self.options.demo_weight)
        return super()._on_outcome(tree, node)


class WarmGrpoMaterializer(GrpoMaterializer):
    """Demonstrations as ``sft`` samples, grouped rollouts as GRPO's ``grpo``."""

    name = "warm-grpo"
    version = 1
    Options = WarmGrpoOptions
    options: WarmGrpoOptions

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        if tree.started.mode == "demo":
            return demonstration_samples(self, tree, node, weight=self.options.demo_weight)
        return super()._on_outcome(tree, node)
