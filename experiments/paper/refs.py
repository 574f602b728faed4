"""The references of the paper table's phases, resolved from finished phases
(``experiments/paper/phases.py`` says which references there are): the base of
:class:`~experiments.paper.steps.Steps`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from experiments.paper import lib
from experiments.paper.config import ROLLOUT_KEYS, PaperConfig
from experiments.paper.phases import Phase
from experiments.paper.specs import ROOMS, AuditSpec, CollectSpec, EvalSpec, TrainSpec

__all__ = ["Refs", "weight_source", "weights_read"]

SELECTS = {
    "sft": "select-sft",
    "grpo": "select-grpo",
    "grpo-r1": "grpo-r1-select",
    "warm": "select-warm",
}
"""Weight references resolved by a choice: the select phase whose record names the weights."""


def weight_source(ref: str) -> str | None:
    """The phase whose record names the weights ``ref`` reads; ``None`` for the shipped base
    model."""
    if ref == "base":
        return None
    if ref in SELECTS:
        return SELECTS[ref]
    if ref.startswith("grpo-r"):
        return f"{ref}-train"
    return ref.removeprefix("train:").partition("@")[0]


def weights_read(spec: Any) -> list[str]:
    """The weight references a phase's spec loads: a collection's, evaluation's or audit's
    ``model``, a training's ``start``; a choice or the probe (the base model) loads none that a
    phase wrote."""
    if isinstance(spec, TrainSpec):
        return [spec.start]
    if isinstance(spec, CollectSpec | EvalSpec | AuditSpec):
        return [spec.model]
    return []


class Refs:
    """What a phase's references name (weights, room variant, task ranges, the chosen counts and
    lrs), resolved from the results of finished phases; ``done(name)`` gives one (``None`` if it has
    none)."""

    def __init__(
        self, cfg: PaperConfig, ctx: lib.Ctx, phases: list[Phase], done: Callable[[str], Any]
    ) -> None:
        self.cfg, self.ctx, self.done = cfg, ctx, done
        self.by_name = {p.name: p for p in phases}

    def _need(self, name: str) -> dict[str, Any]:
        result = self.done(name)
        if result is None:
            raise RuntimeError(f"phase {name} has no result")
        return dict(result)

    # --- references -------------------------------------------------------------------------------
    def weights(self, ref: str) -> Path:
        """The weights directory a reference names (see ``experiments/paper/phases.py``)."""
        if ref == "base":
            return self.ctx.base_model
        select = SELECTS.get(ref)
        if select:
            return Path(self._need(select)["weights"])
        if ref.startswith("grpo-r"):
            return Path(self._need(f"{ref}-train")["final"])
        phase, _, epoch = ref.removeprefix("train:").partition("@")
        result = self._need(phase)
        if not result.get("final"):
            raise RuntimeError(f"{phase} produced no weights: {result.get('note', '')}")
        return Path(result["epoch_weights"][epoch] if epoch else result["final"])

    def variant(self, name: str) -> str:
        """A room variant's name; empty = the one ``select-sft`` chose, ``@rooms`` the one
        ``select-rooms`` chose."""
        if name == ROOMS:
            return str(self._need("select-rooms")["variant"])
        return name or str(self._need("select-sft")["variant"])

    def env_options(self, variant: str) -> dict[str, Any]:
        """Env options of a room variant (empty = the chosen one), without its rollout keys."""
        v = self.cfg.room_variant(self.variant(variant))
        return {k: x for k, x in v.items() if k not in ROLLOUT_KEYS}

    def task_ids(
        self, split: str, offset: int, count: int, options: Mapping[str, Any]
    ) -> list[str]:
        """``count`` task ids of ``split`` from index ``offset`` (errors say when the split is too
        short)."""
        from leafe.envs.registry import make_env

        env = make_env(self.ctx.env, **options)
        try:
            all_ids = list(env.tasks(split))
        finally:
            env.close()
        out = all_ids[offset : offset + count]
        if len(out) != count:
            raise ValueError(
                f"{split} split has {len(all_ids)} tasks; indices {offset}..{offset + count - 1} "
                "asked"
            )
        return out

    def _demo_count(self, value: int | str) -> int:
        return int(self._need("select-sft")["demos"]) if value == "sft" else int(value)

    def _rollout(self, variant: str = "") -> dict[str, Any]:
        """Horizon and history window: the config's, unless the room variant sets its own."""
        v = self.cfg.room_variant(self.variant(variant))
        base = {"horizon": self.cfg.horizon, "history_window": self.cfg.history_window}
        return {**base, **{k: x for k, x in v.items() if k in ROLLOUT_KEYS}}

    def _task_range(self, tasks: str) -> tuple[int, int]:
        """(first train index, count) of a collection's tasks."""
        cfg, fx = self.cfg, self.cfg.effect
        if tasks == "rl":
            return cfg.train_offset, cfg.train_tasks
        if tasks == "labels":
            return fx.label_offset, fx.label_tasks
        if tasks == "audit":
            return fx.audit_offset, fx.audit_tasks
        return cfg.demo_offset, cfg.max_demos if tasks == "demos" else self._demo_count("sft")

    def _lr(self, value: float | str) -> float:
        return float(self._need("grpo-r1-select")["lr"]) if value == "grpo" else float(value)
