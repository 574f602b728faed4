"""Environments by name, so a config says ``env = "sokoban"`` plus an options table.

``make_env(name, **options)`` converts ``options`` into the environment's config Struct (unknown fields
are rejected, errors name the field and the value) and builds the environment. ``env_options(name)``
lists every option with its default. Heavy packages (scienceworld, textworld) are imported only when
their environment is built.

Print every environment's options: ``python -m envs.registry``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import msgspec

from envs.base import Env, EnvError

__all__ = ["ENV_NAMES", "config_type", "env_options", "make_env", "parse_options"]

_ENVS: dict[str, tuple[str, str, str]] = {
    "sokoban": ("envs.sokoban", "SokobanEnv", "SokobanConfig"),
    "scienceworld": ("envs.scienceworld_env", "ScienceWorldEnv", "ScienceWorldConfig"),
    "textworld-cooking": ("envs.textworld_env", "TextWorldEnv", "TextWorldConfig"),
    "humaneval": ("envs.humaneval", "HumanEvalEnv", "HumanEvalConfig"),
}

ENV_NAMES: tuple[str, ...] = tuple(_ENVS)
"""Names ``make_env`` accepts."""


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
    """``options`` (e.g. a TOML table) as ``name``'s config; raises :class:`EnvError` naming a bad field."""
    cls = config_type(name)
    try:
        return msgspec.convert(dict(options or {}), cls, strict=False)
    except (msgspec.ValidationError, ValueError) as e:
        raise EnvError(f"bad options for environment {name!r}: {e}") from e


def make_env(name: str, **options: Any) -> Env:
    """Build environment ``name`` with ``options`` (see :func:`env_options` for what exists)."""
    env_cls, _ = _lookup(name)
    return env_cls(parse_options(name, options))


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
