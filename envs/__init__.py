"""Environments with rollback (see ``envs/base.py`` for the protocol, ``envs/registry.py`` for
names)."""

from leafe.envs.base import Env, EnvError, Reset, RollbackResult, Transition, rollback_to
from leafe.envs.registry import ENV_NAMES, env_options, make_env

__all__ = [
    "ENV_NAMES",
    "Env",
    "EnvError",
    "Reset",
    "RollbackResult",
    "Transition",
    "env_options",
    "make_env",
    "rollback_to",
]
