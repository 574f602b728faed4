"""Codec edge cases: malformed input, wrong stream, codec versions, message ids and headers."""

from __future__ import annotations

import msgspec
import pytest

from leafe.protocol.codec import (
    CODEC_HEADER,
    CODEC_VERSION,
    MSG_ID_HEADER,
    ProtocolError,
    decode_event,
    decode_sample,
    decode_task,
    decode_weights,
    encode,
    headers_for,
    message_id,
)
from leafe.protocol.events import Outcome, Reflection, Step, WeightsPublished
from leafe.protocol.samples import ChatMessage, Sample
from leafe.protocol.tasks import TaskAssignment
from tests.support.strategies import make_episode

STEP = make_episode("r1", "ep1")[1]
TASK = TaskAssignment(
    task_key="sokoban-train-00001-x0", run_id="r1", env="sokoban", task_id="sokoban/train/1"
)
SAMPLE = Sample(
    sample_id="s1",
    run_id="r1",
    kind="cf",
    materializer="leafe/1",
    env="env",
    task_id="t",
    episode_id="e",
    messages=[ChatMessage(role="user", content="hi")],
    target_turn=0,
    prompt_ids=[1],
    completion_ids=[2],
    policy_version="v1",
)
WEIGHTS = WeightsPublished(
    event_id="weights.v2",
    run_id="r1",
    version="v2",
    uri="/w/v2",
    manifest_sha256="ab",
    learner_step=3,
    base_model="m",
)


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", b"\x93\x01\x02", b"\xff" * 10, b"\x81\xa4kind\xa4nope"]
)
def test_malformed_bytes_raise_protocol_error(data: bytes) -> None:
    """Empty input, reserved bytes, arrays, garbage and unknown tags all raise ProtocolError with a
    reason."""
    with pytest.raises(ProtocolError) as info:
        decode_event(data)
    assert info.value.what == "episode event"
    assert info.value.reason


@pytest.mark.parametrize("value", [None, "text", 12, [b"x"]])
def test_non_bytes_input_raises_protocol_error(value: object) -> None:
    """Passing something that is not bytes is reported as a ProtocolError naming the type."""
    with pytest.raises(ProtocolError, match=type(value).__name__):
        decode_event(value)  # type: ignore[arg-type]


def test_bytearray_and_memoryview_are_accepted() -> None:
    """The decoders take any bytes-like buffer (nats-py hands out bytes, files give bytearrays)."""
    data = encode(STEP)
    assert decode_event(bytearray(data)) == STEP  # type: ignore[arg-type]
    assert decode_event(memoryview(data)) == STEP  # type: ignore[arg-type]


def test_unknown_kind_is_named_in_the_error() -> None:
    """An event with a kind this code does not know fails with ProtocolError naming the kind."""
    doc = msgspec.to_builtins(STEP)
    doc["kind"] = "teleport"
    with pytest.raises(ProtocolError, match="teleport"):
        decode_event(msgspec.msgpack.encode(doc))


def test_missing_required_field_is_named() -> None:
    """A Step without ``token_ids`` is rejected and the error names the field."""
    doc = msgspec.to_builtins(STEP)
    del doc["token_ids"]
    with pytest.raises(ProtocolError, match="token_ids"):
        decode_event(msgspec.msgpack.encode(doc))


def test_wrong_field_type_is_named() -> None:
    """A string where an int is expected is rejected with the field path in the reason."""
    doc = msgspec.to_builtins(STEP)
    doc["t"] = "three"
    with pytest.raises(ProtocolError, match=r"\$\.t"):
        decode_event(msgspec.msgpack.encode(doc))


def test_unknown_extra_fields_are_ignored() -> None:
    """A newer writer's extra field does not break an older reader (fields are only ever added)."""
    doc = msgspec.to_builtins(STEP)
    doc["added_in_the_future"] = [1, 2, 3]
    assert decode_event(msgspec.msgpack.encode(doc)) == STEP


def test_old_payload_without_defaulted_fields_still_decodes() -> None:
    """Fields with defaults may be absent (an old log), and take their documented defaults."""
    doc = msgspec.to_builtins(STEP)
    for name in ("logprobs", "reward", "done", "feedback", "prompt_sha256", "policy_version", "ts"):
        doc.pop(name, None)
    step = decode_event(msgspec.msgpack.encode(doc))
    assert isinstance(step, Step)
    assert step.logprobs is None and step.reward == 0.0 and step.policy_version == "default"


def test_old_reflection_without_oracle_labels_or_prompt_digest_decodes() -> None:
    """A Reflection written before oracle labels existed decodes with no verdict and no prompt
    digest."""
    refl = next(e for e in make_episode("r1", "ep1") if isinstance(e, Reflection))
    doc = msgspec.to_builtins(refl)
    for name in ("oracle_tau", "oracle_experience", "prompt_sha256"):
        doc.pop(name)
    old = decode_event(msgspec.msgpack.encode(doc))
    assert isinstance(old, Reflection) and old == refl
    assert old.oracle_tau is None and old.oracle_experience == "" and old.prompt_sha256 == ""
    labelled = msgspec.structs.replace(
        refl, oracle_tau=0, oracle_experience="Push first.", prompt_sha256="ab"
    )
    assert decode_event(encode(labelled)) == labelled


@pytest.mark.parametrize(
    ("decode", "msg"),
    [(decode_task, STEP), (decode_event, TASK), (decode_sample, WEIGHTS), (decode_weights, SAMPLE)],
)
def test_message_of_another_stream_is_rejected(decode: object, msg: msgspec.Struct) -> None:
    """Each decoder only accepts its own stream's type; a message from another stream is a
    ProtocolError."""
    with pytest.raises(ProtocolError):
        decode(encode(msg), CODEC_VERSION)  # type: ignore[operator]


def test_codec_version_none_means_current_and_unknown_is_refused() -> None:
    """No codec header decodes as the current version; an unknown version is refused with its
    value."""
    assert decode_event(encode(STEP), None) == STEP
    assert decode_event(encode(STEP), CODEC_VERSION) == STEP
    with pytest.raises(ProtocolError, match="'2'"):
        decode_event(encode(STEP), "2")


def test_message_ids_and_headers() -> None:
    """The dedupe id is the event id, task key or sample id; headers carry it and the codec
    version."""
    assert message_id(STEP) == STEP.event_id
    assert message_id(TASK) == TASK.task_key
    assert message_id(SAMPLE) == SAMPLE.sample_id
    assert message_id(WEIGHTS) == "weights.v2"
    assert headers_for(STEP) == {MSG_ID_HEADER: STEP.event_id, CODEC_HEADER: CODEC_VERSION}
    with pytest.raises(TypeError, match="ChatMessage"):
        message_id(ChatMessage(role="user", content="x"))


def test_protocol_error_is_a_value_error_with_what_and_reason() -> None:
    """ProtocolError subclasses ValueError and keeps ``what``/``reason`` for dead-letter headers."""
    err = ProtocolError("episode event", "malformed msgpack: truncated")
    assert isinstance(err, ValueError)
    assert str(err) == "cannot decode episode event: malformed msgpack: truncated"
    assert (err.what, err.reason) == ("episode event", "malformed msgpack: truncated")


def test_every_kind_of_make_episode_round_trips() -> None:
    """The shared example episode holds all seven kinds, and each survives the codec."""
    events = make_episode("r1", "ep1")
    assert {type(e).__name__ for e in events} == {
        "EpisodeStarted",
        "Step",
        "Reflection",
        "Rollback",
        "Branch",
        "Outcome",
        "EpisodeFinished",
    }
    assert [decode_event(encode(e)) for e in events] == events
    assert isinstance(events[-2], Outcome) and events[-2].success
