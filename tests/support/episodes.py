"""Hypothesis strategies over synthetic episodes (explore trees, GRPO groups, whole logs), shared by
the property suites; the builders they wrap are ``actors/fake_episodes.py``."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import strategies as st

from leafe.actors.fake_episodes import (
    ExploreSpec,
    build_explore_episode,
    build_rollout_group,
    interleave,
)
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.prompt import ChatTokenizer

__all__ = ["event_logs", "explore_episodes", "explore_specs", "interleaved", "rollout_groups"]


@st.composite
def explore_specs(draw: st.DrawFn, *, abandoned: bool = True) -> ExploreSpec:
    """Shapes of explore episodes, from one-step successes to deep failing trees."""
    return ExploreSpec(
        seed=draw(st.integers(0, 2**31)),
        max_depth=draw(st.sampled_from([1, 2, 2, 3, 0])),
        budget=draw(st.integers(6, 30)),
        horizon=draw(st.integers(2, 8)),
        reflect_every=draw(st.sampled_from([0, 0, 2, 3])),
        p_success=draw(st.sampled_from([0.0, 0.15, 0.35, 0.8])),
        p_parse_fail=draw(st.sampled_from([0.0, 0.1, 0.4])),
        experience_scope=draw(st.sampled_from(["all", "first", "none"])),
        history_window=draw(st.sampled_from([0, 0, 2])),
        stop_on_success=draw(st.booleans()),
        truncate=draw(st.sampled_from([None, None, None, 0.3, 0.7])) if abandoned else None,
        mode=draw(st.sampled_from(["explore"] * 6 + ["eval"])),
    )


def explore_episodes(
    run_id: str = "r1",
    *,
    tokenizer: ChatTokenizer | None = None,
    abandoned: bool = True,
    prefix: str = "ep",
) -> st.SearchStrategy[list[EpisodeEvent]]:
    """Events of one explore episode (seq order)."""
    return st.builds(
        lambda spec, i: build_explore_episode(
            spec, run_id=run_id, episode_id=f"{prefix}{i}", tokenizer=tokenizer
        ),
        explore_specs(abandoned=abandoned),
        st.integers(0, 10**6),
    )


@st.composite
def rollout_groups(
    draw: st.DrawFn,
    run_id: str = "r1",
    *,
    tokenizer: ChatTokenizer | None = None,
    group_id: str | None = None,
) -> list[list[EpisodeEvent]]:
    """The episodes of one GRPO group (2..5 rollouts, sometimes with an abandoned first attempt)."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    return build_rollout_group(
        rng,
        run_id=run_id,
        group_id=group_id or f"g{draw(st.integers(0, 10**6))}",
        n=draw(st.integers(2, 5)),
        tokenizer=tokenizer,
        p_success=draw(st.sampled_from([0.0, 0.2, 0.5])),
        horizon=draw(st.integers(1, 6)),
        retry=draw(st.booleans()),
    )


@st.composite
def event_logs(
    draw: st.DrawFn,
    run_id: str = "r1",
    *,
    tokenizer: ChatTokenizer | None = None,
    max_episodes: int = 5,
    groups: bool = True,
) -> list[list[EpisodeEvent]]:
    """Per-episode event streams of a small run: explore trees and (optionally) rollout groups."""
    n = draw(st.integers(1, max_episodes))
    streams = [
        build_explore_episode(
            draw(explore_specs()), run_id=run_id, episode_id=f"ep{i}", tokenizer=tokenizer
        )
        for i in range(n)
    ]
    if groups:
        for k in range(draw(st.integers(0, 2))):
            streams += draw(rollout_groups(run_id, tokenizer=tokenizer, group_id=f"g{k}"))
    return streams


def interleaved(streams: Sequence[Sequence[EpisodeEvent]]) -> st.SearchStrategy[list[EpisodeEvent]]:
    """Random interleavings of ``streams`` that keep every episode's own order."""
    return st.randoms(use_true_random=False).map(lambda rng: interleave(streams, rng))
