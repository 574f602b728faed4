"""The ``.leafelog`` file format: a run's event log as a file (written by ``leafe log export``).

Format 2 (gzip-compressed when the name ends in ``.gz``; offsets are then of the uncompressed
stream)::

    "LEAFELOG"                                   8 magic bytes
    frame: length | body (msgpack) | CRC32C of length+body  (length and CRC32C: 4 bytes, big-endian)
      frame 0      LogHeader   (a msgpack map)    format, codec version, stream, run
      frames 1..n  LogRecord   (a msgpack array)  one message each, exactly as JetStream stored it
      frame n+1    LogTrailer  (a msgpack map)    n, and the sha256 of every byte before this frame
    end of file

Records are msgpack arrays and the trailer a map, so a reader tells them apart by the body's first
byte. A reader checks every frame's CRC32C as it goes, then the trailer (record count, whole-file
sha256) and that nothing follows it. Damage of any kind raises :class:`LogFileError` naming the byte
offset and index of the first bad frame, so a file cut at a frame boundary, a flipped bit in a token
id or appended garbage never reads as a shorter or different log. Format 1 (no checksums, no
trailer; frames are just length and body) is still read, with an ``eventlog.file.unverified``
warning: its damage can go unseen.

Why not JSONL: payloads are msgpack already, so they are kept byte-for-byte instead of
base64-inflated by a third; the header keeps format 1's framing so any version can read its
``format`` before knowing the frame layout; ``leafe log inspect`` is the readable view. Reading
needs no server::

    # decoded EpisodeEvents, in stream order
    for event in read_events("run.leafelog"): ...
    # one pass: records verified, first damage
    check = LogFile("run.leafelog").check()
    # a log file from events (tests, fixtures)
    write_events("fixture.leafelog", events, run_id="r1")

Streaming readers yield records before the trailer is checked: a caller must not act irreversibly on
them until the iteration has ended without an error (``leafe log import`` checks the whole file
first).
"""

from __future__ import annotations

import gzip
import io
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import msgspec
import structlog

from leafe.protocol.codec import (
    CODEC_HEADER,
    CODEC_VERSION,
    MSG_ID_HEADER,
    ProtocolError,
    decode_event,
    encode,
    message_id,
)
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import EVENTS, event_subject, events_filter
from leafe.services.eventlog.framing import MAGIC, FrameReader, FrameWriter, LogFileError, open_log

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "READABLE_FORMATS",
    "LogCheck",
    "LogFile",
    "LogFileError",
    "LogHeader",
    "LogRecord",
    "LogTrailer",
    "LogWriter",
    "decode_record",
    "iter_log_file",
    "iter_log_records",
    "read_events",
    "read_log_header",
    "record_for",
    "run_filter",
    "write_events",
]

FORMAT_VERSION = 2
"""Format written by this code."""
READABLE_FORMATS = (1, 2)
"""Formats this code reads (1 without verification)."""

log = structlog.get_logger("leafe.services.eventlog")


class LogHeader(msgspec.Struct, frozen=True, kw_only=True):
    """First frame of a log file."""

    format: int = FORMAT_VERSION
    """File format version (frames and record layout)."""
    codec_version: str = CODEC_VERSION
    """Codec version of the exporting code (each record also keeps its own ``Leafe-Codec``
    header)."""
    stream: str = EVENTS.name
    """Stream the records came from."""
    run_id: str
    """Run that was exported."""
    filter_subject: str
    """Subject filter used for the export."""
    exported_at: float = 0.0
    """Unix time of the export."""
    owned_episode_ids: bool = False
    """Written by code whose episode ids name their actor (``leafe.protocol.tasks``); absent
    (``False``) in files written before, whose ids anyone could predict: ``leafe replay`` and
    ``leafe log import`` read those with ``Admission.legacy_episode_ids``."""


class LogRecord(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One stored message, exactly as JetStream held it."""

    subject: str
    """Subject it was published on."""
    headers: dict[str, str]
    """Its headers (``Nats-Msg-Id``, ``Leafe-Codec``, ...)."""
    data: bytes
    """Payload bytes (msgpack of an event)."""
    stream_seq: int
    """Sequence in the source stream."""
    ts: float = 0.0
    """Unix time JetStream stored it."""


class LogTrailer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Last frame of a format-2 file: proof that the file ends where its writer ended it."""

    records: int
    """Record frames between the header and this trailer."""
    sha256: str
    """Hex sha256 of every byte before this frame (magic, header, records; uncompressed)."""


@dataclass(frozen=True)
class LogCheck:
    """What one full verification pass found (:meth:`LogFile.check`)."""

    format: int | None
    """The header's format, ``None`` when the header itself is unreadable."""
    records: int
    """Records before the first damage that passed their checks: the good prefix (all when
    intact)."""
    bytes: int
    """Offset where the good prefix ends: the first bad frame's, or the file's (uncompressed)
    size."""
    verified: bool
    """Whether the file could be verified at all (format 2); format 1 has nothing to check."""
    error: LogFileError | None
    """The first damage, ``None`` when the file is intact."""


_header_decoder = msgspec.msgpack.Decoder(LogHeader)
_record_decoder = msgspec.msgpack.Decoder(LogRecord)
_trailer_decoder = msgspec.msgpack.Decoder(LogTrailer)
_encoder = msgspec.msgpack.Encoder()


def _is_map(body: memoryview) -> bool:
    """Whether a msgpack body is a map (a trailer) rather than an array (a record): its first
    byte."""
    return bool(body) and (body[0] & 0xF0 == 0x80 or body[0] in (0xDE, 0xDF))


def _decode_header(reader: FrameReader, body: memoryview) -> LogHeader:
    try:
        header = _header_decoder.decode(body)
    except msgspec.MsgspecError as e:
        raise reader.error(f"bad header: {e}", frame=0) from None
    if header.format not in READABLE_FORMATS:
        raise reader.error(
            f"log format {header.format} is not supported (this code reads formats 1 and 2)",
            frame=0,
        )
    return header


def _check_trailer(reader: FrameReader, trailer: LogTrailer, records: int) -> None:
    if trailer.records != records:
        raise reader.error(
            f"the trailer says {trailer.records} records, the file has {records}",
            frame=reader.index,
        )
    if reader.verify and (digest := reader.digest_before()) != trailer.sha256:
        raise reader.error(
            f"sha256 of the bytes before the trailer is {digest[:16]}..., the trailer says "
            f"{trailer.sha256[:16]}... (frames missing, repeated or reordered?)",
            frame=reader.index,
        )
    reader.expect_end()


class LogFile:
    """A log file on disk: its header, its records (verified as they stream), a full check pass.

    Opening reads nothing; each pass reads the file again, so nothing is held in memory. A format-1
    file logs one ``eventlog.file.unverified`` warning per :class:`LogFile`.
    """

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        self.path = Path(path)
        self.verify = verify
        """Check checksums and the sha256 (``False`` only for benchmarks and salvage)."""
        self._warned = False

    def _open(self) -> tuple[io.BufferedIOBase, FrameReader, LogHeader]:
        f, gz = open_log(self.path)
        try:
            reader = FrameReader(f, self.path, compressed=gz, verify=self.verify)
            reader.magic()
            body = reader.next()
            if body is None:
                raise reader.error("no header frame (the file ends after the magic)", frame=0)
            header = _decode_header(reader, body)
            if header.format >= 2:
                reader.check_crc()
                reader.checksums = True
            elif not self._warned:
                self._warned = True
                log.warning(
                    "eventlog.file.unverified",
                    path=str(self.path),
                    format=header.format,
                    detail=f"format {header.format} has no checksums and no trailer: "
                    "damage may go unseen",
                )
            return f, reader, header
        except BaseException:
            f.close()
            raise

    @property
    def header(self) -> LogHeader:
        """The header frame (checked, as every read is)."""
        f, _, header = self._open()
        f.close()
        return header

    def _frames(self, reader: FrameReader, header: LogHeader) -> Iterator[LogRecord]:
        records = 0
        while (body := reader.next()) is not None:
            trailer = _is_map(body) and header.format >= 2
            try:
                item = (_trailer_decoder if trailer else _record_decoder).decode(body)
            except msgspec.MsgspecError as e:
                what = "trailer" if trailer else "record"
                raise reader.error(f"undecodable {what}: {e}", frame=reader.index) from None
            if isinstance(item, LogTrailer):
                _check_trailer(reader, item, records)
                return
            records += 1
            yield item
        if header.format >= 2:
            raise reader.error(
                f"the file ends after {records} records with no trailer (cut at a frame boundary?)",
                frame=reader.index,
            )

    def records(self, *, limit: int | None = None) -> Iterator[LogRecord]:
        """Every record in order, or the first ``limit``; raises :class:`LogFileError` at the first
        damage.

        Without ``limit`` the end of the iteration is the proof the file is whole; with it, only the
        frames read are checked (use it after :meth:`check` to read a verified prefix again).
        """
        if limit == 0:
            return
        f, reader, header = self._open()
        with f:
            for n, record in enumerate(self._frames(reader, header), start=1):
                yield record
                if n == limit:
                    return

    def check(self) -> LogCheck:
        """Read the whole file once, verifying everything; the first damage is returned, not
        raised."""
        records, fmt = 0, None
        reader: FrameReader | None = None
        try:
            f, reader, header = self._open()
            fmt = header.format
            with f:
                for _ in self._frames(reader, header):
                    records += 1
        except LogFileError as e:
            good = e.offset if e.offset is not None else 0
            return LogCheck(
                format=fmt, records=records, bytes=good, verified=(fmt or 0) >= 2, error=e
            )
        return LogCheck(
            format=fmt, records=records, bytes=reader.offset, verified=(fmt or 0) >= 2, error=None
        )


def read_log_header(path: Path) -> LogHeader:
    """The header of a log file; raises :class:`LogFileError`."""
    return LogFile(path).header


def iter_log_records(path: Path, *, verify: bool = True) -> Iterator[LogRecord]:
    """Every record of a log file, in stream order; raises :class:`LogFileError` on a damaged
    file."""
    return LogFile(path, verify=verify).records()


def iter_log_file(path: Path) -> Iterator[tuple[str, dict[str, str], bytes]]:
    """``(subject, headers, data)`` of every record of a log file, in stream order."""
    for record in iter_log_records(path):
        yield record.subject, record.headers, record.data


def decode_record(record: LogRecord) -> EpisodeEvent:
    """Decode a record's payload with its own codec header; raises :class:`ProtocolError`."""
    return decode_event(record.data, record.headers.get(CODEC_HEADER))


def read_events(path: Path, *, strict: bool = True) -> Iterator[EpisodeEvent]:
    """Decoded events of a log file, in stream order.

    An undecodable record raises :class:`ProtocolError` naming its subject and sequence; with
    ``strict=False`` it is skipped instead (``inspect`` counts such records). A damaged file raises
    :class:`LogFileError` either way.
    """
    for record in iter_log_records(path):
        try:
            yield decode_record(record)
        except ProtocolError as e:
            if strict:
                raise ProtocolError(
                    f"record {record.subject} seq {record.stream_seq}", e.reason
                ) from None


def run_filter(run_id: str) -> str:
    """Subject filter of a run's events (validates the run id)."""
    return events_filter(run_id)


class LogWriter:
    """Write a log file: ``with LogWriter(path, run_id=...) as w: w.write(record)``; atomic on
    success.

    Writes format 2: the trailer goes in when the ``with`` block ends without an exception, then the
    temporary ``.part`` file is renamed into place; on an exception the partial file is removed.
    """

    def __init__(self, path: Path, *, run_id: str, owned_episode_ids: bool = True) -> None:
        self.path = Path(path)
        self.header = LogHeader(
            run_id=run_id,
            filter_subject=run_filter(run_id),
            exported_at=time.time(),
            owned_episode_ids=owned_episode_ids,
        )
        self.count = 0
        self._tmp = self.path.with_name(self.path.name + ".part")
        self._file: IO[bytes] | None = None
        self._frames: FrameWriter | None = None

    def __enter__(self) -> LogWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        gz = self.path.suffix == ".gz"
        f: IO[bytes] = gzip.open(self._tmp, "wb") if gz else self._tmp.open("wb")  # type: ignore[assignment]
        self._file, self._frames = f, FrameWriter(f)
        self._frames.magic()
        self._frames.frame(_encoder.encode(self.header))
        return self

    def write(self, record: LogRecord) -> None:
        """Append one record."""
        assert self._frames is not None, "use LogWriter as a context manager"
        self._frames.frame(_encoder.encode(record))
        self.count += 1

    def __exit__(self, et: type[BaseException] | None, *rest: object) -> None:
        assert self._file is not None and self._frames is not None
        try:
            if et is None:
                trailer = LogTrailer(records=self.count, sha256=self._frames.digest())
                self._frames.frame(_encoder.encode(trailer))
        finally:
            self._file.close()
        if et is None:
            os.replace(self._tmp, self.path)
        else:
            self._tmp.unlink(missing_ok=True)  # never leave a half-written log behind


def record_for(event: EpisodeEvent, stream_seq: int) -> LogRecord:
    """The record a published ``event`` would have (subject, headers, bytes as the Publisher sends
    them)."""
    kind = str(type(event).__struct_config__.tag)
    headers = {MSG_ID_HEADER: message_id(event), CODEC_HEADER: CODEC_VERSION}
    return LogRecord(
        subject=event_subject(event.run_id, kind, event.actor_id),
        headers=headers,
        data=encode(event),
        stream_seq=stream_seq,
        ts=event.ts,
    )


def write_events(
    path: Path, events: Iterable[EpisodeEvent], *, run_id: str, owned_episode_ids: bool = True
) -> int:
    """Write ``events`` as a log file without a server (sequences 1..n); returns the count
    (``owned_episode_ids=False``: a file as written before episode ids named their actor)."""
    with LogWriter(path, run_id=run_id, owned_episode_ids=owned_episode_ids) as writer:
        for seq, event in enumerate(events, start=1):
            writer.write(record_for(event, seq))
    return writer.count
