"""Plain rollouts, the reflection prompt and event stamping."""

from __future__ import annotations

import pytest

from leafe.actors.config import RolloutConfig
from leafe.actors.episode import EpisodeRecorder, EpisodeSpec, ListSink
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.actors.rollout import run_rollout, run_rollouts
from leafe.protocol.events import Outcome, Step
from leafe.protocol.prompt import HistoryEntry, render_messages
from leafe.protocol.reflection import REFLECTION_QUESTION, render_reflection_messages
from leafe.protocol.tasks import episode_owner
from tests.support.event_checks import check_episode

SPEC = EpisodeSpec(
    run_id="r1",
    episode_id="k.a1",
    actor_id="a",
    task_key="k",
    env="corridor",
    task_id="corridor/test/00002",
    mode="eval",
    seed=10,
)


@pytest.mark.anyio
async def test_a_rollout_is_one_branch_without_reflection() -> None:
    """Steps until done or horizon, one Outcome, no Reflection/Rollback/Branch; logprobs
    recorded."""
    sink = ListSink()
    engine = ScriptedEngine(actions=["<action>left</action>"])
    summary = await run_rollout(
        engine=engine,
        tokenizer=ByteChatTokenizer(),
        env=CorridorEnv(),
        spec=SPEC,
        config=RolloutConfig(horizon=5),
        sink=sink,
    )
    check_episode(sink.events)
    assert [type(e).__name__ for e in sink.events] == [
        "EpisodeStarted",
        "Step",
        "Outcome",
        "EpisodeFinished",
    ]
    assert sink.events[1].logprobs is not None and not summary.success
    assert all(c.kind == "action" for c in engine.calls)


@pytest.mark.anyio
async def test_n_rollouts_form_a_group_with_distinct_episodes_and_seeds() -> None:
    """run_rollouts: n episodes <id>.s<i>@<actor>, seeds seed+i, one group of size n, each env
    closed."""
    sink, envs = ListSink(), []

    def factory() -> CorridorEnv:
        envs.append(CorridorEnv())
        return envs[-1]

    summaries = await run_rollouts(
        engine=ScriptedEngine(default_action="<action>wait</action>"),
        tokenizer=ByteChatTokenizer(),
        env_factory=factory,
        spec=SPEC,
        config=RolloutConfig(horizon=3),
        sink=sink,
        n=4,
    )
    assert [s.episode_id for s in summaries] == [f"k.a1.s{i}@a" for i in range(4)]
    assert {episode_owner(s.episode_id) for s in summaries} == {SPEC.actor_id}
    starts = [e for e in sink.events if type(e).__name__ == "EpisodeStarted"]
    assert sorted(e.seed for e in starts) == [10, 11, 12, 13]
    assert {(e.group_id, e.group_size) for e in starts} == {("k.a1", 4)}
    assert all(env.closed for env in envs) and len(envs) == 4
    for episode in {e.episode_id for e in sink.events}:
        check_episode([e for e in sink.events if e.episode_id == episode])
    assert all(o.reason == "horizon" for o in sink.events if isinstance(o, Outcome))
    assert sum(isinstance(e, Step) for e in sink.events) == 12


def test_reflection_prompt_shows_numbered_history_and_the_format() -> None:
    """The reflection prompt is the action prompt's task+history with the question and tag
    format."""
    history = [
        HistoryEntry("left", "<action>left</action>", "at 0", "you fell"),
        HistoryEntry(None, "?", "x", ""),
    ]
    messages = render_reflection_messages(
        instructions="rules", task="walk", history=history, observation="at 0", trigger="failure"
    )
    action = render_messages(instructions="rules", task="walk", history=history, observation="at 0")
    user = messages[-1].content
    assert messages[0] == action[0]
    assert user.startswith(action[-1].content.removesuffix("Your next action?").rstrip())
    assert "0. left -> you fell" in user and "1. (invalid: '?')" in user
    assert REFLECTION_QUESTION in user and "<step>N</step><experience>" in user
    assert "from 0 to 1" in user and "failed" in user and "Your next action?" not in user
    with pytest.raises(ValueError, match="at least one step"):
        render_reflection_messages(
            instructions="", task="", history=[], observation="", trigger="periodic"
        )


@pytest.mark.anyio
async def test_recorder_stamps_ids_seq_version_and_time() -> None:
    """Every emitted event gets seq 0,1,..., event_id <episode>.<seq>, the current version and
    clock."""
    sink = ListSink()
    rec = EpisodeRecorder(sink, run_id="r", episode_id="e.a2", actor_id="a", clock=lambda: 42.0)
    rec.policy_version = "v3"
    for t in range(2):
        await rec.emit(Outcome, branch_id=f"b{t}", success=False)
    assert [(e.seq, e.event_id, e.policy_version, e.ts) for e in sink.events] == [
        (0, "e.a2.000000", "v3", 42.0),
        (1, "e.a2.000001", "v3", 42.0),
    ]
