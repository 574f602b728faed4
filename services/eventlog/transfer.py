"""Moving a run's event log between JetStream and a ``.leafelog`` file (``leafe log
export|import``).

Import first reads the whole file once to verify it (checksums, trailer), then reads it again to
publish, so a damaged file publishes nothing and a huge one is never held in memory;
``partial=True`` publishes the records before the first damage instead. Import republishes every
record with its ``Nats-Msg-Id``, so importing a file twice (within the stream's duplicate window, a
day by default) stores it once. ``run_id=NEWRUN`` rewrites subjects and each event's ``run_id``, and
publishes under ``<msg id>@<NEWRUN>`` so a copy next to the original run on the same server is not
mistaken for a duplicate of it. The file format is ``services/eventlog/fileformat.py``.

A log file is input from outside, so import admits each record exactly as the replayer does
(``leafe.protocol.codec.admit_event``: an event of the file's run on its own kind's events subject,
with its actor's token, its id ``<episode_id>.<seq>``), and allows only the headers the Publisher
writes, with a ``Nats-Msg-Id`` that is the event's own (its id, with its ``msg_nonce`` when it
has one): a record on any other subject (the
JetStream API, another run's samples) or a dedupe id borrowed from another event raises
:class:`ImportRefusedError` in the verification pass, before anything is published. A record of a
log written before actor tokens (``leafe.<run>.events.<kind>``) keeps its subject, and the replayer
counts it as actor ``legacy``; moved to another run, it is published on the ``legacy`` token with
that ``actor_id``. A log recorded before episode ids named their actor (``<task_key>.a<attempt>``
on an actor's token; its header lacks ``owned_episode_ids``) is read with
``Admission.legacy_episode_ids`` (as is any file with ``leafe log import --legacy-ids``), and each
event whose id names no owner is published on the ``legacy`` token with that ``actor_id`` (its
dedupe id kept): the replayer admits such ids only from that identity, which no actor may publish
as. A newer file's unowned ids are refused. Import creates nothing: it runs as the ``log-import``
role of permissions.json, which may publish events (on any actor token: importing is an
operator's act) and read its own inbox (the acks), nothing else; ``leafe streams ensure`` makes the
streams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext

from leafe.protocol.codec import (
    CODEC_HEADER,
    CODEC_VERSION,
    MSG_ID_HEADER,
    Admission,
    ProtocolError,
    admit_event,
    encode,
    message_id,
)
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import EVENTS, LEGACY_ACTOR, event_subject, validate_run_id
from leafe.protocol.tasks import episode_owner
from leafe.services.bus import Publisher, PublishError, read_stream
from leafe.services.bus.streams import ENSURE_COMMAND
from leafe.services.eventlog.fileformat import (
    LogFile,
    LogHeader,
    LogRecord,
    LogWriter,
    decode_record,
    run_filter,
)

__all__ = [
    "IMPORT_HEADERS",
    "ImportRefusedError",
    "ImportStats",
    "export_run",
    "for_header",
    "import_log",
    "iter_stream_events",
    "iter_stream_records",
    "read_stream_events",
]

R = TypeVar("R")
IMPORT_HEADERS = frozenset({MSG_ID_HEADER, CODEC_HEADER})
"""The only headers an imported record may carry: what the Publisher writes (``Nats-*`` headers such
as ``Nats-Expected-Last-Sequence`` or ``Nats-Rollup`` would steer JetStream itself)."""


class ImportRefusedError(ProtocolError):
    """A record of a log file that the replayer would not admit; nothing of the file was
    published."""

    def __init__(
        self, path: Path, index: int, record: LogRecord, reason: str, category: str
    ) -> None:
        where = f"{path}: record {index} (seq {record.stream_seq}) on {record.subject[:200]!r}"
        super().__init__(where, reason, category)
        self.args = (f"{where} refused: {reason}; nothing was imported",)

    def __str__(self) -> str:
        return str(self.args[0])


class ImportStats(msgspec.Struct, frozen=True, kw_only=True):
    """What an import did."""

    records: int
    """Records read from the file."""
    stored: int
    """Records newly stored."""
    duplicates: int
    """Records JetStream already had (same ``Nats-Msg-Id`` within the duplicate window)."""
    bytes: int = 0
    """Bytes of the file the published records came from (the good prefix's end when ``damage``)."""
    damage: str | None = None
    """With ``partial``: the damage that ended the good prefix (``None`` when the file was
    whole)."""


async def iter_stream_records(js: JetStreamContext, run_id: str) -> AsyncIterator[LogRecord]:
    """Every stored event message of ``run_id`` (at call time) as :class:`LogRecord`, in stream
    order."""
    async for msg in read_stream(js, stream=EVENTS.name, filter_subject=run_filter(run_id)):
        meta = msg.metadata
        headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
        ts = meta.timestamp.timestamp() if meta.timestamp else 0.0
        yield LogRecord(
            subject=msg.subject,
            headers=headers,
            data=msg.data,
            stream_seq=meta.sequence.stream,
            ts=ts,
        )


async def iter_stream_events(js: JetStreamContext, run_id: str) -> AsyncIterator[EpisodeEvent]:
    """Decoded events of ``run_id`` from ``LEAFE_EVENTS``, in stream order; raises
    :class:`ProtocolError`."""
    async for record in iter_stream_records(js, run_id):
        try:
            yield decode_record(record)
        except ProtocolError as e:
            raise ProtocolError(
                f"stream record {record.subject} seq {record.stream_seq}", e.reason
            ) from None


async def read_stream_events(js: JetStreamContext, run_id: str) -> list[EpisodeEvent]:
    """All events of ``run_id`` from ``LEAFE_EVENTS``, in stream order (used by offline replay)."""
    return [event async for event in iter_stream_events(js, run_id)]


async def export_run(js: JetStreamContext, run_id: str, out: Path) -> int:
    """Write the run's events to ``out`` (atomically: a temp file renamed at the end); returns the
    count."""
    with LogWriter(out, run_id=run_id) as writer:
        async for record in iter_stream_records(js, run_id):
            writer.write(record)
    return writer.count


def _admitted(record: LogRecord, source_run: str, admission: Admission) -> EpisodeEvent:
    """The record's event if the replayer would admit it as an event of ``source_run`` (and its
    headers are the Publisher's, with the event's own dedupe id); else :class:`ProtocolError`."""
    what = "imported record"
    extra = sorted(set(record.headers) - IMPORT_HEADERS)
    if extra:
        raise ProtocolError(
            what, f"header(s) {extra[:5]} (an event carries only {sorted(IMPORT_HEADERS)})"
        )
    event = admit_event(record.subject, record.headers, record.data, admission)
    if event.run_id != source_run:
        raise ProtocolError(
            what, f"an event of run {event.run_id!r} in a log of run {source_run!r}", "wrong_run"
        )
    msg_id = record.headers.get(MSG_ID_HEADER)
    own = {event.event_id, message_id(event)}  # the Publisher's (with the event's msg_nonce)
    if msg_id not in own | {f"{i}@{event.run_id}" for i in own}:
        raise ProtocolError(
            what,
            f"{MSG_ID_HEADER} {str(msg_id)[:80]!r} is not the event's id {event.event_id!r}",
            "forged_id",
        )
    return event


def _renamed(event: EpisodeEvent, run_id: str) -> tuple[str, bytes, dict[str, str]]:
    event = msgspec.structs.replace(event, run_id=run_id)
    kind = type(event).__struct_config__.tag
    headers = {MSG_ID_HEADER: f"{message_id(event)}@{run_id}", CODEC_HEADER: CODEC_VERSION}
    return event_subject(run_id, str(kind), event.actor_id), encode(event), headers


def for_header(admission: Admission, header: LogHeader) -> Admission:
    """``admission`` for the records of a file with ``header``: with ``legacy_episode_ids`` if the
    file was written before episode ids named their actor."""
    if header.owned_episode_ids or admission.legacy_episode_ids:
        return admission
    return msgspec.structs.replace(admission, legacy_episode_ids=True)


def _unowned(event: EpisodeEvent) -> bool:
    """An event of an actor whose episode id names no owner (admitted with
    ``legacy_episode_ids``)."""
    return event.actor_id != LEGACY_ACTOR and episode_owner(event.episode_id) is None


def _as_legacy(record: LogRecord, event: EpisodeEvent) -> tuple[str, bytes, dict[str, str]]:
    """``event`` on the ``legacy`` token with that ``actor_id``, its record's dedupe id kept."""
    event = msgspec.structs.replace(event, actor_id=LEGACY_ACTOR)
    kind = type(event).__struct_config__.tag
    headers = {k: v for k, v in record.headers.items() if k in IMPORT_HEADERS}
    headers[CODEC_HEADER] = CODEC_VERSION
    return event_subject(event.run_id, str(kind), LEGACY_ACTOR), encode(event), headers


def _admit_all(
    log_file: LogFile, records: int | None, admission: Admission
) -> Iterator[tuple[LogRecord, EpisodeEvent]]:
    """``(record, event)`` of the first ``records`` records (all when None), each admitted as an
    event of the file's run; the first refusal raises :class:`ImportRefusedError`. A file written
    before episode ids named their actor is read with ``legacy_episode_ids``."""
    source_run = log_file.header.run_id
    admission = for_header(admission, log_file.header)
    for index, record in enumerate(log_file.records(limit=records), start=1):
        try:
            yield record, _admitted(record, source_run, admission)
        except ProtocolError as e:
            raise ImportRefusedError(log_file.path, index, record, e.reason, e.category) from None


async def import_log(
    js: JetStreamContext,
    path: Path,
    *,
    run_id: str | None = None,
    partial: bool = False,
    admission: Admission = Admission(),
) -> ImportStats:
    """Publish every record of ``path`` to ``LEAFE_EVENTS`` (which must exist); idempotent.

    The file is verified first (checksums, trailer, and every record admitted as the replayer would,
    with ``admission``): a damaged one raises :class:`LogFileError` and a hostile or foreign record
    :class:`ImportRefusedError` before anything is published, unless ``partial``, which publishes
    the records before the damage (``ImportStats.damage`` says what ended them; a refused record is
    never skipped). With ``run_id`` the records are moved to that run (subjects, payload ``run_id``,
    dedupe id). Raises :class:`leafe.services.bus.PublishError` if any record was not acknowledged.
    """
    if run_id is not None:
        validate_run_id(run_id)
    log_file = LogFile(path)
    check = log_file.check()
    if check.error is not None and not partial:
        raise check.error.extended(
            f"nothing was imported (--partial would publish the {check.records} records before "
            "byte "
            f"{check.bytes})"
        )
    limit = None if check.error is None else check.records
    for _ in _admit_all(log_file, limit, admission):
        pass  # every record passes before the first is published
    try:
        stats = await _publish(js, log_file, limit, admission, run_id)
    except PublishError as e:
        if "NoStreamResponse" not in str(e):
            raise
        hint = (
            f"; is there a stream {EVENTS.name}? (made by {ENSURE_COMMAND}; import creates nothing)"
        )
        raise PublishError(str(e) + hint, e.unacked, e.reasons) from None
    return msgspec.structs.replace(
        stats, bytes=check.bytes, damage=None if check.error is None else str(check.error)
    )


async def _publish(
    js: JetStreamContext,
    log_file: LogFile,
    limit: int | None,
    admission: Admission,
    run_id: str | None,
) -> ImportStats:
    records = 0
    async with Publisher(js) as pub:
        # verified and admitted again as it is published (the file could change between the passes)
        for record, event in _admit_all(log_file, limit, admission):
            if run_id is not None:
                if _unowned(event):
                    event = msgspec.structs.replace(event, actor_id=LEGACY_ACTOR)
                await pub.publish_raw(*_renamed(event, run_id))
            elif _unowned(event):
                await pub.publish_raw(*_as_legacy(record, event))
            else:
                headers = {k: v for k, v in record.headers.items() if k in IMPORT_HEADERS}
                await pub.publish_raw(record.subject, record.data, headers)
            records += 1
    return ImportStats(
        records=records, stored=pub.acked - pub.duplicates, duplicates=pub.duplicates
    )
