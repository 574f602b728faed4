"""A run directory is bound to its model, environment and materializer (services/run/launch.py)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from rich.console import Console

from leafe.services.config import ConfigError
from leafe.services.run.context import RunContext
from leafe.services.run.launch import check_identity, prepare_run_dir
from leafe.services.run.presets import resolve_run_config


def _ctx(tmp_path: Path, **overrides: object) -> RunContext:
    cfg = resolve_run_config(
        "tiny", overrides={"runs_dir": str(tmp_path), "run_id": "r", **overrides}
    )
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
    with pytest.raises(ConfigError, match="materializer was 'warm-leafe', now 'rft'"):
        check_identity(
            _ctx(tmp_path, materializer="rft", **{"learner.kinds": ["rft"]}), fresh=False
        )
    check_identity(other, fresh=True)
    assert not (other.run_dir / "nats").exists()
    check_identity(other, fresh=False)  # now bound to the new model


def test_prepare_writes_every_service_config_that_its_service_accepts(tmp_path: Path) -> None:
    """The files handed to the child services decode into their config types (unknown keys would
    fail)."""
    from leafe.actors.config import ActorServiceConfig
    from leafe.learner.config import LearnerConfig
    from leafe.services.config import load_config
    from leafe.services.replayer.service import ReplayerConfig

    ctx = _ctx(tmp_path)
    prepare_run_dir(ctx)
    conf = ctx.run_dir / "config"
    assert load_config(ActorServiceConfig, files=[conf / "actor.toml"]) == ctx.config.actor
    assert load_config(ReplayerConfig, files=[conf / "replayer.toml"]) == ctx.config.replayer
    assert load_config(LearnerConfig, files=[conf / "learner.toml"]) == ctx.config.learner


def test_each_service_is_started_with_its_own_role_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the embedded server, every child gets `--nats-nkey` of its own role (the replayer the
    replayer's seed, ...; the supervisor keeps admin), each actor the seed of its own user
    ``actor.<id>`` with that id as ``--actor-id``, and no identity inherited from LEAFE_NATS_*."""
    from leafe.services.bus.auth import key_names, role_options, write_role_keys
    from leafe.services.run.launch import actor_ids, start_pipeline
    from leafe.services.run.supervisor import ServiceProcess

    async def started(self: ServiceProcess) -> ServiceProcess:  # record the command, spawn nothing
        return self

    monkeypatch.setattr(ServiceProcess, "start", started)
    monkeypatch.setenv("LEAFE_NATS_CREDS", "/inherited/admin.creds")
    ctx = _ctx(tmp_path, **{"services.actors": 2})
    ids = actor_ids(ctx)
    keys = write_role_keys(tmp_path / "keys", key_names(ids))
    ctx.role_nats = role_options("nats://127.0.0.1:4222", keys)
    ctx.nats, ctx.model_dir, ctx.engine_urls = (
        ctx.role_nats["admin"],
        tmp_path,
        ["http://127.0.0.1:1"],
    )
    asyncio.run(start_pipeline(ctx))
    roles = {"replayer": "replayer", "learner": "learner", "weight-sync": "weight-sync"}
    roles |= {f"actor-{i}": f"actor.{actor_id}" for i, actor_id in enumerate(ids)}
    assert len(ids) >= 1 and len(set(keys[f"actor.{a}"].public_key for a in ids)) == len(ids)
    assert set(ctx.services) == set(roles)
    for name, role in roles.items():
        argv = ctx.services[name].argv
        assert argv[argv.index("--nats-nkey") + 1] == keys[role].seed_file, name
        assert argv[argv.index("--nats") + 1] == "nats://127.0.0.1:4222"
        assert ctx.services[name].env["LEAFE_NATS_CREDS"] == "", name
        if role.startswith("actor."):
            assert argv[argv.index("--actor-id") + 1] == role.removeprefix("actor."), name


def test_only_weight_sync_gets_the_engines_admin_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's engines take weight updates only with their admin key: weight sync gets its file,
    every other child (actors above all) an empty ``LEAFE_ENGINE_ADMIN_KEY_FILE``, even when the
    supervisor's own environment names one; all of them get the API key file."""
    from leafe.services.run.launch import start_pipeline
    from leafe.services.run.supervisor import ServiceProcess

    async def started(self: ServiceProcess) -> ServiceProcess:
        return self

    monkeypatch.setattr(ServiceProcess, "start", started)
    monkeypatch.setenv("LEAFE_ENGINE_ADMIN_KEY_FILE", "/inherited/admin-key")
    ctx = _ctx(tmp_path, **{"services.actors": 2})
    ctx.model_dir, ctx.engine_urls = tmp_path, ["http://127.0.0.1:1"]
    ctx.engine_key_file = str(tmp_path / "secrets" / "engine-api-key")
    ctx.engine_admin_key_file = str(tmp_path / "secrets" / "engine-admin-key")
    asyncio.run(start_pipeline(ctx))
    admin = {name: proc.env["LEAFE_ENGINE_ADMIN_KEY_FILE"] for name, proc in ctx.services.items()}
    assert admin.pop("weight-sync") == ctx.engine_admin_key_file
    assert set(admin) >= {"actor-0", "actor-1", "replayer", "learner"}
    assert set(admin.values()) == {""}, admin
    for proc in ctx.services.values():
        assert proc.env["LEAFE_ENGINE_API_KEY_FILE"] == ctx.engine_key_file
