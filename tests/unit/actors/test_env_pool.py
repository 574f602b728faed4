"""The actor's environment pool: reuse after clean episodes, close otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from leafe.actors.env_pool import EnvPool
from leafe.actors.fakes import CorridorEnv

pytestmark = pytest.mark.anyio


def factory(name: str, **options: Any) -> CorridorEnv:
    return CorridorEnv(**options)


async def test_clean_envs_are_reused_per_name_and_options() -> None:
    """A released, reusable env is handed out again for the same options, never for other
    options."""
    pool = EnvPool(factory, max_idle=2)
    a = await pool.acquire("corridor", {"supports_snapshot": True})
    pool.release(a, "corridor", {"supports_snapshot": True}, reusable=True)
    assert await pool.acquire("corridor", {"supports_snapshot": True}) is a
    b = await pool.acquire("corridor", {"supports_snapshot": False}, in_thread=True)
    assert b is not a and not b.supports_snapshot and pool.created == 2


async def test_unclean_or_surplus_envs_are_closed() -> None:
    """Not reusable (error, cancellation) or beyond max_idle: closed; close() closes the idle
    ones."""
    pool = EnvPool(factory, max_idle=1)
    envs = [await pool.acquire("corridor", {}) for _ in range(3)]
    pool.release(envs[0], "corridor", {}, reusable=False)
    pool.release(envs[1], "corridor", {}, reusable=True)
    pool.release(envs[2], "corridor", {}, reusable=True)
    assert [e.closed for e in envs] == [True, False, True]
    pool.close()
    assert envs[1].closed


def test_options_with_nested_tables_are_pooled() -> None:
    """Options holding a table (humaneval's ``sandbox``) are a valid pool key; equal options share
    envs."""
    from leafe.actors.env_pool import _key

    a = _key("humaneval", {"sandbox": {"wall_s": 5}, "max_turns": 4})
    b = _key("humaneval", {"max_turns": 4, "sandbox": {"wall_s": 5}})
    assert a == b and hash(a) == hash(b)
    assert a != _key("humaneval", {"sandbox": {"wall_s": 6}, "max_turns": 4})
