"""Wire codec: msgpack bodies with a codec-version header, and the admission of event messages.

Decoders are built once per union. Anything malformed (bad bytes, wrong types, unknown kind, a
future codec version) raises :class:`ProtocolError` naming what was wrong; no other exception
escapes ``decode_*``.

:func:`admit_event` is what an event message must pass before a fold sees it, online (the replayer)
and offline (``leafe replay``) alike, so both decide the same: at most ``Admission.max_event_bytes``
on the wire, a ``Leafe-Codec`` header (``require_codec_header``; off only to read logs written
before it), a decodable body, a subject ``leafe.<run>.events.<kind>.<actor>`` whose run, kind and
actor are the event's, and the event id ``<episode_id>.<seq:06d>`` (``EpisodeStarted`` at seq 0).

The actor token is the publisher's identity (NATS pins each actor's credentials to its own token),
so an admitted event's ``actor_id`` is always that identity, and the per-actor open-episode caps
that key on it cannot be dodged by writing other ids in payloads: a payload ``actor_id`` other than
the token is refused (``forged_actor``). An event on a legacy subject without the token (a log
written before it) is admitted with its ``actor_id`` replaced by
:data:`~leafe.protocol.subjects.LEGACY_ACTOR`: its payload names no identity anyone vouched for, so
all such events share one identity and one cap.

An episode belongs to the actor that started it, and its id says which
(``<task_key>.a<attempt>@<actor>``, ``leafe.protocol.tasks``): an event whose episode id
names another actor than its publisher is refused (``foreign_episode``, "episode X belongs to actor
A; event from actor B"), so no actor can start, extend or end an episode under another's id, even
first; and so is one whose id names no actor at all (``unowned_episode``: nothing would say whose
episode it is, so whoever published first would own it), except from
:data:`~leafe.protocol.subjects.LEGACY_ACTOR` (which no actor may publish as) and where
``Admission.legacy_episode_ids`` is on: to read a log recorded before owned ids (``leafe replay
--legacy-ids``, ``leafe log import --legacy-ids``), never in the live replayer. The fold keeps the
episode to its starter beyond that (``leafe.learner.materializers.base``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from leafe.protocol.events import EpisodeEvent, EpisodeStarted, WeightsPublished, event_id_for
from leafe.protocol.samples import Sample
from leafe.protocol.subjects import EVENTS, LEGACY_ACTOR, event_subject_parts
from leafe.protocol.tasks import TaskAssignment, episode_owner

__all__ = [
    "CODEC_HEADER",
    "CODEC_VERSION",
    "FOREIGN_EPISODE",
    "MSG_ID_HEADER",
    "Admission",
    "ProtocolError",
    "admit_event",
    "decode_event",
    "decode_sample",
    "decode_task",
    "decode_weights",
    "encode",
    "headers_for",
    "message_bytes",
    "message_id",
]

CODEC_VERSION = "1"
"""Bumped only for incompatible changes; readers accept versions they know."""
CODEC_HEADER = "Leafe-Codec"
MSG_ID_HEADER = "Nats-Msg-Id"
_KNOWN_VERSIONS = frozenset({CODEC_VERSION})

T = TypeVar("T")


class ProtocolError(ValueError):
    """A message that cannot be decoded into the expected type; ``reason`` says why, ``category``
    says which kind of refusal it is (one of :data:`REFUSALS`: a small fixed set, fit for a metric
    label)."""

    def __init__(self, what: str, reason: str, category: str = "undecodable") -> None:
        super().__init__(f"cannot decode {what}: {reason}")
        self.what = what
        self.reason = reason
        self.category = category


REFUSALS = (
    "undecodable",
    "oversized",
    "no_codec_header",
    "wrong_subject",
    "wrong_run",
    "forged_id",
    "forged_actor",
    "foreign_episode",
    "unowned_episode",
)
"""Categories of :class:`ProtocolError`: not decodable; over the size limit; no ``Leafe-Codec``
header; published on another kind's subject; on another run's subject; an event id that is not its
own; an ``actor_id`` that is not its subject's actor token; an event of an episode that belongs to
another actor (the fold's code for the same, ``leafe.learner.materializers``); an episode id that
names no owner."""
FOREIGN_EPISODE = "foreign_episode"
"""The refusal of an event in another actor's episode, by admission (the id names the other actor)
and by the fold (the other actor started it): a dead letter's ``Leafe-Error-Code``."""


_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(EpisodeEvent)
_task_decoder = msgspec.msgpack.Decoder(TaskAssignment)
_sample_decoder = msgspec.msgpack.Decoder(Sample)
_weights_decoder = msgspec.msgpack.Decoder(WeightsPublished)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of any protocol Struct."""
    return _encoder.encode(msg)


def message_id(msg: Any) -> str:
    """The id a message is published under (``Nats-Msg-Id``): event_id, task_key or sample_id; an
    episode event's with its ``msg_nonce`` when it has one, ``<event_id>:<msg_nonce>`` (no other
    publisher can predict it, so none can store it first)."""
    for attr in ("event_id", "sample_id", "task_key"):
        value = getattr(msg, attr, None)
        if isinstance(value, str) and value:
            nonce = getattr(msg, "msg_nonce", "") if attr == "event_id" else ""
            return f"{value}:{nonce}" if nonce else value
    raise TypeError(f"{type(msg).__name__} has no message id field")


def headers_for(msg: Any) -> dict[str, str]:
    """NATS headers for publishing ``msg``: dedupe id and codec version."""
    return {MSG_ID_HEADER: message_id(msg), CODEC_HEADER: CODEC_VERSION}


def message_bytes(data: bytes, headers: Mapping[str, str] | None) -> int:
    """Bytes the server counts against ``max_payload``: the header block (``NATS/1.0`` line, one
    ``key: value`` line per header, blank line) plus the body."""
    if not headers:
        return len(data)
    block = 12 + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
    return block + len(data)


def _decode(
    decoder: msgspec.msgpack.Decoder[Any], data: Any, what: str, codec_version: str | None
) -> Any:
    if codec_version is not None and codec_version not in _KNOWN_VERSIONS:
        raise ProtocolError(
            what, f"unknown codec version {codec_version!r} (known: {sorted(_KNOWN_VERSIONS)})"
        )
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(what, f"expected bytes, got {type(data).__name__}")
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(what, f"invalid content: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(what, f"malformed msgpack: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolError(what, f"{type(e).__name__}: {e}") from None


def decode_event(data: bytes, codec_version: str | None = None) -> EpisodeEvent:
    """Decode an episode event; raises :class:`ProtocolError`."""
    return _decode(_event_decoder, data, "episode event", codec_version)  # type: ignore[no-any-return]


class Admission(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What :func:`admit_event` requires of an event message."""

    max_event_bytes: int = EVENTS.max_msg_bytes
    """Largest event message (header block + body, bytes); the ``Publisher`` refuses larger ones
    too."""
    require_codec_header: bool = True
    """Refuse messages without ``Leafe-Codec``; ``False`` only to read logs written before the
    header."""
    legacy_episode_ids: bool = False
    """Admit episode ids that name no owner (``<task_key>.a<attempt>``) from actor tokens; ``True``
    only to read logs recorded before ids named their owner (an id naming *another* actor is refused
    all the same). Tokenless legacy subjects are admitted with their old ids either way."""


def _short(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


def admit_event(
    subject: str, headers: Mapping[str, str] | None, data: bytes, admission: Admission = Admission()
) -> EpisodeEvent:
    """The event of a message on ``subject`` if it passes every check (module docstring), else
    :class:`ProtocolError` with the reason."""
    what = "episode event"
    size = message_bytes(data, headers)
    if size > admission.max_event_bytes:
        limit = admission.max_event_bytes
        raise ProtocolError(
            what, f"event of {size:,} bytes is over the limit of {limit:,} bytes", "oversized"
        )
    version = (headers or {}).get(CODEC_HEADER)
    if version is None and admission.require_codec_header:
        raise ProtocolError(
            what, f"no {CODEC_HEADER} header (require_codec_header is on)", "no_codec_header"
        )
    event = decode_event(data, version)
    try:
        run, kind, actor = event_subject_parts(subject)
    except ValueError as e:
        raise ProtocolError(what, str(e), "wrong_subject") from None
    tag = type(event).__struct_config__.tag
    if kind != tag:
        raise ProtocolError(
            what, f"subject kind {_short(kind)} is not the event's kind {tag!r}", "wrong_subject"
        )
    if run != event.run_id:
        raise ProtocolError(
            what,
            f"run_id {_short(event.run_id)} published on run {_short(run)}'s subject",
            "wrong_run",
        )
    if actor == LEGACY_ACTOR and subject.count(".") == 3:
        event = msgspec.structs.replace(event, actor_id=LEGACY_ACTOR)
    elif actor != event.actor_id:
        raise ProtocolError(
            what,
            f"actor_id {_short(event.actor_id)} published on actor {_short(actor)}'s subject",
            "forged_actor",
        )
    expected = event_id_for(event.episode_id, event.seq)
    if (
        event.event_id != expected
        or event.seq < 0
        or (isinstance(event, EpisodeStarted) and event.seq != 0)
    ):
        got = _short(event.event_id)
        raise ProtocolError(
            what,
            f"event id {got} is not <episode_id>.<seq> ({_short(expected)}; starts at 0)",
            "forged_id",
        )
    _check_owner(event, actor, admission)
    return event


def _check_owner(event: EpisodeEvent, publisher: str, admission: Admission) -> None:
    """The event's episode id names its publisher (or, from the legacy identity or with
    ``legacy_episode_ids``, nobody), else :class:`ProtocolError`."""
    owner = episode_owner(event.episode_id)
    if owner is None:
        if publisher == LEGACY_ACTOR or admission.legacy_episode_ids:
            return
        raise ProtocolError(
            "episode event",
            f"episode id {_short(event.episode_id, 160)} names no owner (ids are "
            "<task_key>.a<attempt>@<actor>); a log recorded before owned ids is read with "
            "legacy_episode_ids (--legacy-ids)",
            "unowned_episode",
        )
    if owner != publisher:
        raise ProtocolError(
            "episode event",
            f"episode {_short(event.episode_id, 160)} belongs to actor {_short(owner)}; event from "
            f"actor {_short(publisher)}",
            FOREIGN_EPISODE,
        )


def decode_task(data: bytes, codec_version: str | None = None) -> TaskAssignment:
    """Decode a task assignment; raises :class:`ProtocolError`."""
    return _decode(_task_decoder, data, "task assignment", codec_version)  # type: ignore[no-any-return]


def decode_sample(data: bytes, codec_version: str | None = None) -> Sample:
    """Decode a sample; raises :class:`ProtocolError`."""
    return _decode(_sample_decoder, data, "sample", codec_version)  # type: ignore[no-any-return]


def decode_weights(data: bytes, codec_version: str | None = None) -> WeightsPublished:
    """Decode a ``WeightsPublished``; raises :class:`ProtocolError`."""
    return _decode(_weights_decoder, data, "weights announcement", codec_version)  # type: ignore[no-any-return]
