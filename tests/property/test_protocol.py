"""Codec and subject properties: round-trips of every wire type, total decoders, run-id
validation."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.protocol.codec import (
    ProtocolError,
    decode_event,
    decode_sample,
    decode_task,
    decode_weights,
    encode,
)
from leafe.protocol.events import EpisodeEvent, WeightsPublished
from leafe.protocol.samples import Sample
from leafe.protocol.subjects import (
    InvalidRunId,
    dead_letter_subject,
    event_subject,
    sample_subject,
    task_subject,
    validate_run_id,
    weights_subject,
)
from leafe.protocol.tasks import TaskAssignment
from tests.support.strategies import (
    DECODERS,
    episode_events,
    invalid_run_ids,
    msgpack_values,
    run_ids,
    samples,
    tasks,
    weights,
    wire_messages,
)

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_DECODERS = (
    (decode_event, EpisodeEvent.__args__),  # type: ignore[attr-defined]
    (decode_task, (TaskAssignment,)),
    (decode_sample, (Sample,)),
    (decode_weights, (WeightsPublished,)),
)


@SETTINGS
@given(episode_events)
def test_every_event_type_round_trips(event: EpisodeEvent) -> None:
    """Encoding then decoding any episode event gives an equal event of the same type."""
    decoded = decode_event(encode(event), "1")
    assert type(decoded) is type(event)
    assert decoded == event


@SETTINGS
@given(st.one_of(tasks, samples, weights))
def test_task_sample_and_weights_round_trip(msg: msgspec.Struct) -> None:
    """Task assignments, samples and weight announcements survive the codec unchanged."""
    decoded = DECODERS[type(msg)](encode(msg), None)
    assert type(decoded) is type(msg)
    assert decoded == msg


@SETTINGS
@given(wire_messages)
def test_encoding_is_deterministic(msg: msgspec.Struct) -> None:
    """Re-encoding a decoded message yields the same bytes (stable ids and byte-identical
    exports)."""
    data = encode(msg)
    assert encode(DECODERS[type(msg)](data, None)) == data


def _decode_or_protocol_error(data: bytes) -> None:
    for decode, types in ALL_DECODERS:
        try:
            value = decode(data, None)
        except ProtocolError as e:
            assert e.reason and e.what
            continue
        assert isinstance(value, types)


@SETTINGS
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    """Any bytes decode to a valid message of the stream's type or raise ProtocolError, nothing
    else."""
    _decode_or_protocol_error(data)


@SETTINGS
@given(msgpack_values)
def test_wellformed_msgpack_of_wrong_shape_raises_protocol_error(value: object) -> None:
    """Valid msgpack that is not a message (wrong shape, types, tags) raises ProtocolError only."""
    _decode_or_protocol_error(msgspec.msgpack.encode(value))


@SETTINGS
@given(wire_messages, st.data())
def test_damaged_messages_decode_or_raise_protocol_error(
    msg: msgspec.Struct, data: st.DataObject
) -> None:
    """Truncated or bit-flipped encodings of real messages never raise anything but
    ProtocolError."""
    raw = bytearray(encode(msg))
    cut = data.draw(st.integers(0, len(raw)))
    _decode_or_protocol_error(bytes(raw[:cut]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(raw))


@SETTINGS
@given(episode_events, st.text(min_size=1, max_size=8).filter(lambda v: v != "1"))
def test_unknown_codec_version_is_rejected_by_name(event: EpisodeEvent, version: str) -> None:
    """A payload stamped with a codec version this code does not know raises ProtocolError naming
    it."""
    with pytest.raises(ProtocolError, match=re.escape(repr(version))):
        decode_event(encode(event), version)


@SETTINGS
@given(invalid_run_ids)
def test_subject_builders_reject_invalid_run_ids(run_id: str) -> None:
    """Every subject builder rejects a run id that would break NATS subjects, quoting it in the
    message."""
    builders = (
        lambda r: event_subject(r, "step", "a0"),
        lambda r: event_subject("r1", "step", r),
        task_subject,
        lambda r: sample_subject(r, "cf"),
        weights_subject,
        lambda r: dead_letter_subject(r, "LEAFE_EVENTS"),
        validate_run_id,
    )
    for build in builders:
        with pytest.raises(InvalidRunId) as info:
            build(run_id)
        assert repr(run_id) in str(info.value)


@SETTINGS
@given(run_ids)
def test_subject_builders_accept_valid_run_ids(run_id: str) -> None:
    """A valid run id becomes exactly the second token of every subject (no wildcard, no extra
    dot)."""
    for subject in (
        event_subject(run_id, "step", "a0"),
        task_subject(run_id),
        sample_subject(run_id, "cf"),
        weights_subject(run_id),
        dead_letter_subject(run_id, "LEAFE_EVENTS"),
    ):
        tokens = subject.split(".")
        assert tokens[0] == "leafe" and tokens[1] == run_id
        assert not any(c in subject for c in " *>")
