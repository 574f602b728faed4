"""The registry builds every environment by name from an options table and rejects bad options."""

from __future__ import annotations

import pytest

from leafe.envs import ENV_NAMES, Env, EnvError, env_options, make_env
from leafe.envs.registry import parse_options


def test_names_are_the_four_environments() -> None:
    """The config names of the four environments."""
    assert ENV_NAMES == ("sokoban", "scienceworld", "textworld-cooking", "humaneval")


@pytest.mark.parametrize("name", ENV_NAMES)
def test_every_env_builds_with_defaults_and_lists_its_options(name: str) -> None:
    """make_env(name) gives an Env (nothing heavy starts at construction); options have defaults."""
    env = make_env(name)
    try:
        assert isinstance(env, Env) and env.name == name and env.instructions
        options = env_options(name)
        assert options and parse_options(name, options) == parse_options(name, {})
    finally:
        env.close()


def test_options_are_typed_and_unknown_ones_rejected() -> None:
    """Errors name the environment and the bad field; TOML-style lists convert to the right
    types."""
    env = make_env("sokoban", height=5, width=5, max_solution_len=3)
    assert env.config.height == 5  # type: ignore[attr-defined]
    with pytest.raises(EnvError, match=r"sokoban.*unknown field `colour`"):
        make_env("sokoban", colour="red")
    with pytest.raises(EnvError, match=r"\$\.height"):
        make_env("sokoban", height="six")
    with pytest.raises(EnvError, match="max_steps must be >= 1"):
        make_env("textworld-cooking", max_steps=0)
    with pytest.raises(EnvError, match=r"sandbox"):
        make_env("humaneval", sandbox={"wall_timeout": 1})
    with pytest.raises(EnvError, match="unknown environment 'alfworld'"):
        make_env("alfworld")
    assert make_env("humaneval", sandbox={"wall_timeout_s": 2}).config.sandbox.wall_timeout_s == 2  # type: ignore[attr-defined]
