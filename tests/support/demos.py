"""Demonstration episodes for the tests: real Sokoban demonstrations played by
``leafe.actors.demo.DemoRunner``, an engine that proposes varied alternatives, and the structural
checks of a demo episode's events."""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from leafe.actors.config import RolloutConfig
from leafe.actors.demo import DemoRunner
from leafe.actors.demo_config import DemoConfig
from leafe.actors.early import SELF_REFLECTION_QUESTION
from leafe.actors.engine import Completion, SamplingParams
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.fakes import ByteChatTokenizer
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.protocol.events import (
    EXPERT_VERSION,
    ROOT_BRANCH,
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
)
from leafe.protocol.prompt import ChatTokenizer

__all__ = [
    "SMALL_SOKOBAN",
    "ProposalEngine",
    "check_demo_episode",
    "demo_episodes",
    "demo_events",
    "demo_pool",
    "play_demo",
    "reflection_text",
]

SMALL_SOKOBAN = SokobanConfig(height=5, width=5, num_boxes=1, max_solution_len=2, max_steps=6)
"""The default preset's rooms (``services/run/presets.py``)."""

PROPOSALS = ("up", "down", "left", "right", "up", "dance", "")
"""What the fake policy answers after ``<action>`` (repeats and unparseable answers included)."""


def reflection_text(prompt_digest: int) -> str:
    """The fake policy's self-reflection (deterministic in the prompt)."""
    return f" The expert move keeps the box pushable (#{prompt_digest % 997}). "


class ProposalEngine:
    """An ``Engine`` whose ``n`` completions are seeded picks from :data:`PROPOSALS` (engine-shaped:
    the stop string cut from the text, kept in the ids), and which answers self-reflection
    prompts."""

    def __init__(self, *, seed: int = 0, tokenizer: ChatTokenizer, version: str = "v3") -> None:
        self.rng = random.Random(seed)
        self.tok = tokenizer
        self.version = version
        self.calls: list[tuple[list[int], SamplingParams, int]] = []

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
    ) -> list[Completion]:
        """``n`` completions; ids are UTF-8 bytes of the text (plus the stop string when one ended
        it)."""
        self.calls.append((list(input_ids), params, n))
        if SELF_REFLECTION_QUESTION in self.tok.decode(input_ids):
            text = reflection_text(sum(input_ids))
            return [self._completion(text, text + "</think>", len(input_ids))]
        out = []
        for _ in range(n):
            word = self.rng.choice(PROPOSALS)
            out.append(self._completion(word, word + "</action>", len(input_ids)))
        return out

    def _completion(self, text: str, generated: str, prompt_tokens: int) -> Completion:
        ids = list(generated.encode())
        return Completion(
            text=text, output_ids=ids, weight_version=self.version, prompt_tokens=prompt_tokens
        )

    async def weight_version(self) -> str:
        """The fixed version."""
        return self.version


def play_demo(task_index: int, **kwargs: Any) -> list[EpisodeEvent]:
    """:func:`demo_events`, run to completion (synchronous callers: Hypothesis, plain tests)."""
    return asyncio.run(demo_events(task_index, **kwargs))


async def demo_events(
    task_index: int,
    *,
    tokenizer: ChatTokenizer,
    env: Any = None,
    alternatives: int = 0,
    self_reflection: bool = False,
    seed: int = 0,
    run_id: str = "r1",
    episode_id: str | None = None,
    split: str = "train",
    rollout: RolloutConfig | None = None,
    engine: Any = None,
) -> list[EpisodeEvent]:
    """The events of one demonstration of ``sokoban/<split>/<task_index>`` (small rooms by
    default)."""
    env = env or SokobanEnv(SMALL_SOKOBAN)
    task_id = f"sokoban/{split}/{task_index}"
    spec = EpisodeSpec(
        run_id=run_id,
        episode_id=episode_id or f"demo{task_index}.s{seed}",
        actor_id="actor-t",
        task_key=f"k{task_index}",
        env="sokoban",
        task_id=task_id,
        split=split,
        seed=seed,
        mode="demo",
    )
    sink = ListSink()
    runner = DemoRunner(
        tokenizer=tokenizer,
        env=env,
        spec=spec,
        rollout=rollout or RolloutConfig.for_env("sokoban"),
        demo=DemoConfig(alternatives=alternatives, self_reflection=self_reflection),
        sink=sink,
        engine=engine or (ProposalEngine(seed=seed, tokenizer=tokenizer) if alternatives else None),
    )
    await runner.run()
    return list(sink.events)


def check_demo_episode(events: Sequence[EpisodeEvent]) -> None:
    """Structural invariants of a demo episode: the expert path b0, and one-step alternative
    branches (Reflection -> Rollback -> Branch -> Step -> Outcome) off it, the env returned to the
    expert path."""
    started, fin = events[0], events[-1]
    assert (
        isinstance(started, EpisodeStarted) and started.mode == "demo" and started.split == "train"
    )
    assert isinstance(fin, EpisodeFinished)
    assert [e.seq for e in events] == list(range(len(events)))
    expert = [e for e in events if isinstance(e, Step) and e.branch_id == ROOT_BRANCH]
    assert [s.t for s in expert] == list(range(len(expert)))
    assert all(s.policy_version == EXPERT_VERSION for s in expert)
    for i, e in enumerate(events):
        if isinstance(e, Branch):
            refl, back, step, outcome = events[i - 2], events[i - 1], events[i + 1], events[i + 2]
            assert isinstance(refl, Reflection) and refl.event_id == e.reflection_event_id
            assert refl.trigger == "alternative" and refl.tau == e.tau and refl.at_t == e.tau + 1
            assert (
                isinstance(back, Rollback) and back.tau == e.tau and back.from_branch == ROOT_BRANCH
            )
            assert e.parent_branch_id == ROOT_BRANCH and e.depth == 1 and e.experience == ""
            assert isinstance(step, Step) and step.branch_id == e.branch_id and step.t == e.tau
            assert (
                step.prompt_sha256 == expert[e.tau].prompt_sha256 and not step.experience_in_context
            )
            assert isinstance(outcome, Outcome) and outcome.branch_id == e.branch_id
            assert outcome.steps == e.tau + 1
    outcomes = Counter(e.branch_id for e in events if isinstance(e, Outcome))
    assert set(outcomes.values()) == {1}
    steps = [e for e in events if isinstance(e, Step)]
    assert fin.actions == len(steps) and fin.branches == len(outcomes)
    assert fin.reflections == sum(isinstance(e, Reflection) for e in events)
    assert fin.replay_steps == sum(e.replay_steps for e in events if isinstance(e, Rollback))
    assert fin.parse_failures == sum(not s.parse_ok for s in steps)


@functools.cache
def demo_pool(size: int = 18) -> tuple[tuple[EpisodeEvent, ...], ...]:
    """``size`` real demonstrations (byte tokenizer, run ``r1``): plain, with alternatives, with
    self-reflection; built once per process (each takes milliseconds, but Hypothesis draws many
    logs)."""
    tok = ByteChatTokenizer()
    pool = []
    for i in range(size):
        alternatives = (0, 3, 5)[i % 3]
        reflect = alternatives > 0 and i % 2 == 0
        events = play_demo(
            i, tokenizer=tok, alternatives=alternatives, self_reflection=reflect, seed=i
        )
        pool.append(tuple(events))
    return tuple(pool)


def demo_episodes(max_size: int = 6) -> st.SearchStrategy[list[list[EpisodeEvent]]]:
    """A few distinct demonstrations of the pool (per-episode streams)."""
    pool = demo_pool()
    indexes = st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=max_size, unique=True)
    return indexes.map(lambda ix: [list(pool[i]) for i in ix])
