"""Subject builders and stream specs: exact subjects, clear rejections, every subject has one
stream."""

from __future__ import annotations

import pytest

from leafe.protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    LEGACY_ACTOR,
    SAMPLES,
    STREAMS,
    TASKS,
    WEIGHTS,
    InvalidRunId,
    actor_events_subjects,
    dead_letter_subject,
    event_subject,
    event_subject_parts,
    sample_subject,
    task_subject,
    validate_actor_id,
    validate_run_id,
    weights_subject,
)


def _matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` is one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def test_subjects_have_the_documented_shape() -> None:
    """Each builder yields ``leafe.<run>.<area>[.<kind>]`` exactly as docs/architecture.md lists
    it."""
    assert event_subject("r1", "step", "a0") == "leafe.r1.events.step.a0"
    assert (
        event_subject("r1", "episode_started", "r1-actor-2")
        == "leafe.r1.events.episode_started.r1-actor-2"
    )
    assert actor_events_subjects("r1", "a0") == "leafe.r1.events.*.a0"
    assert task_subject("run-2") == "leafe.run-2.tasks"
    assert sample_subject("R_3", "cf") == "leafe.R_3.samples.cf"
    assert weights_subject("r1") == "leafe.r1.weights"
    assert dead_letter_subject("r1", "LEAFE_EVENTS") == "leafe.r1.dead.leafe_events"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "a.b",
        "a b",
        "*",
        ">",
        "r1.>",
        "-lead",
        "_lead",
        "x" * 65,
        "ünï",
        "tab\t",
        "new\nline",
        "a/b",
        "r1\n",
        "r1\r\nPUB x 1",
    ],
)
def test_invalid_run_ids_are_rejected_with_the_value_named(bad: str) -> None:
    """Dots, spaces, wildcards, leading punctuation, >64 chars and non-ASCII are refused, quoting
    the id."""
    with pytest.raises(InvalidRunId, match="invalid run id") as info:
        validate_run_id(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(InvalidRunId):
        event_subject(bad, "step", "a0")
    with pytest.raises(InvalidRunId, match="actor"):
        event_subject("r1", "step", bad)
    with pytest.raises(InvalidRunId, match="invalid actor id") as info:
        validate_actor_id(bad)
    assert repr(bad) in str(info.value)


def test_non_string_run_id_is_rejected() -> None:
    """A run id that is not a string (e.g. an int from a config) is an InvalidRunId, not a
    TypeError."""
    with pytest.raises(InvalidRunId):
        validate_run_id(12)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["", "a.b", "*", ">", "with space", "step\n"])
def test_invalid_kind_tokens_are_rejected(kind: str) -> None:
    """An event/sample kind that is not a single subject token is refused with the kind named."""
    with pytest.raises(InvalidRunId, match="kind"):
        event_subject("r1", kind, "a0")
    with pytest.raises(InvalidRunId, match="kind"):
        sample_subject("r1", kind)


def test_event_subjects_name_their_actor_and_legacy_ones_read_as_the_legacy_actor() -> None:
    """``(run, kind, actor)`` from a subject with the actor token; a tokenless legacy subject is
    actor ``legacy``, a name no actor may take; anything else (an extra token, a token no actor id
    can be) raises."""
    assert event_subject_parts("leafe.r1.events.step.a0") == ("r1", "step", "a0")
    assert event_subject_parts("leafe.r1.events.step") == ("r1", "step", LEGACY_ACTOR)
    with pytest.raises(InvalidRunId, match="reserved"):
        validate_actor_id(LEGACY_ACTOR)
    for bad in (
        "leafe.r1.events.step.a0.x",
        "leafe.r1.events.step.-a",
        "leafe.r1.samples.cf.a0",
        "leafe.r1",
    ):
        with pytest.raises(ValueError, match="not an"):
            event_subject_parts(bad)


def test_boundary_run_ids_are_accepted() -> None:
    """One character and exactly 64 characters are both valid run ids."""
    assert validate_run_id("a") == "a"
    assert validate_run_id("A" * 64) == "A" * 64


def test_every_subject_is_captured_by_exactly_one_stream() -> None:
    """Streams never overlap (JetStream would refuse) and every builder's subject lands in its
    stream."""
    cases = {
        event_subject("r1", "step", "a0"): EVENTS,
        "leafe.r1.events.step": EVENTS,  # a legacy subject, without the actor token
        task_subject("r1"): TASKS,
        sample_subject("r1", "cf"): SAMPLES,
        weights_subject("r1"): WEIGHTS,
        dead_letter_subject("r1", "LEAFE_EVENTS"): DEAD_LETTERS,
    }
    for subject, stream in cases.items():
        owners = [s for s in STREAMS if any(_matches(p, subject) for p in s.subjects)]
        assert owners == [stream], subject


def test_stream_specs_follow_the_design() -> None:
    """Tasks are a work queue; everything is file-backed, never expires, and dedupes for a long
    window."""
    assert TASKS.retention == "workqueue"
    assert {s.name for s in STREAMS} == {
        "LEAFE_EVENTS",
        "LEAFE_TASKS",
        "LEAFE_SAMPLES",
        "LEAFE_WEIGHTS",
        "LEAFE_DEAD",
    }
    for spec in STREAMS:
        assert spec.storage == "file"
        assert spec.max_age_s == 0.0
        assert spec.duplicate_window_s >= 3600
