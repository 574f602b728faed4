"""Environments by name, so a config says ``env = "sokoban"`` plus an options table.

``make_env(name, **options)`` converts ``options`` into the environment's config Struct (unknown
fields are rejected, errors name the field and the value) and builds the environment.
``env_options(name)`` lists every option with its default. Heavy packages (scienceworld, textworld)
are imported only when their environment is built.

Experts: :func:`demonstrator` gives an environment's :class:`~leafe.envs.base.Demonstrator` (every
environment here has one) and :func:`reflection_oracle` its
:class:`~leafe.envs.base.ReflectionOracle` (:data:`ORACLE_ENVS`: Sokoban and HumanEval only);
HumanEval's live in ``envs/humaneval/expert.py``.

Print every environment's options: ``python -m leafe.envs.registry``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import msgspec

from leafe.envs.base import Demonstrator, Env, EnvError, ReflectionOracle

__all__ = [
    "ENV_NAMES",
    "ORACLE_ENVS",
    "config_type",
    "demonstrator",
    "env_options",
    "make_env",
    "parse_options",
    "reflection_oracle",
]

_ENVS: dict[str, tuple[str, str, str]] = {
    "sokoban": ("leafe.envs.sokoban.env", "SokobanEnv", "SokobanConfig"),
    "scienceworld": ("leafe.envs.scienceworld", "ScienceWorldEnv", "ScienceWorldConfig"),
    "textworld-cooking": ("leafe.envs.textworld.env", "TextWorldEnv", "TextWorldConfig"),
    "humaneval": ("leafe.envs.humaneval.env", "HumanEvalEnv", "HumanEvalConfig"),
}

ENV_NAMES: tuple[str, ...] = tuple(_ENVS)
"""Names ``make_env`` accepts."""

_EXPERTS: dict[str, tuple[str, str]] = {
    "humaneval": ("leafe.envs.humaneval.expert", "HumanEvalExpert")
}
"""Environments whose expert is a wrapper class rather than methods of the env itself."""

ORACLE_ENVS: frozenset[str] = frozenset({"sokoban", "humaneval"})
"""Environments with a reflection oracle (``ExplorerConfig.reflection_source = "oracle"``)."""


def _lookup(name: str) -> tuple[Any, type[msgspec.Struct]]:
    if name not in _ENVS:
        raise EnvError(f"unknown environment {name!r}; known: {', '.join(ENV_NAMES)}")
    module_name, env_cls, config_cls = _ENVS[name]
    module = importlib.import_module(module_name)
    return getattr(module, env_cls), getattr(module, config_cls)


def config_type(name: str) -> type[msgspec.Struct]:
    """The config Struct of environment ``name``."""
    return _lookup(name)[1]


def parse_options(name: str, options: Mapping[str, Any] | None = None) -> msgspec.Struct:
    """``options`` (e.g. a TOML table) as ``name``'s config; raises :class:`EnvError` naming a bad
    field."""
    cls = config_type(name)
    try:
        return msgspec.convert(dict(options or {}), cls, strict=False)
    except (msgspec.ValidationError, ValueError) as e:
        raise EnvError(f"bad options for environment {name!r}: {e}") from e


def make_env(name: str, **options: Any) -> Env:
    """Build environment ``name`` with ``options`` (see :func:`env_options` for what exists)."""
    env_cls, _ = _lookup(name)
    return env_cls(parse_options(name, options))


def _expert(env: Env) -> object:
    if env.name in _EXPERTS:
        module_name, cls = _EXPERTS[env.name]
        return getattr(importlib.import_module(module_name), cls)(env)
    return env


def demonstrator(env: Env) -> Demonstrator:
    """The expert that demonstrates ``env``'s train tasks; :class:`EnvError` when it has none."""
    expert = _expert(env)
    if not isinstance(expert, Demonstrator):
        raise EnvError(f"environment {env.name!r} has no demonstrations")
    return expert


def reflection_oracle(env: Env) -> ReflectionOracle:
    """``env``'s reflection oracle; :class:`EnvError` naming the envs that have one when it has
    none."""
    expert = _expert(env) if env.name in ORACLE_ENVS else None
    if not isinstance(expert, ReflectionOracle):
        raise EnvError(
            f"environment {env.name!r} has no reflection oracle; reflection_source = 'oracle' "
            "needs one of "
            f"{sorted(ORACLE_ENVS)}"
        )
    return expert


def env_options(name: str) -> dict[str, Any]:
    """Every option of ``name`` with its default value (nested configs as dicts)."""
    return msgspec.to_builtins(config_type(name)())


def _main() -> None:
    for name in ENV_NAMES:
        print(f"[{name}]")
        for key, value in env_options(name).items():
            print(f"  {key} = {value!r}")


if __name__ == "__main__":
    _main()
