"""Unit tests of learner/config.py and learner/optim.py: presets, TOML overrides, the LR
schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from leafe.learner.config import (
    LearnerConfig,
    OptimConfig,
    TrainConfig,
    learner_preset,
    train_preset,
)
from leafe.learner.optim import lr_factor
from leafe.services.config import ConfigError, load_config


def test_paper_preset_has_the_papers_hyperparameters() -> None:
    """paper: lr 1e-6, global batch 128 samples, 2 epochs (the paper reports 2-3)."""
    cfg = train_preset("paper")
    assert cfg.trainer.optim.lr == 1e-6
    assert cfg.trainer.batch.global_batch == 128
    assert cfg.epochs in (2, 3)


def test_toml_and_overrides_apply_on_top_of_the_preset(tmp_path: Path) -> None:
    """TOML fields replace preset fields, nested; dotted overrides replace both; the rest stays."""
    path = tmp_path / "t.toml"
    path.write_text(
        "epochs = 3\n[trainer.loss]\nbeta = 0.5\n[trainer.optim]\nlr = 2e-6\n", encoding="utf-8"
    )
    cfg = load_config(
        TrainConfig,
        preset=train_preset("paper"),
        files=[path],
        overrides={"trainer.optim.lr": 3e-6},
    )
    assert (cfg.epochs, cfg.trainer.loss.beta, cfg.trainer.optim.lr) == (3, 0.5, 3e-6)
    assert cfg.trainer.batch.global_batch == 128


def test_unknown_fields_and_presets_are_rejected_with_their_name() -> None:
    """A misspelt field is an error naming it, never silently ignored; so is an unknown preset."""
    with pytest.raises(ConfigError, match="gloabl_batch"):
        load_config(
            TrainConfig, preset=train_preset("cpu"), overrides={"trainer.batch.gloabl_batch": 4}
        )
    with pytest.raises(ConfigError, match="unknown trainer preset 'fast'"):
        train_preset("fast")


def test_learner_config_takes_the_presets_trainer() -> None:
    """leafe learner's trainer section starts from the preset; service fields keep their
    defaults."""
    cfg = load_config(LearnerConfig, preset=learner_preset("cpu"), overrides={"kinds": ["grpo"]})
    assert isinstance(cfg, LearnerConfig)
    assert cfg.trainer.batch.global_batch == 16
    assert cfg.kinds == ["grpo"]
    assert cfg.max_policy_lag == 4


def test_lr_schedule_warmup_then_cosine_to_the_floor() -> None:
    """Linear warmup to 1, then cosine decay reaching min_lr_ratio at total_steps."""
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", total_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, cfg) == pytest.approx(1.0)
    assert lr_factor(9, cfg) == pytest.approx(0.55)
    assert lr_factor(14, cfg) == pytest.approx(0.1)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    assert lr_factor(100, OptimConfig(schedule="constant")) == 1.0
