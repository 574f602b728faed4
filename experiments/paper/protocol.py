"""The experiment's protocol, registered before any evaluation and checked on every later
invocation.

``protocol_of`` is what a configuration fixes (task ranges, seeds, sample counts, rows and
comparisons); ``check_protocol`` writes it at the first start and refuses a later start that moves
it; ``check_inherited`` refuses an ``effect.inherit`` experiment whose registration differs from its
parent's on what the inherited warm start was made with.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from experiments.paper import carry
from experiments.paper.config import PaperConfig
from experiments.paper.phases import GRPO_ROUND_SEEDS
from experiments.paper.plans import comparisons_of

__all__ = ["INHERITED_KEYS", "check_inherited", "check_protocol", "protocol_of"]


def protocol_of(cfg: PaperConfig) -> dict[str, Any]:
    """What is fixed before any evaluation: task ranges, seeds, sample counts, rows and
    comparisons."""
    return {
        "env": cfg.env,
        "model": cfg.model,
        "test": {
            "split": "test",
            "first": cfg.test_offset,
            "tasks": cfg.test_tasks,
            "samples": cfg.eval_samples,
        },
        "validation": {
            "split": "train",
            "first": cfg.val_offset,
            "tasks": cfg.val_tasks,
            "samples": cfg.val_samples,
        },
        "demonstrations": {
            "split": "train",
            "first": cfg.demo_offset,
            "counts": list(cfg.warm.demo_counts),
        },
        "rl_tasks": {"split": "train", "first": cfg.train_offset, "tasks": cfg.train_tasks},
        "room_variants": {k: dict(v) for k, v in cfg.warm.variants.items()},
        "ks": list(cfg.ks),
        "horizon": cfg.horizon,
        "seeds": {
            "test": cfg.eval_seed,
            "noise_check": cfg.eval_seed + cfg.reseed_offset,
            "validation": cfg.val_seed,
            "training_episodes": cfg.seed,
            "grpo_round_offset": GRPO_ROUND_SEEDS,
            "per_sample": "seed + 1000 * task index + sample index",
            "trainer": 0,
            "bootstrap": 0,
        },
        "rows": list(cfg.rows),
        "comparisons": [[a, b] for a, b in comparisons_of(cfg) if a in cfg.rows and b in cfg.rows],
        "selection": {
            "sft": {
                "max_parse_failure": cfg.warm.max_parse_failure,
                "pass1_range": list(cfg.warm.pass1_range),
                "pass1_target": cfg.warm.pass1_target,
            },
            "grpo": "highest validation Pass@1 (lr in round 1, then the round)",
        },
        **({"effect": _effect_protocol(cfg)} if cfg.protocol == "effect" else {}),
    }


def _effect_protocol(cfg: PaperConfig) -> dict[str, Any]:
    """What the ``effect`` protocol fixes besides the table's: its train ranges, the gate, equal
    steps."""
    fx = cfg.effect
    return {
        "label_rooms": {"split": "train", "first": fx.label_offset, "tasks": fx.label_tasks},
        "audit_rooms": {"split": "train", "first": fx.audit_offset, "tasks": fx.audit_tasks},
        "follow_gate": fx.follow_gate,
        "max_passk": cfg.warm.max_passk,
        "row_steps": fx.row_steps,
        "explorer": dict(fx.explorer),
        "warm_start": "Base + (demonstrations, reflect and follow samples); "
        "epoch: best validation Pass@1",
        **({"rooms": {k: dict(v) for k, v in fx.rooms.items()}} if fx.rooms else {}),
        **({"inherit": fx.inherit} if fx.inherit else {}),
        **({"fair": _fair_protocol(cfg)} if fx.own_rehearsal else {}),
    }


def _fair_protocol(cfg: PaperConfig) -> dict[str, Any]:
    """The fair table's registered choices (issue #61; absent from the protocols before it)."""
    fx = cfg.effect
    return {
        "rehearsal": "reh-own of each row's trees (no step with e in its prompt, none identical "
        "to a cf sample)",
        "dagger": dict(fx.dagger),
        "self_taught": dict(fx.self_taught),
        "reflector_rounds": fx.reflector_rounds,
        "reflector_steps": fx.reflector_steps,
        "start": "every row from W rebuilt once on this run's CPU kind",
    }


INHERITED_KEYS = (
    "env",
    "model",
    "validation",
    "demonstrations",
    "room_variants",
    "horizon",
    "seeds",
    "selection",
)
"""What an ``effect.inherit`` experiment's protocol must share with the registered one of the
experiment whose warm start it takes (and the effect keys below): everything that warm start was
made with."""

_INHERITED_EFFECT_KEYS = ("label_rooms", "warm_start")


def check_inherited(results: Path, cfg: PaperConfig) -> dict[str, Any]:
    """The registered protocol of ``cfg.effect.inherit`` (from its carried state), once it is known
    to agree with ``cfg`` on what the inherited warm start depends on; a ``ValueError`` naming what
    differs."""
    parent = cfg.effect.inherit
    path = carry.state_dir(results, parent) / "protocol.json"
    if not path.is_file():
        raise ValueError(f"effect.inherit = {parent!r}: no registered protocol at {path}")
    old = json.loads(path.read_text(encoding="utf-8"))["protocol"]
    now = protocol_of(cfg)
    moved = [k for k in INHERITED_KEYS if now.get(k) != old.get(k)]
    moved += [
        f"effect.{k}"
        for k in _INHERITED_EFFECT_KEYS
        if now["effect"].get(k) != old.get("effect", {}).get(k)
    ]
    if moved:
        raise ValueError(
            f"effect.inherit = {parent!r}: its registered protocol differs in {', '.join(moved)}; "
            "its warm start was made with other settings"
        )
    return dict(old)


def check_protocol(path: Path, cfg: PaperConfig) -> dict[str, Any]:
    """Register the protocol at ``path`` (first invocation) or check that ``cfg`` keeps it; returns
    the registered record. A change is a ``ValueError`` naming the fields that moved."""
    now = protocol_of(cfg)
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        moved = sorted(
            k for k in set(now) | set(old["protocol"]) if now.get(k) != old["protocol"].get(k)
        )
        if moved:
            raise ValueError(
                f"the protocol registered in {path} at {old['registered_at']} differs in "
                f"{', '.join(moved)}; "
                "use another name (or --fresh) to run a different protocol"
            )
        return dict(old)
    record = {
        "registered_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "protocol": now,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return record
