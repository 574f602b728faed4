"""The actor/replayer prompt contract with a prefilled answer start (``response_prefix``): the
materializer rebuilds the exact prompt ids the explorer sent, and samples show the whole answer."""

from __future__ import annotations

from typing import Any

import pytest

from leafe.actors.config import ExplorerConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.learner.materializers import make_materializer
from leafe.protocol.events import EpisodeStarted

pytestmark = pytest.mark.anyio

TOK = ByteChatTokenizer()


async def _episode(prefix: str) -> list[Any]:
    # With a prefix the engine only writes the continuation ("left</action>"): the prefix is in the
    # prompt.
    engine = ScriptedEngine(
        actions=["left</action>", "right</action>", "right</action>", "right</action>"],
        reflections=["<step>0</step><experience>Go right, the pit is left.</experience>"],
    )
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="r1",
        episode_id="task-1.a1",
        actor_id="a0",
        task_key="task-1",
        env="corridor",
        task_id="corridor/train/00001",
        seed=0,
    )
    config = ExplorerConfig(k=0, max_depth=2, response_prefix=prefix)
    await Explorer(
        engine=engine, tokenizer=TOK, env=CorridorEnv(), config=config, sink=sink, spec=spec
    ).run()
    assert all(
        bytes(c.input_ids).decode().endswith(prefix) for c in engine.calls if c.kind == "action"
    )
    return sink.events


async def test_prefilled_prefix_is_parsed_recorded_and_rebuilt_exactly() -> None:
    """The explorer parses prefix + continuation, records the prefix in EpisodeStarted, and every
    rebuilt prompt (prefix tokens included) matches the digest the actor recorded; targets stay the
    exact ids."""
    events = await _episode("<action>")
    started = events[0]
    assert isinstance(started, EpisodeStarted) and started.response_prefix == "<action>"
    steps = [e for e in events if type(e).__name__ == "Step"]
    assert [s.action for s in steps][:2] == ["left", "right"] and all(s.parse_ok for s in steps)
    fold = make_materializer("leafe", TOK, rehearsal_fraction=1.0)
    samples = [s for e in events for s in fold.apply(e)]
    assert fold.stats.prompt_mismatches == 0 and fold.stats.prompts_verified >= 1
    assert samples and any(s.kind == "cf" for s in samples)
    for s in samples:
        assert bytes(s.prompt_ids).decode().endswith("<action>")
        assert s.messages[s.target_turn].content.startswith("<action>")
        assert bytes(s.completion_ids).decode().endswith("</action>")
