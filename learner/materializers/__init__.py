"""Materializers: pure folds from the event log to training samples, and their registry.

``make_materializer("leafe", tokenizer, rehearsal_fraction=0.2)`` returns a fold; feed it events with
``apply(event)`` and collect the samples it returns (see ``learner.materializers.base``):

| name    | samples                                                                   |
|---------|---------------------------------------------------------------------------|
| `leafe` | ``cf`` counterfactual (parent history without e -> branch's first action) and ``reh`` rehearsal |
| `grpo`  | ``grpo``: every step of grouped rollouts with its group-normalised advantage |
| `rft`   | ``rft``: every step of successful plain rollouts                            |
"""

from __future__ import annotations

from typing import Any

import msgspec

from learner.materializers.base import CommonOptions, FoldStats, Materializer, sample_id_for
from learner.materializers.grpo import GrpoMaterializer, GrpoOptions
from learner.materializers.leafe import LeafeMaterializer, LeafeOptions
from learner.materializers.rft import RftMaterializer, RftOptions
from learner.materializers.tree import EpisodeTree, ReplayError
from protocol.prompt import ChatTokenizer

__all__ = [
    "MATERIALIZERS",
    "CommonOptions",
    "EpisodeTree",
    "FoldStats",
    "GrpoMaterializer",
    "GrpoOptions",
    "LeafeMaterializer",
    "LeafeOptions",
    "Materializer",
    "MaterializerConfigError",
    "ReplayError",
    "RftMaterializer",
    "RftOptions",
    "make_materializer",
    "sample_id_for",
]

MATERIALIZERS: dict[str, type[Materializer]] = {
    "leafe": LeafeMaterializer,
    "grpo": GrpoMaterializer,
    "rft": RftMaterializer,
}
"""Registry: name -> materializer class."""


class MaterializerConfigError(ValueError):
    """An unknown materializer name or an invalid option; the message names it."""


def make_materializer(name: str, tokenizer: ChatTokenizer, **options: Any) -> Materializer:
    """A fresh materializer ``name`` with ``options`` (validated; unknown options are rejected)."""
    cls = MATERIALIZERS.get(name)
    if cls is None:
        raise MaterializerConfigError(f"unknown materializer {name!r}; known: {sorted(MATERIALIZERS)}")
    try:
        opts = msgspec.convert(options, cls.Options, strict=False)
    except msgspec.ValidationError as e:
        raise MaterializerConfigError(f"invalid options for materializer {name!r}: {e}") from None
    return cls(tokenizer, opts)
