"""Materializers: pure folds from the event log to training samples, and their registry.

``make_materializer("leafe", tokenizer, rehearsal_fraction=0.2)`` returns a fold; feed it events
with ``apply(event)`` and collect the samples it returns (see ``leafe.learner.materializers.base``):

name: the samples it makes

- `leafe`: ``cf`` counterfactual (parent history without e -> branch's first action) and ``reh``
  rehearsal
- `grpo`: ``grpo``: every step of grouped rollouts with its group-normalised advantage
- `rft`: ``rft``: every step of successful plain rollouts
- `sft`: ``sft``: every expert step of successful demonstrations (mode ``demo``, train split only)
- `iwm`: ``iwm``: (state, the policy's alternative action) -> the observation it led to, plus
  ``sft``
- `sr`: ``sr``: state -> the policy's explanation of why the expert action is better + that action,
  plus ``sft``
- `reflect`: ``sft``: oracle-labelled reflections -> ``<step>tau</step><experience>e</experience>``
  (warm start)
- `follow`: ``sft``: the history at the oracle's tau with its e -> the move e names (warm start: act
  on e)
- `warm-leafe`: ``sft`` from demonstrations, then ``cf`` and ``reh`` from explore trees (one run,
  ``warm.py``)
- `warm-grpo`: ``sft`` from demonstrations, then ``grpo`` from grouped rollouts (the online
  baseline)
- `dagger`: ``cf``: the oracle's move at the policy's first mistake on its own (root) rollouts
- `reh-own`: ``reh``: LEAFE's rehearsal less e-guided steps and cf duplicates
- `self-taught`: ``sft``: the model's reflections whose branch beat the no-e continuation
"""

from __future__ import annotations

from typing import Any

from leafe.learner.materializers.base import Materializer
from leafe.learner.materializers.common import CommonOptions, FoldStats, sample_id_for
from leafe.learner.materializers.early import IwmMaterializer, IwmOptions, SrMaterializer, SrOptions
from leafe.learner.materializers.fair import (
    DaggerMaterializer,
    OwnRehearsalMaterializer,
    SelfTaughtMaterializer,
)
from leafe.learner.materializers.folding import Folder, FoldResult, fold_events, write_folded
from leafe.learner.materializers.follow import FollowMaterializer, FollowOptions
from leafe.learner.materializers.grpo import GrpoMaterializer, GrpoOptions
from leafe.learner.materializers.leafe import LeafeMaterializer, LeafeOptions
from leafe.learner.materializers.lifecycle import OpenLimits
from leafe.learner.materializers.reflect import ReflectMaterializer, ReflectOptions
from leafe.learner.materializers.rft import RftMaterializer, RftOptions
from leafe.learner.materializers.sft import SftMaterializer, SftOptions
from leafe.learner.materializers.tree import EpisodeFailed, EpisodeTree, ReplayError
from leafe.learner.materializers.warm import WarmGrpoMaterializer, WarmLeafeMaterializer
from leafe.protocol.config import ConfigError, convert_config
from leafe.protocol.prompt import ChatTokenizer

__all__ = [
    "MATERIALIZERS",
    "SAMPLE_KINDS",
    "CommonOptions",
    "EpisodeFailed",
    "EpisodeTree",
    "FoldResult",
    "FoldStats",
    "Folder",
    "FollowMaterializer",
    "FollowOptions",
    "GrpoMaterializer",
    "GrpoOptions",
    "IwmMaterializer",
    "IwmOptions",
    "LeafeMaterializer",
    "LeafeOptions",
    "Materializer",
    "MaterializerConfigError",
    "OpenLimits",
    "ReflectMaterializer",
    "ReflectOptions",
    "ReplayError",
    "RftMaterializer",
    "RftOptions",
    "SftMaterializer",
    "SftOptions",
    "SrMaterializer",
    "SrOptions",
    "fold_events",
    "make_materializer",
    "sample_id_for",
    "write_folded",
]

MATERIALIZERS: dict[str, type[Materializer]] = {
    "leafe": LeafeMaterializer,
    "grpo": GrpoMaterializer,
    "rft": RftMaterializer,
    "sft": SftMaterializer,
    "iwm": IwmMaterializer,
    "sr": SrMaterializer,
    "reflect": ReflectMaterializer,
    "follow": FollowMaterializer,
    "warm-leafe": WarmLeafeMaterializer,
    "warm-grpo": WarmGrpoMaterializer,
    "dagger": DaggerMaterializer,
    "reh-own": OwnRehearsalMaterializer,
    "self-taught": SelfTaughtMaterializer,
}
"""Registry: name -> materializer class."""

SAMPLE_KINDS: dict[str, tuple[str, ...]] = {
    "leafe": ("cf", "reh"),
    "grpo": ("grpo",),
    "rft": ("rft",),
    "sft": ("sft",),
    "iwm": ("iwm", "sft"),
    "sr": ("sr", "sft"),
    "reflect": ("sft",),
    "follow": ("sft",),
    "warm-leafe": ("sft", "cf", "reh"),
    "warm-grpo": ("sft", "grpo"),
    "dagger": ("cf",),
    "reh-own": ("reh",),
    "self-taught": ("sft",),
}
"""The sample kinds (``Sample.kind``, subject token) each materializer emits."""


class MaterializerConfigError(ConfigError):
    """An unknown materializer name or an invalid option; the message names it."""


def make_materializer(name: str, tokenizer: ChatTokenizer, **options: Any) -> Materializer:
    """A fresh materializer ``name`` with ``options`` (validated; unknown options are rejected)."""
    cls = MATERIALIZERS.get(name)
    if cls is None:
        raise MaterializerConfigError(
            f"unknown materializer {name!r}; known: {sorted(MATERIALIZERS)}"
        )
    try:
        opts = convert_config(options, cls.Options, where=f"materializer {name!r}")
    except ConfigError as e:
        raise MaterializerConfigError(str(e)) from None
    return cls(tokenizer, opts)
