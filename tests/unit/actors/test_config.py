"""Actor configuration: per-environment defaults, overrides, validation that names the field."""

from __future__ import annotations

import tomllib

import pytest

from leafe.actors.config import ENV_DEFAULTS, ActorServiceConfig, ExplorerConfig, RolloutConfig
from leafe.services.config import ConfigError, load_config


def test_per_env_defaults_apply() -> None:
    """Each documented environment gets its own horizon/K/budgets; unknown envs get the generic
    ones."""
    assert ExplorerConfig.for_env("sokoban").horizon == 15
    assert (
        ExplorerConfig.for_env("humaneval").k == 0
        and ExplorerConfig.for_env("humaneval").horizon == 4
    )
    assert ExplorerConfig.for_env("scienceworld").env_in_thread
    assert ExplorerConfig.for_env("whatever") == ExplorerConfig()
    assert RolloutConfig.for_env("humaneval").action_stop == []
    for env in ENV_DEFAULTS:
        assert ExplorerConfig.for_env(env).horizon == RolloutConfig.for_env(env).horizon


def test_rollout_as_explorer_never_reflects() -> None:
    """A rollout is a one-branch tree: no periodic reflection, depth 0, budget = horizon."""
    cfg = ExplorerConfig.from_rollout(RolloutConfig(horizon=7, temperature=0.5))
    assert (cfg.k, cfg.max_depth, cfg.max_branches, cfg.max_actions, cfg.horizon) == (0, 0, 1, 7, 7)
    assert cfg.temperature == 0.5 and cfg.return_logprob


def test_toml_overrides_layer_on_env_defaults() -> None:
    """Service TOML: '*' overrides every env, a named env overrides '*', the rest keep env
    defaults."""
    toml = """
concurrency = 2
[explorer."*"]
temperature = 0.5
[explorer.sokoban]
k = 3
[rollout.sokoban]
horizon = 9
"""
    cfg = load_config(ActorServiceConfig, overrides=tomllib.loads(toml))
    sok = cfg.explorer_config("sokoban")
    assert (sok.k, sok.temperature, sok.horizon) == (3, 0.5, 15)
    assert cfg.explorer_config("scienceworld").temperature == 0.5
    assert cfg.rollout_config("sokoban").horizon == 9


def test_bad_values_name_the_field_and_env() -> None:
    """An out-of-range or unknown field is rejected with its name (and env) in the message."""
    with pytest.raises(ValueError, match="max_branches = 0"):
        ExplorerConfig(max_branches=0)
    with pytest.raises(ValueError, match=r"sokoban.*horizn"):
        ExplorerConfig.for_env("sokoban", {"horizn": 3})
    with pytest.raises(ConfigError, match="experience_scope"):
        load_config(
            ActorServiceConfig, overrides={"explorer": {"sokoban": {"experience_scope": "always"}}}
        )
    with pytest.raises(ConfigError, match="in_progress_interval_s"):
        load_config(
            ActorServiceConfig, overrides={"ack_wait_s": 10.0, "in_progress_interval_s": 20.0}
        )


def test_oracle_reflection_source_only_where_an_oracle_exists() -> None:
    """reflection_source = oracle is accepted for sokoban and humaneval and refused, naming the env
    and the field, for the others (also inside the actor service's per-env tables)."""
    assert (
        ExplorerConfig.for_env("sokoban", {"reflection_source": "oracle"}).reflection_source
        == "oracle"
    )
    assert (
        ExplorerConfig.for_env("humaneval", {"reflection_source": "oracle"}).reflection_source
        == "oracle"
    )
    for env in ("scienceworld", "textworld-cooking"):
        with pytest.raises(
            ConfigError, match=f"reflection_source = 'oracle' but '{env}' has no reflection oracle"
        ):
            ExplorerConfig.for_env(env, {"reflection_source": "oracle"})
    with pytest.raises(Exception, match="no reflection oracle"):
        ActorServiceConfig(explorer={"scienceworld": {"reflection_source": "oracle"}})
    with pytest.raises(ConfigError, match="reflection_source"):
        ExplorerConfig.for_env("sokoban", {"reflection_source": "teacher"})


def test_oracle_labels_only_where_an_oracle_exists_and_only_beside_model_reflections() -> None:
    """oracle_labels is accepted for sokoban and humaneval, refused naming env and field elsewhere
    (also in the actor service's tables), and refused with reflection_source = oracle (nothing to
    label)."""
    assert ExplorerConfig.for_env("sokoban", {"oracle_labels": True}).oracle_labels
    assert ExplorerConfig.for_env("humaneval", {"oracle_labels": True}).oracle_labels
    assert not ExplorerConfig.for_env("sokoban").oracle_labels
    for env in ("scienceworld", "textworld-cooking"):
        with pytest.raises(
            ConfigError, match=f"oracle_labels = True but '{env}' has no reflection oracle"
        ):
            ExplorerConfig.for_env(env, {"oracle_labels": True})
    with pytest.raises(Exception, match="no reflection oracle"):
        ActorServiceConfig(explorer={"scienceworld": {"oracle_labels": True}})
    with pytest.raises(ConfigError, match="oracle_labels"):
        ExplorerConfig.for_env("sokoban", {"oracle_labels": True, "reflection_source": "oracle"})


def test_demo_tables_resolve_per_env() -> None:
    """[demo.<env>] tables configure demonstrations: defaults, then "*", then the env's own."""
    cfg = ActorServiceConfig(demo={"*": {"alternatives": 4}, "sokoban": {"self_reflection": True}})
    assert (
        cfg.demo_config("sokoban").alternatives == 4 and cfg.demo_config("sokoban").self_reflection
    )
    assert (
        cfg.demo_config("humaneval").answer_format == "fence"
        and cfg.demo_config("humaneval").alternatives == 4
    )
    with pytest.raises(Exception, match="self_reflection"):
        ActorServiceConfig(demo={"sokoban": {"self_reflection": True}})
    with pytest.raises(Exception, match="alternatives"):
        ActorServiceConfig(demo={"sokoban": {"alternatives": -1}})
