"""The oracle reflection source: the environment names tau and e, the tree goes on as with the model's."""

from __future__ import annotations

import pytest

from actors.config import ExplorerConfig
from actors.episode import EpisodeSpec, ListSink
from actors.explorer import Explorer
from actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from envs.base import EnvError
from envs.sokoban import SokobanConfig, SokobanEnv
from protocol.events import Branch, Reflection, Step
from protocol.prompt import HistoryEntry

pytestmark = pytest.mark.anyio
ROOMS = SokobanConfig(height=7, width=7, min_solution_len=3, max_solution_len=6, max_steps=20)


def spec(task_id: str) -> EpisodeSpec:
    return EpisodeSpec(
        run_id="r1", episode_id="o1", actor_id="a", task_key="k", env="sokoban", task_id=task_id
    )


async def test_oracle_reflections_come_from_the_solver_not_the_model() -> None:
    """A policy that wastes moves reflects through the solver: no reflection request reaches the engine,
    each Reflection (source oracle, no tokens) equals the oracle's verdict on the logged path, and the
    branch opens at that tau with e in context."""
    env = SokobanEnv(ROOMS)
    task_id = env.tasks("train")[0]
    engine = ScriptedEngine(default_action="<action>down</action>")
    sink = ListSink()
    config = ExplorerConfig.for_env("sokoban", {"reflection_source": "oracle", "horizon": 4, "k": 0})
    await Explorer(
        engine=engine, tokenizer=ByteChatTokenizer(), env=env, config=config, sink=sink, spec=spec(task_id)
    ).run()
    reflections = [e for e in sink.events if isinstance(e, Reflection)]
    assert reflections and all(c.kind == "action" for c in engine.calls)
    steps = [e for e in sink.events if isinstance(e, Step)]
    for refl in reflections:
        assert refl.source == "oracle" and refl.token_ids == [] and refl.parse_ok
        path = [s for s in steps if s.branch_id == refl.branch_id and s.seq < refl.seq]
        history = [HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path]
        verdict = env.oracle_reflection(task_id, history)
        assert (refl.tau, refl.experience) == (
            verdict.tau,
            verdict.experience,
        ) and refl.raw_text == verdict.experience
        assert "moving down" in refl.experience or "no valid move" in refl.experience
    branch = next(e for e in sink.events if isinstance(e, Branch))
    first = next(s for s in steps if s.branch_id == branch.branch_id)
    assert branch.tau == reflections[0].tau and first.experience_in_context
    assert branch.experience == reflections[0].experience


async def test_an_env_without_an_oracle_is_refused_when_the_explorer_is_built() -> None:
    """The corridor has no oracle: building the explorer says so (the config check covers named envs)."""
    with pytest.raises(EnvError, match="no reflection oracle"):
        Explorer(
            engine=ScriptedEngine(),
            tokenizer=ByteChatTokenizer(),
            env=CorridorEnv(),
            config=ExplorerConfig(reflection_source="oracle"),
            sink=ListSink(),
            spec=spec("corridor/train/00001"),
        )
