"""A small pool of environment instances, reused across episodes of one actor process.

Some environments are dear to create (ScienceWorld starts a JVM, TextWorld loads a game), so an
actor keeps up to ``max_idle`` idle instances per (name, options) and hands them to the next
episode, which resets them. An instance is only reused after an episode that ended normally; after
an error or a cancellation it is closed. Not thread-safe; one pool per event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import structlog

from leafe.envs.base import Env

__all__ = ["EnvFactory", "EnvPool", "EnvPoolKey"]

log = structlog.get_logger(__name__)

EnvFactory = Callable[..., Env]
"""``factory(name, **options) -> Env`` (``leafe.envs.registry.make_env``)."""
EnvPoolKey = tuple[str, bytes]


def _key(name: str, options: Mapping[str, Any]) -> EnvPoolKey:
    # Canonical JSON: options may nest tables (e.g. humaneval's ``sandbox``), which are not
    # hashable.
    return name, msgspec.json.encode(options, order="sorted")


class EnvPool:
    """Idle environments by (name, options); ``acquire`` builds one when none is idle."""

    def __init__(self, factory: EnvFactory, *, max_idle: int = 4) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle = {max_idle}: must be >= 0")
        self.factory = factory
        self.max_idle = max_idle
        self._idle: dict[EnvPoolKey, list[Env]] = {}
        self.created = 0
        """Instances built so far."""

    async def acquire(
        self, name: str, options: Mapping[str, Any], *, in_thread: bool = False
    ) -> Env:
        """An idle instance of ``name`` with ``options``, or a new one (built in a thread if
        asked)."""
        idle = self._idle.get(_key(name, options))
        if idle:
            return idle.pop()
        if in_thread:
            env = await asyncio.to_thread(self.factory, name, **options)
        else:
            env = self.factory(name, **options)
        self.created += 1
        return env

    def release(self, env: Env, name: str, options: Mapping[str, Any], *, reusable: bool) -> None:
        """Return ``env`` for reuse, or close it (not reusable, or the pool is full)."""
        idle = self._idle.setdefault(_key(name, options), [])
        if reusable and len(idle) < self.max_idle:
            idle.append(env)
            return
        _close(env)

    def close(self) -> None:
        """Close every idle instance."""
        for envs in self._idle.values():
            for env in envs:
                _close(env)
        self._idle.clear()


def _close(env: Env) -> None:
    try:
        env.close()
    except Exception as e:  # closing must not mask the episode's own outcome; say so and go on
        log.warning(
            "actor.env.close_failed",
            env=getattr(env, "name", "?"),
            error=f"{type(e).__name__}: {e}",
        )
