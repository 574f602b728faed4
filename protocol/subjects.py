"""Subjects and stream specifications, as data.

Subjects: ``leafe.<run>.events.<kind>.<actor>``, ``leafe.<run>.tasks``,
``leafe.<run>.samples.<kind>``, ``leafe.<run>.weights``, ``leafe.<run>.dead.<stream>``.
``services/bus/`` turns :data:`STREAMS` into JetStream streams; nothing here talks to NATS.

An event subject ends in its publisher's actor id: NATS permissions pin each actor's credentials to
its own token (:func:`actor_events_subjects`), so the token is an identity the publisher cannot
forge, where the payload's ``actor_id`` is whatever the publisher wrote. Logs written before the
token have ``leafe.<run>.events.<kind>``: :func:`event_subject_parts` reads them as published by
:data:`LEGACY_ACTOR`, one identity for all of them (an actor may not take that name).

Sizes are decided here, up front: every server runs with ``max_payload`` = :data:`MAX_PAYLOAD` (the
embedded server, ``deploy/base/nats/nats.conf``), and each stream's :attr:`StreamSpec.max_msg_bytes`
(headers included, as the server counts them) leaves :data:`DEAD_LETTER_HEADROOM` below it, so that
any stored message can be dead-lettered with its reason without truncation. Events are far smaller:
an event over ``EVENTS.max_msg_bytes`` (1 MiB, about a thousand times a real Step) is refused at
publish and dead-lettered by the replayer.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

__all__ = [
    "DEAD_LETTERS",
    "DEAD_LETTER_HEADROOM",
    "EVENTS",
    "LEGACY_ACTOR",
    "MAX_PAYLOAD",
    "SAMPLES",
    "STREAMS",
    "TASKS",
    "WEIGHTS",
    "InvalidRunId",
    "StreamSpec",
    "actor_events_subjects",
    "actors_durable",
    "dead_letter_subject",
    "event_subject",
    "event_subject_parts",
    "events_filter",
    "learner_durable",
    "replayer_durable",
    "sample_subject",
    "samples_filter",
    "stream_for_subject",
    "task_subject",
    "validate_actor_id",
    "validate_run_id",
    "weights_subject",
]

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DAY = 24 * 3600.0
MAX_PAYLOAD = 8 * 1024 * 1024
"""The servers' ``max_payload`` (bytes, headers included): a larger message closes the
connection."""
LEGACY_ACTOR = "legacy"
"""The publisher identity of an event on a subject without an actor token (written before it
existed)."""
DEAD_LETTER_HEADROOM = 16 * 1024
"""Bytes kept free under :data:`MAX_PAYLOAD` for the headers a dead letter adds (reason <= 512
chars)."""


class InvalidRunId(ValueError):
    """A run id (or subject token) that cannot be used in a NATS subject."""


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is 1-64 chars of ``[A-Za-z0-9_-]`` starting alphanumeric, else
    raise."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise InvalidRunId(
            f"invalid run id {run_id!r}: use 1-64 characters from [A-Za-z0-9_-], starting with a "
            "letter "
            "or digit (dots, spaces and wildcards would break NATS subjects)"
        )
    return run_id


def validate_actor_id(actor_id: str) -> str:
    """Return ``actor_id`` if it can be an actor's subject token (a run id's rules) and is not
    :data:`LEGACY_ACTOR` (the identity of tokenless legacy events), else raise naming it."""
    if not isinstance(actor_id, str) or not _RUN_ID.fullmatch(actor_id):
        raise InvalidRunId(
            f"invalid actor id {actor_id!r}: use 1-64 characters from [A-Za-z0-9_-], starting with "
            "a letter "
            "or digit (it is the last token of the actor's event subjects)"
        )
    if actor_id == LEGACY_ACTOR:
        raise InvalidRunId(
            f"invalid actor id {actor_id!r}: reserved for events of logs without actor tokens"
        )
    return actor_id


def _actor_token(actor_id: str) -> str:
    if not isinstance(actor_id, str) or not _RUN_ID.fullmatch(actor_id):
        raise InvalidRunId(
            f"invalid actor token {actor_id!r}: use 1-64 characters from [A-Za-z0-9_-]"
        )
    return actor_id


def _token(kind: str, what: str) -> str:
    if not _TOKEN.fullmatch(kind):
        raise InvalidRunId(f"invalid {what} {kind!r}: use 1-64 characters from [A-Za-z0-9_-]")
    return kind


def event_subject(run_id: str, kind: str, actor_id: str) -> str:
    """Subject of an episode event published by ``actor_id``, e.g. ``leafe.r1.events.step.a0``."""
    return (
        f"leafe.{validate_run_id(run_id)}.events."
        f"{_token(kind, 'event kind')}.{_actor_token(actor_id)}"
    )


def actor_events_subjects(run_id: str, actor_id: str) -> str:
    """What ``actor_id``'s credentials may publish events on: ``leafe.<run>.events.*.<actor>``."""
    return f"leafe.{validate_run_id(run_id)}.events.*.{validate_actor_id(actor_id)}"


def task_subject(run_id: str) -> str:
    """Subject of the run's task work queue."""
    return f"leafe.{validate_run_id(run_id)}.tasks"


def sample_subject(run_id: str, kind: str) -> str:
    """Subject of a materialized sample, e.g. ``leafe.r1.samples.cf``."""
    return f"leafe.{validate_run_id(run_id)}.samples.{_token(kind, 'sample kind')}"


def weights_subject(run_id: str) -> str:
    """Subject of the run's ``WeightsPublished`` announcements."""
    return f"leafe.{validate_run_id(run_id)}.weights"


def dead_letter_subject(run_id: str, stream: str) -> str:
    """Subject where undecodable or rejected messages of ``stream`` are parked with a reason
    header."""
    return f"leafe.{validate_run_id(run_id)}.dead.{_token(stream.lower(), 'stream')}"


def event_subject_parts(subject: str) -> tuple[str, str, str]:
    """``(run_id, kind, actor)`` of an event subject ``leafe.<run>.events.<kind>.<actor>``, or of a
    legacy ``leafe.<run>.events.<kind>`` (actor :data:`LEGACY_ACTOR`); ``ValueError`` otherwise."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[0] != "leafe" or parts[2] != "events":
        raise ValueError(f"not an event subject: {subject[:200]!r}")
    if len(parts) == 4:
        return parts[1], parts[3], LEGACY_ACTOR
    if not _RUN_ID.fullmatch(parts[4]):
        raise ValueError(f"not an actor token: {parts[4][:80]!r} in {subject[:200]!r}")
    return parts[1], parts[3], parts[4]


def events_filter(run_id: str) -> str:
    """Subject filter of every event of a run: ``leafe.<run>.events.>``."""
    return f"leafe.{validate_run_id(run_id)}.events.>"


def samples_filter(run_id: str) -> str:
    """Subject filter of every sample of a run: ``leafe.<run>.samples.>``."""
    return f"leafe.{validate_run_id(run_id)}.samples.>"


# Durable consumer names are per stream, and every run shares the streams: each name carries the run
# id.
def actors_durable(run_id: str, prefix: str = "actors") -> str:
    """The actors' shared durable on ``LEAFE_TASKS`` (one per run, so JetStream spreads the
    queue)."""
    return f"{_token(prefix, 'durable prefix')}-{validate_run_id(run_id)}"


def replayer_durable(run_id: str, materializer: str) -> str:
    """A run's replayer durable on ``LEAFE_EVENTS``, one per materializer."""
    return f"replayer-{validate_run_id(run_id)}-{_token(materializer, 'materializer name')}"


def learner_durable(run_id: str, name: str = "") -> str:
    """The learner's durable on ``LEAFE_SAMPLES``: ``name`` when configured, else
    ``learner-<run>``."""
    return _token(name, "durable name") if name else f"learner-{validate_run_id(run_id)}"


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream stream, as data (``services/bus/`` creates it idempotently)."""

    name: str
    """Stream name."""
    subjects: list[str]
    """Subject filters the stream captures (all runs share one stream)."""
    retention: Literal["limits", "workqueue"] = "limits"
    """``limits`` for logs, ``workqueue`` for task assignments."""
    storage: Literal["file", "memory"] = "file"
    """Persist to disk by default."""
    max_age_s: float = 0.0
    """0 = never expire."""
    duplicate_window_s: float = DAY
    """Dedupe window for ``Nats-Msg-Id``; long, but consumers stay idempotent anyway."""
    replicas: int = 1
    """Replication factor (3 on the clustered deployment)."""
    max_msg_bytes: int = MAX_PAYLOAD - DEAD_LETTER_HEADROOM
    """Largest message (header block + body, bytes) publishers may store; ``Publisher`` refuses
    more."""


EVENTS = StreamSpec(name="LEAFE_EVENTS", subjects=["leafe.*.events.>"], max_msg_bytes=1024 * 1024)
TASKS = StreamSpec(name="LEAFE_TASKS", subjects=["leafe.*.tasks"], retention="workqueue")
SAMPLES = StreamSpec(name="LEAFE_SAMPLES", subjects=["leafe.*.samples.>"])
WEIGHTS = StreamSpec(name="LEAFE_WEIGHTS", subjects=["leafe.*.weights"])
DEAD_LETTERS = StreamSpec(name="LEAFE_DEAD", subjects=["leafe.*.dead.>"], max_msg_bytes=MAX_PAYLOAD)
STREAMS: tuple[StreamSpec, ...] = (EVENTS, TASKS, SAMPLES, WEIGHTS, DEAD_LETTERS)
"""Every stream the system uses."""


def stream_for_subject(subject: str) -> StreamSpec | None:
    """The stream whose subject filters capture ``subject`` (``None`` when none does)."""
    tokens = subject.split(".")
    for spec in STREAMS:
        for pattern in spec.subjects:
            if _matches(pattern.split("."), tokens):
                return spec
    return None


def _matches(pattern: list[str], tokens: list[str]) -> bool:
    for i, p in enumerate(pattern):
        if p == ">":
            return len(tokens) > i
        if i >= len(tokens) or (p != "*" and p != tokens[i]):
            return False
    return len(tokens) == len(pattern)
