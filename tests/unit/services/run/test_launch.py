"""A run directory is bound to its model, environment and materializer (services/run/launch.py)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from rich.console import Console

from services.config import ConfigError
from services.run.context import RunContext
from services.run.launch import check_identity, prepare_run_dir
from services.run.presets import resolve_run_config


def _ctx(tmp_path: Path, **overrides: object) -> RunContext:
    cfg = resolve_run_config("tiny", overrides={"runs_dir": str(tmp_path), "run_id": "r", **overrides})
    return RunContext(config=cfg, console=Console(file=io.StringIO()), stop=asyncio.Event())


def test_resuming_with_another_model_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """The second start with a different model names the difference and the options; the same config
    resumes; --fresh deletes the old directory and starts over."""
    first = _ctx(tmp_path)
    check_identity(first, fresh=False)
    prepare_run_dir(first)
    (first.run_dir / "nats").mkdir()
    check_identity(_ctx(tmp_path), fresh=False)  # same run: resumes
    other = _ctx(tmp_path, model="smollm2-135m-instruct")
    with pytest.raises(
        ConfigError, match=r"model was 'tiny', now 'smollm2-135m-instruct'.*--run-id.*--fresh"
    ):
        check_identity(other, fresh=False)
    with pytest.raises(ConfigError, match="materializer was 'leafe', now 'rft'"):
        check_identity(_ctx(tmp_path, materializer="rft", **{"learner.kinds": ["rft"]}), fresh=False)
    check_identity(other, fresh=True)
    assert not (other.run_dir / "nats").exists()
    check_identity(other, fresh=False)  # now bound to the new model


def test_prepare_writes_every_service_config_that_its_service_accepts(tmp_path: Path) -> None:
    """The files handed to the child services decode into their config types (unknown keys would fail)."""
    from actors.config import ActorServiceConfig
    from learner.config import LearnerConfig
    from services.config import load_config
    from services.replayer_service import ReplayerConfig

    ctx = _ctx(tmp_path)
    prepare_run_dir(ctx)
    conf = ctx.run_dir / "config"
    assert load_config(ActorServiceConfig, files=[conf / "actor.toml"]) == ctx.config.actor
    assert load_config(ReplayerConfig, files=[conf / "replayer.toml"]) == ctx.config.replayer
    assert load_config(LearnerConfig, files=[conf / "learner.toml"]) == ctx.config.learner
