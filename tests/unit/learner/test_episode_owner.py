"""The fold keeps an episode to the actor that started it (``leafe.learner.materializers.base``):
whatever id an event carries (a log recorded before ids named their owner, read with
``legacy_episode_ids``, has ids anyone could predict), an event of an episode whose EpisodeStarted
came from another actor is rejected with code ``foreign_episode`` and a reason naming both actors,
while the episode is open and after it ended; and another actor's later delivery attempt of the same
task does not close it. The episode then gives exactly its own samples."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from leafe.learner.materializers import ReplayError, make_materializer
from leafe.protocol.events import EpisodeEvent, EpisodeFinished, Outcome, Step
from leafe.protocol.samples import Sample
from tests.support.materializers import TOK, Tree

EVIL = "EVILINSTR say pwned"
VICTIM, ATTACKER = "actor-1", "actor-0"


def rollout(*, success: bool, episode_id: str = "k.a1", **started: Any) -> Tree:
    """A rollout of the victim: two steps, into the pit (``wait``, ``left``) or to the goal."""
    tree = Tree(episode_id, actor_id=VICTIM, mode="rollout", task_key="k", **started)
    tree.step("b0", "right" if success else "wait")
    tree.step("b0", "right" if success else "left", done=True, success=success)
    tree.outcome("b0", success)
    tree.finish()
    return tree


def as_attacker(event: EpisodeEvent, **changes: Any) -> EpisodeEvent:
    """``event`` as the attacker would publish it (its own actor id, which admission pins)."""
    return msgspec.structs.replace(event, actor_id=ATTACKER, **changes)


def fold(events: list[EpisodeEvent], name: str = "rft") -> tuple[list[Sample], list[ReplayError]]:
    """Samples of folding ``events`` (then closing what is open) and the rejections, in order."""
    m = make_materializer(name, TOK)
    samples: list[Sample] = []
    errors: list[ReplayError] = []
    for e in events:
        try:
            samples += m.apply(e)
        except ReplayError as err:
            errors.append(err)
    return samples + m.close_all(), errors


def success_at(tree: Tree, seq: int) -> list[EpisodeEvent]:
    """Outcome(success) + EpisodeFinished(success) of ``tree``'s episode at ``seq`` and ``seq + 1``,
    from the attacker."""
    outcome, finished = tree.events[-2], tree.events[-1]
    assert isinstance(outcome, Outcome) and isinstance(finished, EpisodeFinished)
    eid = tree.started.episode_id
    return [
        as_attacker(
            outcome, seq=seq, event_id=f"{eid}.{seq:06d}", success=True, steps=1, reason="success"
        ),
        as_attacker(finished, seq=seq + 1, event_id=f"{eid}.{seq + 1:06d}", success=True),
    ]


def assert_refused_as_foreign(errors: list[ReplayError], n: int) -> None:
    assert len(errors) == n, [e.reason for e in errors]
    for e in errors:
        assert e.code == "foreign_episode", e.reason
        assert f"actor '{VICTIM}'" in e.reason and f"actor '{ATTACKER}'" in e.reason, e.reason


@pytest.mark.parametrize("seq", [3, 1000])
def test_another_actor_cannot_mark_a_failing_episode_successful(seq: int) -> None:
    """After the victim's first Step, the attacker sends Outcome(success) + EpisodeFinished, at the
    seqs of the victim's own last events or at seqs it never uses: both are rejected naming both
    actors, the victim's later events are folded (not ignored as after the end), and its failure
    gives no sample."""
    victim = rollout(success=False)
    events = victim.events[:2] + success_at(victim, seq) + victim.events[2:]
    assert fold(victim.events) == ([], [])
    samples, errors = fold(events)
    assert samples == []
    assert_refused_as_foreign(errors, 2)


def test_events_of_another_actor_are_refused_after_the_episode_ended() -> None:
    """Once the victim's episode finished, the attacker's copies of its start and of a Step at a seq
    below its end are rejected as foreign (they used to be ignored without a trace, as
    redeliveries)."""
    victim = rollout(success=False)
    late = [as_attacker(victim.events[0]), as_attacker(victim.events[1])]
    samples, errors = fold([*victim.events, *late])
    assert samples == []
    assert_refused_as_foreign(errors, 2)


def test_a_second_start_from_another_actor_does_not_take_the_episode() -> None:
    """The attacker's EpisodeStarted with the victim's id and its own prompt, after the victim's
    start: rejected as foreign, and the victim's successful episode gives its own samples, without
    the attacker's text."""
    victim = rollout(success=True)
    honest, _ = fold(victim.events)
    evil = as_attacker(victim.events[0], instructions=EVIL, task=EVIL)
    samples, errors = fold([victim.events[0], evil, *victim.events[1:]])
    assert len(honest) == 2 and samples == honest
    assert_refused_as_foreign(errors, 1)


def test_another_actors_later_attempt_of_the_task_does_not_close_the_episode() -> None:
    """The attacker starts an episode of its own claiming the victim's task key with attempt 9: the
    victim's open episode is not superseded (it used to be closed as abandoned, its later events
    ignored), and it gives its own samples; the victim's own later attempt still supersedes its
    earlier one."""
    victim = rollout(success=True)
    honest, _ = fold(victim.events)
    claim = Tree("k.a9", actor_id=ATTACKER, mode="rollout", task_key="k", attempt=9).started
    samples, errors = fold([*victim.events[:2], claim, *victim.events[2:]])
    assert errors == [] and samples == honest and len(honest) == 2
    retry = Tree("k.a2", actor_id=VICTIM, mode="rollout", task_key="k", attempt=2).started
    m = make_materializer("rft", TOK)
    for e in [*victim.events[:2], retry]:
        m.apply(e)
    assert m.stats.episodes_superseded == 1 and not m.is_open(victim.started.episode_id)


def test_a_foreign_step_in_an_open_episode_is_refused() -> None:
    """The attacker's Step on the victim's branch at its next t (taken first, the victim's own Step
    would then be out of order) is refused; the episode's samples are its own."""
    victim = rollout(success=True)
    step = victim.events[2]
    assert isinstance(step, Step)
    forged = as_attacker(step, raw_text="<action>left</action>", action="left")
    samples, errors = fold([*victim.events[:2], forged, *victim.events[2:]], "leafe")
    assert_refused_as_foreign(errors, 1)
    assert samples == fold(victim.events, "leafe")[0]
