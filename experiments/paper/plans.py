"""An experiment's phases and paired comparisons, by its protocol.

``paper`` is the paper table's protocol (``phases.py``); ``effect`` is the LEAFE-effect protocol
(``effect.py``), built from the paper's phases. This module sits above both, so neither imports the
other back.
"""

from __future__ import annotations

from experiments.paper import effect, phases
from experiments.paper.config import PaperConfig
from experiments.paper.phases import Phase

__all__ = ["comparisons_of", "plan"]


def plan(cfg: PaperConfig) -> list[Phase]:
    """Every phase ``cfg`` needs, in priority order (dependencies always come first)."""
    if cfg.protocol == "effect":
        return phases.checked(effect.plan_effect(cfg))
    return phases.plan_paper(cfg)


def comparisons_of(cfg: PaperConfig) -> list[tuple[str, str]]:
    """The paired comparisons (row a - row b) of ``cfg``'s protocol, in report order."""
    if cfg.protocol == "effect":
        return effect.EFFECT_COMPARISONS
    return phases.COMPARISONS
