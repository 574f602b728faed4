"""Independent checks of an episode's event stream, shared by the actor unit and property tests.

``rebuild_step_prompts`` rebuilds every Step's prompt from the events alone, exactly as the replayer
must (branch geometry of ``leafe.protocol.events``); ``check_episode`` asserts the stream's
structural invariants.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from leafe.protocol.events import (
    ROOT_BRANCH,
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
    event_id_for,
)
from leafe.protocol.prompt import HistoryEntry, render_messages
from leafe.protocol.samples import ChatMessage

__all__ = ["check_episode", "path_of", "rebuild_step_prompts"]


def _index(events: Sequence[EpisodeEvent]) -> tuple[dict[str, Branch], dict[str, dict[int, Step]]]:
    branches = {e.branch_id: e for e in events if isinstance(e, Branch)}
    steps: dict[str, dict[int, Step]] = {}
    for e in events:
        if isinstance(e, Step):
            steps.setdefault(e.branch_id, {})[e.t] = e
    return branches, steps


def path_of(branch_id: str, t: int, events: Sequence[EpisodeEvent]) -> list[Step]:
    """Steps ``0..t-1`` on ``branch_id``'s path, from the events alone."""
    branches, steps = _index(events)

    def at(b: str, i: int) -> Step:
        if b != ROOT_BRANCH and i < branches[b].tau:
            return at(branches[b].parent_branch_id, i)
        return steps[b][i]

    return [at(branch_id, i) for i in range(t)]


def rebuild_step_prompts(events: Sequence[EpisodeEvent]) -> list[tuple[Step, list[ChatMessage]]]:
    """Every Step with the messages rebuilt from the log (the contract the replayer implements)."""
    started = events[0]
    assert isinstance(started, EpisodeStarted)
    branches, _ = _index(events)
    out = []
    for e in events:
        if not isinstance(e, Step):
            continue
        path = path_of(e.branch_id, e.t, events)
        history = [HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path]
        observation = path[-1].observation if path else started.observation
        experience = branches[e.branch_id].experience if e.experience_in_context else None
        messages = render_messages(
            instructions=started.instructions,
            task=started.task,
            history=history,
            observation=observation,
            experience=experience,
            history_window=started.history_window,
        )
        out.append((e, messages))
    return out


def _check_ids(events: Sequence[EpisodeEvent]) -> None:
    assert [e.seq for e in events] == list(range(len(events)))
    episode = events[0].episode_id
    assert all(e.episode_id == episode for e in events)
    assert all(e.event_id == event_id_for(episode, e.seq) for e in events)
    assert isinstance(events[0], EpisodeStarted)
    assert isinstance(events[-1], EpisodeFinished)
    assert sum(isinstance(e, EpisodeStarted | EpisodeFinished) for e in events) == 2


def _check_branch(
    i: int, br: Branch, events: Sequence[EpisodeEvent], length: dict[str, int], restart: bool
) -> None:
    by_id = {e.event_id: e for e in events[:i]}
    refl = by_id.get(br.reflection_event_id)
    assert isinstance(refl, Reflection), f"{br.branch_id} names no earlier Reflection"
    assert refl.branch_id == br.parent_branch_id and br.tau == (0 if restart else refl.tau)
    assert refl.experience == br.experience and br.experience
    assert 0 <= br.tau < refl.at_t <= length[br.parent_branch_id]
    rollback = events[i - 1]
    assert isinstance(rollback, Rollback), "a Branch follows its Rollback"
    assert rollback.from_branch == br.parent_branch_id and rollback.tau == br.tau


def check_episode(events: Sequence[EpisodeEvent], *, restart: bool = False) -> None:
    """Assert the structural invariants of one finished episode's events (``restart``: iterative
    refinement, where every branch opens at step 0 whatever tau the reflection named)."""
    _check_ids(events)
    length: dict[str, int] = {ROOT_BRANCH: 0}
    depth: dict[str, int] = {ROOT_BRANCH: 0}
    ended: set[str] = set()
    for i, e in enumerate(events):
        if isinstance(e, Branch):
            assert e.branch_id not in length and e.parent_branch_id in length
            _check_branch(i, e, events, length, restart)
            assert e.depth == depth[e.parent_branch_id] + 1
            length[e.branch_id], depth[e.branch_id] = e.tau, e.depth
        elif isinstance(e, Step):
            assert e.branch_id not in ended and e.t == length[e.branch_id]
            length[e.branch_id] += 1
        elif isinstance(e, Reflection):
            assert e.branch_id not in ended and e.at_t == length[e.branch_id]
            assert 0 <= e.tau < e.at_t
        elif isinstance(e, Outcome):
            assert e.branch_id not in ended and e.steps == length[e.branch_id]
            ended.add(e.branch_id)
    outcomes = Counter(e.branch_id for e in events if isinstance(e, Outcome))
    assert set(outcomes) == set(length) and set(outcomes.values()) == {1}
    fin = events[-1]
    assert isinstance(fin, EpisodeFinished)
    steps = [e for e in events if isinstance(e, Step)]
    assert fin.actions == len(steps)
    assert fin.parse_failures == sum(not s.parse_ok for s in steps)
    assert fin.branches == len(length)
    assert fin.reflections == sum(isinstance(e, Reflection) for e in events)
    assert fin.replay_steps == sum(e.replay_steps for e in events if isinstance(e, Rollback))
    assert fin.success == any(e.success for e in events if isinstance(e, Outcome))
