"""bench/actor_trees.py's bookkeeping on trees a scripted engine grows (no model, no server): the digest
names the trees whatever order they finish in, and the engine table counts every request once."""

from __future__ import annotations

import random

import msgspec
import pytest

from actors.fakes import ByteChatTokenizer, ScriptedEngine
from bench.actor_trees import _grow, engine_usage, tree_digest
from protocol.events import Reflection, Step

pytestmark = pytest.mark.anyio


def engine() -> ScriptedEngine:
    # always "up": never solves, so each tree reflects and branches until its budget
    return ScriptedEngine(default_action="<action>up</action>", record=False)


async def test_the_digest_names_the_trees_not_the_order_they_were_grown_in() -> None:
    one = await _grow(engine(), ByteChatTokenizer(), trees=2, concurrency=1, first_room=0)
    two = await _grow(engine(), ByteChatTokenizer(), trees=2, concurrency=2, first_room=0)
    assert tree_digest(one) == tree_digest(two) == tree_digest(random.Random(0).sample(one, len(one)))
    other = await _grow(engine(), ByteChatTokenizer(), trees=2, concurrency=1, first_room=1)
    assert tree_digest(other) != tree_digest(one)
    step = next(i for i, e in enumerate(one) if isinstance(e, Step))
    changed = [*one[:step], msgspec.structs.replace(one[step], raw_text="down"), *one[step + 1 :]]
    assert tree_digest(changed) != tree_digest(one)


async def test_every_request_is_counted_once_by_kind() -> None:
    events = await _grow(engine(), ByteChatTokenizer(), trees=2, concurrency=2, first_room=0)
    usage = engine_usage(events)
    steps = [e for e in events if isinstance(e, Step)]
    assert usage["root_step"]["requests"] + usage["branch_step"]["requests"] == len(steps)
    assert usage["reflection"]["requests"] == sum(isinstance(e, Reflection) for e in events) > 0
    assert usage["branch_step"]["requests"] > 0 and 0 < usage["branch_step"]["cache_share"] < 1
