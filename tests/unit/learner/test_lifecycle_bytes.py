"""The byte caps of held episodes (``leafe.learner.materializers.lifecycle``): per run and per
publishing actor, each refusal with its cap's code.

One run-wide counter let a single credential fill ``max_open_bytes`` alone; each actor's events now
count against ``max_bytes_per_actor`` too, keyed on the event's ``actor_id`` (online, the subject
token NATS pins to the publisher); an actor cannot add bytes to someone else's episode at all.
"""

from __future__ import annotations

import pytest

from leafe.actors.fake_episodes import EventWriter
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import OpenLimits, ReplayError, make_materializer
from leafe.learner.materializers.lifecycle import CAP_CODES, event_bytes
from leafe.protocol.events import EpisodeFinished, EpisodeStarted, Outcome, Step
from tests.support.hostile import started_fields, step_fields

TOK = ByteChatTokenizer()
BIG = "x" * 10_000


def _start(run: str, name: str, actor: str) -> EventWriter:
    w = EventWriter(run, f"{run}-{name}", actor_id=actor)
    w.emit(EpisodeStarted, **started_fields(w.episode_id, observation=BIG))
    return w


def test_one_actor_fills_only_its_own_byte_share_and_a_release_gives_it_back() -> None:
    """Under a per-actor cap of about two starts, mallory's third start is refused with code
    ``max_open_bytes_per_actor`` (and its later events with the same code), while another actor's
    starts are held; once mallory's episode finishes, its bytes are free again."""
    fold = make_materializer("leafe", TOK)
    size = event_bytes(_start("r1", "probe", "m").events[0])
    fold.limits = OpenLimits(max_bytes=100 * size, max_bytes_per_actor=2 * size + size // 2)
    first, second, third = (_start("r1", f"m{i}", "mallory") for i in range(3))
    fold.apply(first.events[0])
    fold.apply(second.events[0])
    with pytest.raises(
        ReplayError, match=r"actor 'mallory' holds .*max_open_bytes_per_actor"
    ) as refused:
        fold.apply(third.events[0])
    assert refused.value.code == "max_open_bytes_per_actor" and refused.value.code in CAP_CODES
    with pytest.raises(ReplayError) as later:
        fold.apply(third.emit(Step, **step_fields("b0", 0)))
    assert later.value.code == "max_open_bytes_per_actor" and "was refused" in later.value.reason
    for i in range(3):
        fold.apply(_start("r1", f"a{i}", f"actor-{i}").events[0])
    first.emit(Step, **step_fields("b0", 0, success=True, done=True))
    first.emit(Outcome, branch_id="b0", success=True, score=1.0, steps=1, reason="success")
    first.emit(EpisodeFinished, success=True, branches=1, actions=1, reflections=0)
    for e in first.events[1:]:
        fold.apply(e)
    fold.apply(_start("r1", "m3", "mallory").events[0])
    assert fold.held_episodes == 1 + 1 + 3


def test_another_actors_events_in_an_episode_charge_nothing_and_the_run_cap_holds() -> None:
    """mallory's large Steps for actor-1's open episode (events under its own id, as NATS allows)
    are refused as ``foreign_episode`` before anything is charged (they once counted against the
    adder), while actor-1's own Step in the same episode goes through. The run cap, reached by
    other actors' starts, refuses with ``max_open_bytes``."""
    fold = make_materializer("leafe", TOK)
    victim = _start("r1", "v", "actor-1")
    size = event_bytes(victim.events[0])
    fold.limits = OpenLimits(
        max_bytes=4 * size + size // 2, max_bytes_per_actor=2 * size + size // 2
    )
    fold.apply(victim.events[0])
    held = fold._ledger.held_bytes
    for t in range(3):
        forged = EventWriter("r1", victim.episode_id, actor_id="mallory").emit(
            Step, **step_fields("b0", t, observation=BIG), seq=100 + t
        )
        with pytest.raises(ReplayError) as refused:
            fold.apply(forged)
        assert refused.value.code == "foreign_episode"
    assert fold._ledger.held_bytes == held and "mallory" not in fold._ledger.actor_bytes
    fold.apply(victim.emit(Step, **step_fields("b0", 0)))
    for i in range(3):
        fold.apply(_start("r1", f"o{i}", f"actor-{i + 2}").events[0])
    with pytest.raises(ReplayError) as full:
        fold.apply(_start("r1", "o3", "actor-5").events[0])
    assert full.value.code == "max_open_bytes" and "max_open_bytes = " in full.value.reason
