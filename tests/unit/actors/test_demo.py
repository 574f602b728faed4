"""Demonstration episodes: the expert's steps logged exactly as a policy rollout would log them, and
the Early Experience alternatives as one-step branches off the expert path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from leafe.actors.config import RolloutConfig
from leafe.actors.demo import DemoRunner
from leafe.actors.demo_config import DemoConfig
from leafe.actors.early import SELF_REFLECTION_QUESTION
from leafe.actors.engine import Completion, SamplingParams
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.fakes import ByteChatTokenizer
from leafe.actors.parsing import parse_action
from leafe.actors.rollout import run_rollout
from leafe.envs.base import EnvError, Reset, Transition
from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.sokoban.env import SokobanEnv
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.events import Branch, EpisodeStarted, Outcome, Reflection, Rollback, Step
from leafe.protocol.prompt import ChatTokenizer
from tests.support.demos import (
    SMALL_SOKOBAN,
    ProposalEngine,
    check_demo_episode,
    demo_events,
    reflection_text,
)

pytestmark = pytest.mark.anyio
BYTES = ByteChatTokenizer()


@pytest.fixture(scope="module")
def smol(tiny_dir: Path) -> HFChatTokenizer:
    """SmolLM2's tokenizer (the tiny model ships it)."""
    return HFChatTokenizer.from_dir(tiny_dir)


def steps(events: list[Any], branch: str = "b0") -> list[Step]:
    return [e for e in events if isinstance(e, Step) and e.branch_id == branch]


class ExpertEngine:
    """Answers the expert's moves in order, shaped like an engine: text without the stop string, ids
    of the whole generated answer (byte tokenizer)."""

    def __init__(self, moves: list[str]) -> None:
        self.moves = iter(moves)

    async def generate(
        self, input_ids: list[int], params: SamplingParams, **_: Any
    ) -> list[Completion]:
        move = next(self.moves)
        return [
            Completion(text=move, output_ids=list(f"{move}</action>".encode()), weight_version="v0")
        ]

    async def weight_version(self) -> str:
        return "v0"


async def test_expert_steps_are_exactly_what_a_rollout_answering_them_logs() -> None:
    """A rollout whose policy answers the expert's moves logs the same prompts (digests),
    completions (text and ids), actions and observations as the demonstration of that task."""
    env = SokobanEnv(SMALL_SOKOBAN)
    for index in range(4):
        task_id = f"sokoban/train/{index}"
        demo = await demo_events(index, tokenizer=BYTES, env=env)
        sink = ListSink()
        spec = EpisodeSpec(
            run_id="r1", episode_id="x", actor_id="a", task_key="k", env="sokoban", task_id=task_id
        )
        await run_rollout(
            engine=ExpertEngine(env.demonstration(task_id)),
            tokenizer=BYTES,
            env=env,
            spec=spec,
            config=RolloutConfig.for_env("sokoban"),
            sink=sink,
        )
        fields = (
            "t",
            "action",
            "raw_text",
            "token_ids",
            "observation",
            "prompt_sha256",
            "prompt_tokens",
            "done",
        )
        assert [[getattr(s, f) for f in fields] for s in steps(demo)] == [
            [getattr(s, f) for f in fields] for s in steps(sink.events)
        ]
        assert all(s.parse_ok and s.policy_version == "expert" for s in steps(demo))
        check_demo_episode(demo)


async def test_tag_answers_are_the_served_tokens_of_the_action_and_its_stop(
    smol: HFChatTokenizer,
) -> None:
    """With ``<action>`` prefilled, an expert step's ids are SmolLM2's tokens of ``up</action>`` (no
    EOS: the stop string ends it), the text is ``up``, and the policy's parser reads ``up`` from
    it."""
    events = await demo_events(0, tokenizer=smol)
    started = events[0]
    assert isinstance(started, EpisodeStarted) and started.response_prefix == "<action>"
    for step in steps(events):
        assert step.action is not None and step.raw_text == step.action
        assert step.token_ids == smol.tokenizer.encode(
            f"{step.action}</action>", add_special_tokens=False
        )
        assert (
            parse_action("<action>" + step.raw_text, ["up", "down", "left", "right"]).action
            == step.action
        )


async def test_fenced_answers_end_with_the_end_of_turn_token(smol: HFChatTokenizer) -> None:
    """HumanEval: the completion is the function in a fenced block; its ids end with SmolLM2's EOS,
    as an engine's completion without a stop string does; the demonstration solves the problem."""
    env = HumanEvalEnv(HumanEvalConfig(num_test=64))
    task_id = env.tasks("train")[0]
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="r1", episode_id="h", actor_id="a", task_key="k", env="humaneval", task_id=task_id
    )
    demo = DemoConfig.for_env("humaneval")
    runner = DemoRunner(
        tokenizer=smol,
        env=env,
        spec=spec,
        rollout=RolloutConfig.for_env("humaneval"),
        demo=demo,
        sink=sink,
    )
    summary = await runner.run()
    (step,) = steps(sink.events)
    assert summary.success and step.success
    assert step.raw_text.startswith("```python\n") and step.raw_text.endswith("\n```")
    assert step.token_ids[-1] == smol.tokenizer.eos_token_id == 2
    assert smol.decode(step.token_ids) == step.raw_text
    assert step.action == step.raw_text.removeprefix("```python\n").removesuffix("```").rstrip()


async def test_no_demonstration_of_a_test_task_ever_reaches_the_log() -> None:
    """A test-split spec is refused before any event; a test task id under a train spec ends with an
    error outcome and no step."""
    with pytest.raises(EnvError, match="train split only"):
        await demo_events(0, tokenizer=BYTES, split="test")
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="r1",
        episode_id="e",
        actor_id="a",
        task_key="k",
        env="sokoban",
        task_id="sokoban/test/0",
    )
    runner = DemoRunner(
        tokenizer=BYTES,
        env=SokobanEnv(SMALL_SOKOBAN),
        spec=spec,
        rollout=RolloutConfig.for_env("sokoban"),
        demo=DemoConfig(),
        sink=sink,
    )
    summary = await runner.run()
    assert not summary.success and "train split only" in summary.error
    assert not steps(sink.events)
    outcome = next(e for e in sink.events if isinstance(e, Outcome))
    assert outcome.reason == "error"


class FreeTextEnv:
    """Accepts any command; its valid-action list misses the expert's (like ScienceWorld's)."""

    name = "freetext"
    instructions = "Answer with <action>command</action>."
    supports_snapshot = False

    def tasks(self, split: str) -> list[str]:
        return [f"freetext/{split}/0"]

    def reset(self, task_id: str) -> Reset:
        self.done = False
        return Reset(task="Go north.", observation="You are south.")

    def step(self, action: str) -> Transition:
        ok = action == "go north"
        return Transition(observation=f"did {action}", done=ok, success=ok)

    def valid_actions(self) -> list[str]:
        return ["go", "look"]

    def demonstration(self, task_id: str) -> list[str]:
        return ["go north"]

    def snapshot(self) -> None:
        raise EnvError("no snapshots")

    def restore(self, snapshot: object) -> str:
        raise EnvError("no snapshots")

    def close(self) -> None:
        pass


async def test_an_expert_action_the_parser_would_misread_is_executed_but_not_parse_ok() -> None:
    """The parser would read 'go' from '<action>go north</action>': the step still executes 'go
    north' (the demonstration solves the task) but is logged parse_ok=False and counted."""
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="r1", episode_id="f", actor_id="a", task_key="k", env="freetext", task_id="t"
    )
    runner = DemoRunner(
        tokenizer=BYTES,
        env=FreeTextEnv(),  # type: ignore[arg-type]
        spec=spec,
        rollout=RolloutConfig(response_prefix="<action>"),
        demo=DemoConfig(),
        sink=sink,
    )
    summary = await runner.run()
    (step,) = steps(sink.events)
    assert step.action == "go north" and not step.parse_ok and step.success
    assert summary.success and summary.parse_failures == 1


async def test_alternatives_are_executed_from_the_expert_state_and_logged_as_branches() -> None:
    """Each distinct parseable alternative that is not the expert's move becomes one branch whose
    step carries the observation that move really produces from that state; the expert path still
    solves."""
    env = SokobanEnv(SMALL_SOKOBAN)
    branches = 0
    for index in range(6):
        events = await demo_events(index, tokenizer=BYTES, alternatives=5, seed=index)
        check_demo_episode(events)
        branches += sum(isinstance(e, Branch) for e in events)
        expert = steps(events)
        assert any(isinstance(e, Outcome) and e.branch_id == "b0" and e.success for e in events)
        for branch in (e for e in events if isinstance(e, Branch)):
            (alt,) = steps(events, branch.branch_id)
            assert alt.action != expert[branch.tau].action and alt.policy_version == "v3"
            env.reset(f"sokoban/train/{index}")
            for s in expert[: branch.tau]:
                env.step(s.action or "")
            assert env.step(alt.action or "").observation == alt.observation
        actions = [
            (b.tau, steps(events, b.branch_id)[0].action) for b in events if isinstance(b, Branch)
        ]
        assert len(actions) == len(set(actions))
    assert branches >= 6


async def test_alternatives_roll_back_by_replay_without_snapshots() -> None:
    """Without snapshots the same alternatives are reached by reset + replay (Rollback method
    replay)."""

    class NoSnapshots(SokobanEnv):
        supports_snapshot = False

    with_snaps = await demo_events(3, tokenizer=BYTES, alternatives=4, seed=3)
    replayed = await demo_events(
        3, tokenizer=BYTES, alternatives=4, seed=3, env=NoSnapshots(SMALL_SOKOBAN)
    )
    check_demo_episode(replayed)
    rollbacks = [e for e in replayed if isinstance(e, Rollback)]
    assert rollbacks and all(r.method == "replay" for r in rollbacks)
    assert [(s.branch_id, s.observation) for s in replayed if isinstance(s, Step)] == [
        (s.branch_id, s.observation) for s in with_snaps if isinstance(s, Step)
    ]


async def test_self_reflection_sees_both_outcomes_and_is_logged_as_the_branch_reflection() -> None:
    """With self-reflection each branch's Reflection holds the policy's text (source model); the
    request showed both actions and their outcomes, was prefilled with <think> and stopped at
    </think>."""
    engine = ProposalEngine(seed=1, tokenizer=BYTES)
    events = await demo_events(
        1, tokenizer=BYTES, alternatives=5, self_reflection=True, engine=engine, seed=1
    )
    check_demo_episode(events)
    reflections = [e for e in events if isinstance(e, Reflection)]
    assert reflections and all(r.source == "model" and r.parse_ok for r in reflections)
    assert all(r.experience == " ".join(r.raw_text.split()) for r in reflections)
    asks = [
        (ids, params)
        for ids, params, _ in engine.calls
        if SELF_REFLECTION_QUESTION in BYTES.decode(ids)
    ]
    assert len(asks) == len(reflections)
    for (ids, params), refl in zip(asks, reflections, strict=True):
        text = BYTES.decode(ids)
        assert text.endswith("<think>") and params.stop == ["</think>"]
        assert refl.raw_text == reflection_text(sum(ids))
        alt = next(e for e in events if isinstance(e, Step) and e.seq == refl.seq + 3)
        assert f"Another action: {alt.action}" in text and alt.observation in text


async def test_without_self_reflection_the_reflection_is_an_empty_marker() -> None:
    """IWM-only alternatives still need a Reflection before each Branch: empty, source none."""
    events = await demo_events(2, tokenizer=BYTES, alternatives=5, seed=2)
    reflections = [e for e in events if isinstance(e, Reflection)]
    assert reflections and all(
        r.source == "none" and not r.raw_text and not r.experience for r in reflections
    )


def test_demo_config_checks() -> None:
    """Self-reflection needs alternatives; alternatives need an engine; HumanEval answers in a
    fence."""
    with pytest.raises(ValueError, match="self_reflection"):
        DemoConfig(self_reflection=True)
    assert DemoConfig.for_env("humaneval").answer_format == "fence"
    assert DemoConfig.for_env("sokoban").answer_format == "tag"
    with pytest.raises(ValueError, match="need an engine"):
        DemoRunner(
            tokenizer=BYTES,
            env=SokobanEnv(SMALL_SOKOBAN),
            spec=EpisodeSpec(
                run_id="r", episode_id="e", actor_id="a", task_key="k", env="sokoban", task_id="x"
            ),
            rollout=RolloutConfig(),
            demo=DemoConfig(alternatives=2),
            sink=ListSink(),
        )


def test_end_of_turn_is_the_served_eos(smol: ChatTokenizer) -> None:
    """The chat template's end of an assistant turn is SmolLM2's EOS (what its engine stops on)."""
    from leafe.protocol.answers import end_of_turn_id

    assert end_of_turn_id(smol) == 2
