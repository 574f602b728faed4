"""Online LEAFE against online GRPO from the ``effect`` protocol's shared warm start W, on the
rooms its rows ran on, at equal wall time: two ``leafe run`` configs written from the experiment's
records, so the online runs use exactly the offline rows' weights, rooms, explorer, lrs and test
tasks.

Both runs start from W (no demonstrations: W already is the warm start), explore the experiment's RL
rooms in continuous rounds until the same budget, draw a validation point after every round on its
validation slice, and end with its test evaluation (same tasks, samples and seed), so each pairs
task by task with the other and with every offline row (``experiments.paper.online --paper``).

    PYTHONPATH=$PWD .venv/bin/python -m experiments.paper.online_effect \
        --scale effect-hard --minutes 35
    leafe run --preset leafe --config runs/online-effect-hard/leafe.toml \
        --fresh --no-live   # then grpo
    .venv/bin/python -m experiments.paper.online \
        runs/online-effect-hard-leafe runs/online-effect-hard-grpo \
        --paper experiments/results/effect_hard_table.json --rows warm,leafe,grpo \
        --out experiments/results/...

A third config, ``leafe-oracle.toml`` (``--preset leafe``), is the oracle-e ablation online; it adds
a run of the same budget, and pairs with the other two only if it runs in the same period on one
machine.

W must be on disk (``runs/paper/<name>/``: a stage of the experiment rebuilt or linked it).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import tomli_w

from experiments.paper import lib
from experiments.paper.config import ROLLOUT_KEYS, PaperConfig, load_paper_config, scale_path

__all__ = ["main", "online_configs"]

PRESETS = {"leafe": "leafe", "grpo": "grpo", "leafe-oracle": "leafe"}
"""Config name -> the ``leafe run`` preset it runs under. ``leafe-oracle`` is an ablation beside the
pair: online LEAFE whose tau and e come from the environment's oracle (the offline table's "LEAFE
with oracle e" row, online), the ceiling of what online LEAFE could gain from its experience on
these rooms."""


def _need(work: Path, phase: str) -> dict[str, Any]:
    done = lib.phase_done(work, phase)
    if done is None:
        raise ValueError(
            f"{phase} has not finished in {work}: the online runs need the warm start and rooms"
        )
    return done


def online_configs(cfg: PaperConfig, work: Path, minutes: float) -> dict[str, dict[str, Any]]:
    """The ``leafe run`` tables of both presets (``leafe``, ``grpo``) and the oracle-e ablation
    (``leafe-oracle``) from ``cfg``'s finished warm start and rooms in ``work``."""
    warm = _need(work, "select-warm")
    weights = Path(warm["weights"])
    if not (weights / "config.json").is_file():
        raise ValueError(f"the warm start's weights are not on disk: {weights} (run a stage first)")
    rooms = _need(work, "select-rooms" if cfg.effect.rooms else "select-sft")
    variant = cfg.room_variant(str(rooms["variant"]))
    options = {k: v for k, v in variant.items() if k not in ROLLOUT_KEYS}
    rollout = {"horizon": cfg.horizon, "history_window": cfg.history_window}
    rollout.update({k: v for k, v in variant.items() if k in ROLLOUT_KEYS})
    fx, g = cfg.effect, cfg.grpo
    common: dict[str, Any] = {
        "model": str(weights.resolve()),
        "budget_minutes": minutes,
        "env": {"name": cfg.env, "options": options},
        "online_eval": {
            "every_rounds": 1,
            "offset": cfg.val_offset,
            "tasks": cfg.val_tasks,
            "samples": 4,
            "ks": [1, 2, 4],
            "seed": cfg.val_seed,
        },
        "eval": {
            "split": "test",
            "tasks": cfg.test_tasks,
            "samples": cfg.eval_samples,
            "ks": list(cfg.ks),
            "before": False,
            "after_warm_start": False,
            "seed": cfg.eval_seed,
        },
        "services": {"inference_dtype": cfg.serving.dtype},
        "actor": {"rollout": {cfg.env: rollout}},
    }
    explore = {"offset": cfg.train_offset, "tasks": cfg.train_tasks, "rounds": 0, "demos": 0}
    # Both learners pack the same way: the experiment's GRPO layout (shared prompt prefix or not).
    batch = {"batch": {"share_prefix": True}} if g.share_prefix else {}
    out = {
        "leafe": {
            **common,
            "run_id": f"online-{cfg.name}-leafe",
            "materializer": "leafe",
            "explore": {**explore, "mode": "explore", "samples": fx.explore_samples},
            "actor": {**common["actor"], "explorer": {cfg.env: {**rollout, **fx.explorer}}},
            "replayer": {
                "options": {
                    "rehearsal_fraction": fx.rehearsal_fraction,
                    "rehearsal_unit": "path",
                    "rehearsal_seed": cfg.seed,
                }
            },
            "learner": {"kinds": ["cf", "reh"], "trainer": {"optim": {"lr": fx.row_lr}, **batch}},
        },
        "grpo": {
            **common,
            "run_id": f"online-{cfg.name}-grpo",
            "materializer": "grpo",
            "explore": {**explore, "mode": "rollout", "samples": g.group},
            "learner": {"kinds": ["grpo"], "trainer": {"optim": {"lr": g.lrs[0]}, **batch}},
        },
    }
    oracle_explorer = {**out["leafe"]["actor"]["explorer"][cfg.env], "reflection_source": "oracle"}
    out["leafe-oracle"] = {
        **out["leafe"],
        "run_id": f"online-{cfg.name}-leafe-oracle",
        "actor": {**out["leafe"]["actor"], "explorer": {cfg.env: oracle_explorer}},
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scale",
        default="effect-hard",
        help="the effect experiment (experiments/configs/paper_<scale>.toml)",
    )
    p.add_argument(
        "--work", type=Path, default=None, help="its work dir (default runs/paper/<name>)"
    )
    p.add_argument("--minutes", type=float, default=35.0, help="each run's wall-clock budget")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the configs (default runs/online-<name>)",
    )
    args = p.parse_args(argv)
    cfg = load_paper_config(scale_path(args.scale))
    work = args.work or Path("runs/paper") / cfg.name
    out = args.out or Path("runs") / f"online-{cfg.name}"
    out.mkdir(parents=True, exist_ok=True)
    for name, table in online_configs(cfg, work, args.minutes).items():
        path, preset = out / f"{name}.toml", PRESETS[name]
        head = (
            f"# {__doc__.splitlines()[0]}\n"
            f"# leafe run --preset {preset} --config {path} --fresh --no-live\n"
        )
        path.write_text(head + tomli_w.dumps(table), encoding="utf-8")
        print(f"leafe run --preset {preset} --config {path} --fresh --no-live")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
