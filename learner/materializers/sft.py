"""SFT on demonstrations (the warm start): every expert step of a demonstration episode is a sample.

On the ``Outcome`` of the expert path ``b0`` of a ``demo`` episode (``actors/demo.py``) that solved
its task, each step ``t`` of the path becomes an ``sft`` sample ``(q + h_t, a_t)``: the prompt
rebuilt from the log exactly as the policy would have been sent it (and checked against
``Step.prompt_sha256``), the target the expert answer's exact token ids (``Step.token_ids``:
``up</action>`` after the ``<action>`` prefix, or a fenced function ending with the end-of-turn
token). Alternative branches (Early Experience) are not demonstrations and never become ``sft``
samples. Steps whose answer the policy's parser would misread (``parse_ok`` False, see
``actors/demo.py``) are skipped.

Only demonstrations of train tasks are ever used: the options reject any mode but ``demo`` and the
``test`` split (``DemoOptions``), so no setting can turn an evaluation or test episode into a
target.
"""

from __future__ import annotations

import msgspec

from leafe.learner.materializers.base import CommonOptions, Materializer, path_entries
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.events import ROOT_BRANCH
from leafe.protocol.samples import Sample, SampleKind

__all__ = ["DemoOptions", "SftMaterializer", "SftOptions", "demonstration_samples"]


class DemoOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the materializers over demonstrations: mode ``demo`` only, never the test
    split."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["demo"])
    """Episode modes that produce samples: only ``demo`` is accepted."""
    only_successful: bool = True
    """Only demonstrations that solved their task yield demonstration samples."""
    demo_weight: float = 1.0
    """Loss weight of every demonstration (``sft``) sample."""

    def __post_init__(self) -> None:
        if set(self.modes) - {"demo"}:
            raise ValueError(
                f"modes = {self.modes!r}: demonstration materializers read only mode 'demo'"
            )
        if "test" in self.splits:
            raise ValueError(
                f"splits = {self.splits!r}: demonstrations never come from the test split"
            )


class SftOptions(DemoOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``sft`` materializer."""


def demonstration_samples(
    fold: Materializer,
    tree: EpisodeTree,
    node: BranchNode,
    *,
    kind: SampleKind = "sft",
    weight: float = 1.0,
) -> list[Sample]:
    """Samples of every step of the expert path ``node`` (``b0``) of a demonstration, in order."""
    outcome = node.outcome
    assert outcome is not None
    only_successful = bool(
        getattr(fold.options, "only_successful", True)
    )  # DemoOptions and warm-*'s
    if node.branch_id != ROOT_BRANCH or (only_successful and not outcome.success):
        return []
    path = tree.path(node.branch_id)
    entries = path_entries(path)
    ids = [tree.started.event_id, *(s.event_id for s in path)]
    out: list[Sample] = []
    for t in range(len(path)):
        sample = fold.build_sample(
            tree,
            kind=kind,
            path=path,
            t=t,
            entries=entries,
            source_event_ids=ids[: t + 2],
            weight=weight,
        )
        if sample is not None:
            out.append(sample)
    return out


class SftMaterializer(Materializer):
    """Demonstration steps as SFT samples (see the module docstring)."""

    name = "sft"
    version = 1
    Options = SftOptions
    options: SftOptions

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        return demonstration_samples(self, tree, node, weight=self.options.demo_weight)
