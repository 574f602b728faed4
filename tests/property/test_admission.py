"""Property suite of what stands between the wire and the fold: admission and dead letters.

Pins: ``admit_event`` raises nothing but ``ProtocolError`` on any bytes, headers and subject, and
what it admits is consistent with its subject and id; every event the ``Publisher`` would send is
admitted unchanged; size, header, subject and id violations are refused naming the rule; a dead
letter always fits its limit, keeps the original's digest and size, and its body is a prefix of the
original.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.protocol.codec import (
    CODEC_HEADER,
    MSG_ID_HEADER,
    Admission,
    ProtocolError,
    admit_event,
    encode,
    headers_for,
    message_bytes,
)
from leafe.protocol.events import EpisodeEvent, EpisodeStarted, event_id_for
from leafe.protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    LEGACY_ACTOR,
    SAMPLES,
    TASKS,
    WEIGHTS,
    dead_letter_subject,
    event_subject,
    event_subject_parts,
    sample_subject,
    stream_for_subject,
    task_subject,
    weights_subject,
)
from leafe.protocol.tasks import episode_owner, owned_episode_id
from leafe.services.bus.dead_letters import (
    EXPECTED_EMPTY_HEADER,
    ORIGINAL_BYTES_HEADER,
    ORIGINAL_SHA256_HEADER,
    TRUNCATED_HEADER,
    dead_letter_message,
)
from tests.support.strategies import actor_ids, episode_events, run_ids

SETTINGS = settings(max_examples=200, deadline=None)
KINDS = [
    "episode_started",
    "step",
    "reflection",
    "rollback",
    "branch",
    "outcome",
    "episode_finished",
]


def kind_of(event: EpisodeEvent) -> str:
    return str(type(event).__struct_config__.tag)


def wellformed(event: EpisodeEvent) -> EpisodeEvent:
    """``event`` with the ids an actor gives it: an episode id that names it (``<stem>@<actor>``),
    event id ``<episode>.<seq>``, EpisodeStarted at seq 0."""
    seq = 0 if isinstance(event, EpisodeStarted) else event.seq
    episode = owned_episode_id(event.episode_id, event.actor_id)
    return msgspec.structs.replace(
        event, seq=seq, episode_id=episode, event_id=event_id_for(episode, seq)
    )


def unowned(event: EpisodeEvent) -> EpisodeEvent:
    """``event`` with the episode id it would have had before ids named their actor."""
    episode = event.episode_id.rpartition("@")[0]
    return msgspec.structs.replace(
        event, episode_id=episode, event_id=event_id_for(episode, event.seq)
    )


subjects = st.one_of(
    st.builds(lambda r, k: f"leafe.{r}.events.{k}", run_ids, st.sampled_from([*KINDS, "x"])),
    st.builds(
        lambda r, k, a: f"leafe.{r}.events.{k}.{a}",
        run_ids,
        st.sampled_from([*KINDS, "x"]),
        actor_ids,
    ),
    st.text(max_size=60),
)
headers = st.none() | st.dictionaries(
    st.sampled_from([CODEC_HEADER, MSG_ID_HEADER, "X-Other"]),
    st.sampled_from(["1", "2", "", "abc"]),
)
bodies = st.one_of(
    st.binary(max_size=300), episode_events.map(encode), episode_events.map(wellformed).map(encode)
)


@SETTINGS
@given(subject=subjects, hdrs=headers, data=bodies)
def test_admission_raises_only_protocol_errors_and_admits_only_consistent_events(
    subject: str, hdrs: dict[str, str] | None, data: bytes
) -> None:
    """Any message: a ProtocolError, or an event whose run, kind and actor are its subject's (actor
    ``legacy`` for a tokenless subject) and whose id is ``<episode>.<seq>``."""
    try:
        event = admit_event(subject, hdrs, data)
    except ProtocolError:
        return
    assert event_subject_parts(subject) == (event.run_id, kind_of(event), event.actor_id)
    assert (
        event.event_id == event_id_for(event.episode_id, event.seq)
        and hdrs
        and hdrs.get(CODEC_HEADER) == "1"
    )
    owner = episode_owner(event.episode_id)
    assert owner == event.actor_id or (owner is None and event.actor_id == LEGACY_ACTOR)


@SETTINGS
@given(event=episode_events.map(wellformed))
def test_every_event_the_publisher_sends_is_admitted_unchanged(event: EpisodeEvent) -> None:
    """Encoded with the Publisher's headers on its own subject, an event under the size limit is
    admitted as itself; the same bytes on another kind's subject, without Leafe-Codec, or over a
    smaller limit are refused naming the rule."""
    data, hdrs = encode(event), headers_for(event)
    subject = event_subject(event.run_id, kind_of(event), event.actor_id)
    if message_bytes(data, hdrs) > EVENTS.max_msg_bytes:
        return
    assert admit_event(subject, hdrs, data) == event
    other = next(k for k in KINDS if k != kind_of(event))
    with pytest.raises(ProtocolError, match="subject kind"):
        admit_event(event_subject(event.run_id, other, event.actor_id), hdrs, data)
    with pytest.raises(ProtocolError, match=CODEC_HEADER):
        admit_event(subject, {MSG_ID_HEADER: event.event_id}, data)
    assert admit_event(subject, {}, data, Admission(require_codec_header=False)) == event
    with pytest.raises(ProtocolError, match="over the limit"):
        admit_event(subject, hdrs, data, Admission(max_event_bytes=message_bytes(data, hdrs) - 1))
    forged = msgspec.structs.replace(event, event_id=event.event_id + "x")
    with pytest.raises(ProtocolError, match="event id"):
        admit_event(subject, hdrs, encode(forged))


@SETTINGS
@given(event=episode_events.map(wellformed), other=actor_ids)
def test_an_actor_id_other_than_the_subjects_actor_token_is_refused(
    event: EpisodeEvent, other: str
) -> None:
    """The subject's actor token is the publisher's identity: an event naming another actor is
    refused as ``forged_actor`` naming both; on a legacy tokenless subject (written before actor
    tokens, and before episode ids named their actor) it is admitted as actor ``legacy`` with the id
    it had then, and refused with an id that names an actor."""
    data, hdrs = encode(event), headers_for(event)
    if message_bytes(data, hdrs) > EVENTS.max_msg_bytes:
        return
    kind = kind_of(event)
    if other != event.actor_id:
        with pytest.raises(ProtocolError, match="published on actor") as info:
            admit_event(event_subject(event.run_id, kind, other), hdrs, data)
        assert info.value.category == "forged_actor" and repr(other) in info.value.reason
    tokenless = f"leafe.{event.run_id}.events.{kind}"
    with pytest.raises(ProtocolError, match="belongs to actor") as info:  # its id names an actor
        admit_event(tokenless, hdrs, data)
    assert info.value.category == "foreign_episode"
    old = unowned(event)
    legacy = admit_event(tokenless, headers_for(old), encode(old))
    assert legacy == msgspec.structs.replace(old, actor_id=LEGACY_ACTOR)


@SETTINGS
@given(run=run_ids, kind=st.sampled_from(["cf", "reh", "grpo"]))
def test_every_subject_maps_to_its_stream(run: str, kind: str) -> None:
    """Publishers find each subject's size limit through the stream that captures it."""
    assert stream_for_subject(event_subject(run, "step", run)) is EVENTS
    assert stream_for_subject(sample_subject(run, kind)) is SAMPLES
    assert stream_for_subject(task_subject(run)) is TASKS
    assert stream_for_subject(weights_subject(run)) is WEIGHTS
    assert stream_for_subject(dead_letter_subject(run, EVENTS.name)) is DEAD_LETTERS
    assert stream_for_subject(f"elsewhere.{run}") is None


@SETTINGS
@given(
    size=st.integers(0, 5000),
    reason=st.text(max_size=3000),
    origin=st.dictionaries(
        st.sampled_from(["Leafe-Original-Subject", "Leafe-Sample-Id"]), st.text(max_size=2000)
    ),
    limit=st.integers(2500, 6000),
)
def test_a_dead_letter_always_fits_and_keeps_the_originals_digest(
    size: int, reason: str, origin: dict[str, str], limit: int
) -> None:
    """Whatever the reason and origin, the dead letter fits ``limit`` on the wire; its body is the
    original or a marked prefix of it; size and sha256 are the original's."""
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    letter = dead_letter_message(
        "leafe.r.dead.x", data, reason, key="7", origin=origin, max_bytes=limit
    )
    h: dict[str, Any] = letter.headers
    assert message_bytes(letter.data, h) <= limit
    assert data.startswith(letter.data) and (letter.data == data) == (TRUNCATED_HEADER not in h)
    assert h[ORIGINAL_SHA256_HEADER] == hashlib.sha256(data).hexdigest() and h[
        ORIGINAL_BYTES_HEADER
    ] == str(size)
    assert letter.subject == "leafe.r.dead.x.7" and MSG_ID_HEADER not in h
    assert h[EXPECTED_EMPTY_HEADER] == "0" and all(
        v.isascii() and "\n" not in v for v in h.values()
    )
