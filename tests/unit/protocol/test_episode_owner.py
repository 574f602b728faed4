"""An episode id names the actor that started it, ``<task_key>.a<attempt>@<actor>``, and no other
actor can take an event's dedupe id first: an event's ``Nats-Msg-Id`` is ``<event_id>:<msg_nonce>``,
the nonce drawn per event. Admission refuses an event whose episode id names another actor than its
publisher (``foreign_episode``) and, unless a log recorded before owned ids is being read
(``Admission.legacy_episode_ids``), one whose id names no actor at all (``unowned_episode``);
tokenless legacy subjects (actor ``legacy``, which no actor may publish as) keep their old ids."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from leafe.actors.episode import EpisodeRecorder, ListSink
from leafe.protocol.codec import (
    MSG_ID_HEADER,
    Admission,
    ProtocolError,
    admit_event,
    encode,
    headers_for,
)
from leafe.protocol.events import EpisodeStarted, Outcome, Step, event_id_for
from leafe.protocol.subjects import LEGACY_ACTOR, event_subject
from leafe.protocol.tasks import episode_id_for, episode_owner
from tests.support.hostile import started_fields, step_fields


def outcome(episode_id: str, actor_id: str, seq: int = 3) -> Outcome:
    return Outcome(
        event_id=event_id_for(episode_id, seq),
        run_id="r1",
        episode_id=episode_id,
        actor_id=actor_id,
        seq=seq,
        branch_id="b0",
        success=True,
        reason="success",
    )


def admit(event: msgspec.Struct, actor: str, admission: Admission = Admission()) -> object:
    kind = str(type(event).__struct_config__.tag)
    return admit_event(
        event_subject("r1", kind, actor), headers_for(event), encode(event), admission
    )


def test_episode_ids_name_their_actor() -> None:
    """``episode_id_for`` names the actor after ``@`` (no actor token holds one); ids of before, or
    with anything but an actor token after the last ``@``, name none."""
    eid = episode_id_for("r1-rollout-sokoban-train-3-x0", 2, "actor-1")
    assert eid == "r1-rollout-sokoban-train-3-x0.a2@actor-1"
    assert episode_owner(eid) == "actor-1" and episode_owner(f"a@b@{eid}") == "actor-1"
    for legacy in ("k.a1", "r1-ep3", "k.a1.s2", "k.a1@", "@actor-1", "k.a1@a.b", "k@-x"):
        assert episode_owner(legacy) is None, legacy
    with pytest.raises(ValueError, match="actor"):
        episode_id_for("k", 1, "a.b")


def test_every_event_an_actor_sends_has_a_dedupe_id_nobody_can_predict() -> None:
    """Each event an actor records carries a fresh ``msg_nonce``, and its ``Nats-Msg-Id`` is
    ``<event_id>:<msg_nonce>``: knowing the (deterministic) event id is not enough to store that id
    first. A retried publish sends the same event, so the same id."""
    sink = ListSink()
    eid = episode_id_for("k", 1, "actor-1")
    rec = EpisodeRecorder(sink, run_id="r1", episode_id=eid, actor_id="actor-1")
    for t in range(20):
        asyncio.run(rec.emit(Step, **step_fields("b0", t)))
    nonces = {e.msg_nonce for e in sink.events}
    assert len(nonces) == 20 and all(len(n) == 16 and int(n, 16) >= 0 for n in nonces)
    for e in sink.events:
        assert e.event_id == event_id_for(eid, e.seq)
        assert headers_for(e)[MSG_ID_HEADER] == f"{e.event_id}:{e.msg_nonce}"
    assert headers_for(msgspec.structs.replace(e, msg_nonce=""))[MSG_ID_HEADER] == e.event_id


def test_an_event_in_another_actors_episode_is_refused_naming_both() -> None:
    """actor-0 publishes (on its own subject, as itself) an Outcome into actor-1's episode: refused
    as ``foreign_episode``, the reason naming the episode, its owner and the publisher; actor-1's
    own Outcome there is admitted."""
    victim = episode_id_for("k", 1, "actor-1")
    with pytest.raises(ProtocolError) as info:
        admit(outcome(victim, "actor-0"), "actor-0")
    assert info.value.category == "foreign_episode"
    assert victim in info.value.reason
    assert "actor 'actor-1'" in info.value.reason and "actor 'actor-0'" in info.value.reason
    assert admit(outcome(victim, "actor-1"), "actor-1") == outcome(victim, "actor-1")


def test_a_start_under_another_actors_episode_id_is_refused() -> None:
    """An EpisodeStarted whose id names another actor (published first, it would own the
    episode)."""
    eid = episode_id_for("k", 1, "actor-1")
    start = EpisodeStarted(
        event_id=event_id_for(eid, 0),
        run_id="r1",
        episode_id=eid,
        actor_id="actor-0",
        seq=0,
        **started_fields(eid, instructions="EVILINSTR"),
    )
    with pytest.raises(ProtocolError, match="belongs to actor 'actor-1'") as info:
        admit(start, "actor-0")
    assert info.value.category == "foreign_episode"


def test_an_id_that_names_no_actor_is_refused_unless_reading_an_older_log() -> None:
    """``<task_key>.a<attempt>`` (every id before owned ids) on an actor's subject: refused as
    ``unowned_episode`` saying how to read an older log; admitted with ``legacy_episode_ids``; and
    on a tokenless subject (actor ``legacy``) always, as before."""
    event = outcome("k.a1", "actor-0")
    with pytest.raises(ProtocolError, match="legacy_episode_ids") as info:
        admit(event, "actor-0")
    assert info.value.category == "unowned_episode" and "'k.a1'" in info.value.reason
    assert admit(event, "actor-0", Admission(legacy_episode_ids=True)) == event
    legacy = admit_event("leafe.r1.events.outcome", headers_for(event), encode(event))
    assert legacy == msgspec.structs.replace(event, actor_id=LEGACY_ACTOR)
    # the switch admits ids that name nobody, never one that names somebody else
    foreign = outcome(episode_id_for("k", 1, "actor-1"), "actor-0")
    with pytest.raises(ProtocolError, match="belongs to actor 'actor-1'"):
        admit(foreign, "actor-0", Admission(legacy_episode_ids=True))
