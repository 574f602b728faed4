"""The oracle reflection source: the environment names tau and e, the tree goes on as with the
model's."""

from __future__ import annotations

import msgspec
import pytest

from leafe.actors.config import ExplorerConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.envs.base import EnvError
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.protocol.events import Branch, Reflection, Step
from leafe.protocol.prompt import HistoryEntry, prompt_sha256

pytestmark = pytest.mark.anyio
ROOMS = SokobanConfig(height=7, width=7, min_solution_len=3, max_solution_len=6, max_steps=20)


def spec(task_id: str) -> EpisodeSpec:
    return EpisodeSpec(
        run_id="r1", episode_id="o1", actor_id="a", task_key="k", env="sokoban", task_id=task_id
    )


async def test_oracle_reflections_come_from_the_solver_not_the_model() -> None:
    """A policy that wastes moves reflects through the solver: no reflection request reaches the
    engine, each Reflection (source oracle, no tokens) equals the oracle's verdict on the logged
    path, and the branch opens at that tau with e in context."""
    env = SokobanEnv(ROOMS)
    task_id = env.tasks("train")[0]
    engine = ScriptedEngine(default_action="<action>down</action>")
    sink = ListSink()
    config = ExplorerConfig.for_env(
        "sokoban", {"reflection_source": "oracle", "horizon": 4, "k": 0}
    )
    await Explorer(
        engine=engine,
        tokenizer=ByteChatTokenizer(),
        env=env,
        config=config,
        sink=sink,
        spec=spec(task_id),
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
        assert (
            refl.oracle_action == verdict.action
            and f"move {verdict.action} instead" in refl.experience
        )
    branch = next(e for e in sink.events if isinstance(e, Branch))
    first = next(s for s in steps if s.branch_id == branch.branch_id)
    assert branch.tau == reflections[0].tau and first.experience_in_context
    assert branch.experience == reflections[0].experience


async def test_an_env_without_an_oracle_is_refused_when_the_explorer_is_built() -> None:
    """The corridor has no oracle: building the explorer says so (the config check covers named
    envs)."""
    with pytest.raises(EnvError, match="no reflection oracle"):
        Explorer(
            engine=ScriptedEngine(),
            tokenizer=ByteChatTokenizer(),
            env=CorridorEnv(),
            config=ExplorerConfig(reflection_source="oracle"),
            sink=ListSink(),
            spec=spec("corridor/train/00001"),
        )


async def test_oracle_labels_sit_beside_model_reflections_and_the_branch_follows_the_model() -> (
    None
):
    """With ``oracle_labels`` the policy still reflects (its request reaches the engine, its tau and
    e open the branch), and each Reflection also carries the oracle's verdict on the same logged
    history and the digest of the reflection prompt the engine was sent."""
    env = SokobanEnv(ROOMS)
    task_id = env.tasks("train")[0]
    model_answer = "<step>2</step><experience>Push the box first.</experience>"
    engine = ScriptedEngine(default_action="<action>down</action>", default_reflection=model_answer)
    sink = ListSink()
    config = ExplorerConfig.for_env("sokoban", {"oracle_labels": True, "horizon": 4, "k": 0})
    await Explorer(
        engine=engine,
        tokenizer=ByteChatTokenizer(),
        env=env,
        config=config,
        sink=sink,
        spec=spec(task_id),
    ).run()
    reflections = [e for e in sink.events if isinstance(e, Reflection)]
    requests = [c for c in engine.calls if c.kind == "reflection"]
    assert reflections and len(requests) == len(reflections)
    steps = [e for e in sink.events if isinstance(e, Step)]
    for refl, request in zip(reflections, requests, strict=True):
        assert refl.source == "model" and refl.raw_text == model_answer and refl.token_ids
        assert (refl.tau, refl.experience) == (2, "Push the box first.")
        path = [s for s in steps if s.branch_id == refl.branch_id and s.seq < refl.seq]
        history = [HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path]
        verdict = env.oracle_reflection(task_id, history)
        assert verdict.experience and refl.oracle_experience == verdict.experience
        assert refl.oracle_tau == verdict.tau and refl.oracle_tau != refl.tau
        assert (
            refl.oracle_action == verdict.action
            and f"move {verdict.action} instead" in verdict.experience
        )
        assert refl.prompt_sha256 == prompt_sha256(request.input_ids)
    branch = next(e for e in sink.events if isinstance(e, Branch))
    assert (branch.tau, branch.experience) == (2, "Push the box first.")


async def test_without_oracle_labels_model_reflections_carry_no_verdict() -> None:
    """The default: no oracle is asked; the new fields keep their defaults (what old logs decode
    to)."""
    env = SokobanEnv(ROOMS)
    task_id = env.tasks("train")[0]
    engine = ScriptedEngine(default_action="<action>down</action>")
    sink = ListSink()
    config = ExplorerConfig.for_env("sokoban", {"horizon": 4, "k": 0})
    await Explorer(
        engine=engine,
        tokenizer=ByteChatTokenizer(),
        env=env,
        config=config,
        sink=sink,
        spec=spec(task_id),
    ).run()
    reflections = [e for e in sink.events if isinstance(e, Reflection)]
    assert reflections
    assert all(
        r.oracle_tau is None and r.oracle_experience == "" and r.prompt_sha256 for r in reflections
    )


async def test_oracle_labels_on_an_env_without_an_oracle_is_refused() -> None:
    """The corridor has no oracle: labels cannot be asked for."""
    with pytest.raises(EnvError, match="no reflection oracle"):
        Explorer(
            engine=ScriptedEngine(),
            tokenizer=ByteChatTokenizer(),
            env=CorridorEnv(),
            config=ExplorerConfig(oracle_labels=True),
            sink=ListSink(),
            spec=spec("corridor/train/00001"),
        )


async def test_oracle_labels_change_nothing_but_the_labels() -> None:
    """The same episode with and without labels: identical events once the label fields are cleared
    (the oracle touches neither the env, nor the sampling seeds, nor the tree)."""

    async def run(labels: bool) -> list:
        env = SokobanEnv(ROOMS)
        engine = ScriptedEngine(default_action="<action>down</action>")
        sink = ListSink()
        config = ExplorerConfig.for_env("sokoban", {"oracle_labels": labels, "horizon": 4, "k": 2})
        await Explorer(
            engine=engine,
            tokenizer=ByteChatTokenizer(),
            env=env,
            config=config,
            sink=sink,
            spec=spec(env.tasks("train")[1]),
            clock=lambda: 0.0,
        ).run()
        return sink.events

    plain, labelled = await run(False), await run(True)
    assert any(isinstance(e, Reflection) and e.oracle_tau is not None for e in labelled)
    cleared = [
        msgspec.structs.replace(e, oracle_tau=None, oracle_experience="", oracle_action="")
        if isinstance(e, Reflection)
        else e
        for e in labelled
    ]
    # each event's dedupe nonce is random: compared without it
    assert [msgspec.structs.replace(e, msg_nonce="") for e in cleared] == [
        msgspec.structs.replace(e, msg_nonce="") for e in plain
    ]
