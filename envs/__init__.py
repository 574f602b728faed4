"""Environments with rollback (see ``envs/base.py`` for the protocol, ``envs/registry.py`` for names)."""

from envs.base import Env, EnvError, Reset, RollbackResult, Transition, rollback_to

__all__ = ["Env", "EnvError", "Reset", "RollbackResult", "Transition", "rollback_to"]
