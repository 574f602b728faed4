"""experiments/paper/online_effect.py: the two ``leafe run`` configs written from
an effect experiment's records start both presets from the warm start W on the rows' rooms, with the
offline rows' explorer, lrs, validation slice and test tasks, and ``leafe run`` accepts them as they
are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.paper.config import load_paper_config, scale_path
from experiments.paper.online_effect import main, online_configs
from leafe.services.run.presets import resolve_run_config


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "paper" / "effect-hard"
    weights = work / "warm-train" / "train" / "e2"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    for phase, record in (
        ("select-warm", {"weights": str(weights), "epochs": 2}),
        ("select-rooms", {"variant": "7x7-l12-w2", "val_phase": "val-rooms-7x7-l12-w2"}),
    ):
        (work / phase).mkdir()
        (work / phase / "done.json").write_text(json.dumps(record))
    return work


def test_both_runs_start_from_the_warm_start_on_the_rows_rooms_and_resolve(tmp_path: Path) -> None:
    cfg = load_paper_config(scale_path("effect-hard"))
    work = _work(tmp_path)
    out = tmp_path / "configs"
    assert (
        main(["--scale", "effect-hard", "--work", str(work), "--minutes", "30", "--out", str(out)])
        == 0
    )
    runs = {p: resolve_run_config(p, files=[out / f"{p}.toml"]) for p in ("leafe", "grpo")}
    weights = str((work / "warm-train" / "train" / "e2").resolve())
    for preset, run in runs.items():
        assert (run.model, run.budget_minutes, run.explore.demos) == (weights, 30.0, 0), preset
        assert run.env.options == {
            "height": 7,
            "width": 7,
            "num_boxes": 1,
            "min_solution_len": 5,
            "max_solution_len": 12,
            "max_steps": 30,
        }
        assert (run.explore.offset, run.explore.tasks) == (cfg.train_offset, cfg.train_tasks)
        assert (run.eval.tasks, run.eval.samples, run.eval.seed, run.eval.before) == (
            cfg.test_tasks,
            cfg.eval_samples,
            cfg.eval_seed,
            False,
        )
        assert (run.online_eval.offset, run.online_eval.tasks, run.online_eval.seed) == (
            cfg.val_offset,
            cfg.val_tasks,
            cfg.val_seed,
        )
    leafe, grpo = runs["leafe"], runs["grpo"]
    assert (leafe.materializer, leafe.explore.mode, leafe.learner.kinds) == (
        "leafe",
        "explore",
        ["cf", "reh"],
    )
    assert leafe.learner.trainer.optim.lr == cfg.effect.row_lr
    explorer = leafe.actor.explorer["sokoban"]
    assert (
        explorer["max_corrections"],
        explorer["stop_on_first_success"],
        explorer["history_window"],
    ) == (
        3,
        False,
        2,
    )
    assert leafe.replayer.options["rehearsal_unit"] == "path"
    assert (grpo.materializer, grpo.explore.mode, grpo.explore.samples) == (
        "grpo",
        "rollout",
        cfg.grpo.group,
    )
    assert grpo.learner.kinds == ["grpo"] and grpo.learner.trainer.optim.lr == cfg.grpo.lrs[0]
    # the oracle-e ablation: the leafe run with the oracle naming tau and e, nothing else changed
    oracle = resolve_run_config("leafe", files=[out / "leafe-oracle.toml"])
    assert oracle.actor.explorer["sokoban"] == {**explorer, "reflection_source": "oracle"}
    assert oracle.run_id == "online-effect-hard-leafe-oracle" != leafe.run_id
    assert oracle.actor.explorer_config("sokoban").reflection_source == "oracle"
    assert leafe.actor.explorer_config("sokoban").reflection_source == "model"
    assert (oracle.learner, oracle.replayer, oracle.eval, oracle.model) == (
        leafe.learner,
        leafe.replayer,
        leafe.eval,
        leafe.model,
    )
    # both learners pack as the experiment's GRPO trained (effect-hard: the shared prompt prefix
    # once a row)
    assert cfg.grpo.share_prefix
    assert leafe.learner.trainer.batch.share_prefix and grpo.learner.trainer.batch.share_prefix


def test_without_the_warm_start_on_disk_it_refuses(tmp_path: Path) -> None:
    cfg = load_paper_config(scale_path("effect-hard"))
    work = _work(tmp_path)
    (work / "warm-train" / "train" / "e2" / "config.json").unlink()
    with pytest.raises(ValueError, match="not on disk"):
        online_configs(cfg, work, 30.0)
    with pytest.raises(ValueError, match="select-warm has not finished"):
        online_configs(cfg, tmp_path / "nowhere", 30.0)
