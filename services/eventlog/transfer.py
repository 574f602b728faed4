"""Moving a run's event log between JetStream and a ``.leafelog`` file (``leafe log export|import``).

Import first reads the whole file once to verify it (checksums, trailer), then reads it again to
publish, so a damaged file publishes nothing and a huge one is never held in memory; ``partial=True``
publishes the records before the first damage instead. Import republishes every record with its
``Nats-Msg-Id``, so importing a file twice (within the stream's duplicate window, a day by default)
stores it once. ``run_id=NEWRUN`` rewrites subjects and each event's ``run_id``, and publishes under
``<event_id>@<NEWRUN>`` so a copy next to the original run on the same server is not mistaken for a
duplicate of it. The file format is ``services/eventlog/fileformat.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext

from protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, ProtocolError, encode
from protocol.events import EpisodeEvent
from protocol.subjects import EVENTS, event_subject, validate_run_id
from services.bus import Publisher, ensure_streams, read_stream
from services.eventlog.fileformat import LogFile, LogRecord, LogWriter, decode_record, run_filter

__all__ = [
    "ImportStats",
    "export_run",
    "import_log",
    "iter_stream_events",
    "iter_stream_records",
    "read_stream_events",
]

R = TypeVar("R")


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
    """With ``partial``: the damage that ended the good prefix (``None`` when the file was whole)."""


async def iter_stream_records(js: JetStreamContext, run_id: str) -> AsyncIterator[LogRecord]:
    """Every stored event message of ``run_id`` (at call time) as :class:`LogRecord`, in stream order."""
    async for msg in read_stream(js, stream=EVENTS.name, filter_subject=run_filter(run_id)):
        meta = msg.metadata
        headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
        ts = meta.timestamp.timestamp() if meta.timestamp else 0.0
        yield LogRecord(
            subject=msg.subject, headers=headers, data=msg.data, stream_seq=meta.sequence.stream, ts=ts
        )


async def iter_stream_events(js: JetStreamContext, run_id: str) -> AsyncIterator[EpisodeEvent]:
    """Decoded events of ``run_id`` from ``LEAFE_EVENTS``, in stream order; raises :class:`ProtocolError`."""
    async for record in iter_stream_records(js, run_id):
        try:
            yield decode_record(record)
        except ProtocolError as e:
            raise ProtocolError(f"stream record {record.subject} seq {record.stream_seq}", e.reason) from None


async def read_stream_events(js: JetStreamContext, run_id: str) -> list[EpisodeEvent]:
    """All events of ``run_id`` from ``LEAFE_EVENTS``, in stream order (used by offline replay)."""
    return [event async for event in iter_stream_events(js, run_id)]


async def export_run(js: JetStreamContext, run_id: str, out: Path) -> int:
    """Write the run's events to ``out`` (atomically: a temp file renamed at the end); returns the count."""
    with LogWriter(out, run_id=run_id) as writer:
        async for record in iter_stream_records(js, run_id):
            writer.write(record)
    return writer.count


def _renamed(record: LogRecord, run_id: str) -> tuple[str, bytes, dict[str, str]]:
    try:
        event = decode_record(record)
    except ProtocolError as e:
        raise ProtocolError(
            f"record {record.subject} seq {record.stream_seq} (cannot rename its run)", e.reason
        ) from None
    event = msgspec.structs.replace(event, run_id=run_id)
    kind = type(event).__struct_config__.tag
    headers = {**record.headers, MSG_ID_HEADER: f"{event.event_id}@{run_id}", CODEC_HEADER: CODEC_VERSION}
    return event_subject(run_id, str(kind)), encode(event), headers


async def import_log(
    js: JetStreamContext, path: Path, *, run_id: str | None = None, partial: bool = False
) -> ImportStats:
    """Publish every record of ``path`` to ``LEAFE_EVENTS`` (creating streams as needed); idempotent.

    The file is verified first: a damaged one raises :class:`LogFileError` before anything is
    published, unless ``partial``, which publishes the records before the damage (``ImportStats.damage``
    says what ended them). With ``run_id`` the records are moved to that run (subjects, payload
    ``run_id``, dedupe id). Raises :class:`services.bus.PublishError` if any record was not acknowledged.
    """
    if run_id is not None:
        validate_run_id(run_id)
    log_file = LogFile(path)
    check = log_file.check()
    if check.error is not None and not partial:
        raise check.error.extended(
            f"nothing was imported (--partial would publish the {check.records} records before byte "
            f"{check.bytes})"
        )
    await ensure_streams(js)
    records = 0
    async with Publisher(js) as pub:
        # an intact file is verified again as it is published (it could change between the passes)
        for record in log_file.records(limit=None if check.error is None else check.records):
            if run_id is None:
                await pub.publish_raw(record.subject, record.data, dict(record.headers))
            else:
                await pub.publish_raw(*_renamed(record, run_id))
            records += 1
    return ImportStats(
        records=records,
        stored=pub.acked - pub.duplicates,
        duplicates=pub.duplicates,
        bytes=check.bytes,
        damage=None if check.error is None else str(check.error),
    )
