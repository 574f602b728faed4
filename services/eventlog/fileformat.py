"""The ``.leafelog`` file format: a run's event log as a file (written by ``leafe log export``).

Layout (gzip-compressed when the name ends in ``.gz``): the 8 magic bytes ``LEAFELOG``, then frames of a
4-byte big-endian length and a msgpack body. The first frame is a :class:`LogHeader` (format and codec
versions, stream, run); every other frame is a :class:`LogRecord` holding a message exactly as stored:
subject, headers, payload bytes, stream sequence and time.

Why not JSONL: payloads are msgpack already, so they are kept byte-for-byte instead of base64-inflated by
a third; the length prefixes let a reader stream a large log and tell a truncated file from a finished
one; ``leafe log inspect`` is the readable view. Reading needs no server::

    for event in read_events("run.leafelog"): ...          # decoded EpisodeEvents, in stream order
    write_events("fixture.leafelog", events, run_id="r1")  # a log file from events (tests, fixtures)
"""

from __future__ import annotations

import gzip
import os
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import msgspec

from protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, ProtocolError, decode_event, encode
from protocol.events import EpisodeEvent
from protocol.subjects import EVENTS, event_subject, events_filter

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "LogFileError",
    "LogHeader",
    "LogRecord",
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

MAGIC = b"LEAFELOG"
FORMAT_VERSION = 1
_LEN = struct.Struct(">I")


class LogFileError(ValueError):
    """An exported log file that is not one, is truncated, or has an unknown format version."""


class LogHeader(msgspec.Struct, frozen=True, kw_only=True):
    """First frame of a log file."""

    format: int = FORMAT_VERSION
    """File format version (frames and record layout)."""
    codec_version: str = CODEC_VERSION
    """Codec version of the exporting code (each record also keeps its own ``Leafe-Codec`` header)."""
    stream: str = EVENTS.name
    """Stream the records came from."""
    run_id: str
    """Run that was exported."""
    filter_subject: str
    """Subject filter used for the export."""
    exported_at: float = 0.0
    """Unix time of the export."""


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


_header_decoder = msgspec.msgpack.Decoder(LogHeader)
_record_decoder = msgspec.msgpack.Decoder(LogRecord)
_encoder = msgspec.msgpack.Encoder()


_GZIP_MAGIC = b"\x1f\x8b"


def _open_read(path: Path) -> IO[bytes]:
    """Open for reading, gzip-compressed or not (told by the content, not the name)."""
    with path.open("rb") as f:
        gz = f.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if gz else path.open("rb")  # type: ignore[return-value]


def _read_frame(f: IO[bytes], path: Path, index: int) -> bytes | None:
    prefix = f.read(_LEN.size)
    if not prefix:
        return None
    if len(prefix) < _LEN.size:
        raise LogFileError(f"{path}: truncated length prefix of frame {index}")
    (size,) = _LEN.unpack(prefix)
    body = f.read(size)
    if len(body) != size:
        raise LogFileError(f"{path}: frame {index} truncated ({len(body)} of {size} bytes)")
    return body


def _frames(path: Path) -> Iterator[bytes]:
    with _open_read(Path(path)) as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise LogFileError(f"{path}: not a LEAFE log file (missing {MAGIC!r} magic)")
        index = 0
        while (body := _read_frame(f, Path(path), index)) is not None:
            yield body
            index += 1


def read_log_header(path: Path) -> LogHeader:
    """The header of a log file; raises :class:`LogFileError`."""
    for body in _frames(path):
        return _decode_header(path, body)
    raise LogFileError(f"{path}: no header frame")


def _decode_header(path: Path, body: bytes) -> LogHeader:
    try:
        header = _header_decoder.decode(body)
    except msgspec.MsgspecError as e:
        raise LogFileError(f"{path}: bad header: {e}") from None
    if header.format != FORMAT_VERSION:
        raise LogFileError(
            f"{path}: log format {header.format} is not supported (this code reads {FORMAT_VERSION})"
        )
    return header


def iter_log_records(path: Path) -> Iterator[LogRecord]:
    """Every record of a log file, in stream order; raises :class:`LogFileError` on a damaged file."""
    frames = _frames(path)
    first = next(frames, None)
    if first is None:
        raise LogFileError(f"{path}: no header frame")
    _decode_header(path, first)
    for index, body in enumerate(frames, start=1):
        try:
            yield _record_decoder.decode(body)
        except msgspec.MsgspecError as e:
            raise LogFileError(f"{path}: bad record in frame {index}: {e}") from None


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
    ``strict=False`` it is skipped instead (``inspect`` counts such records).
    """
    for record in iter_log_records(path):
        try:
            yield decode_record(record)
        except ProtocolError as e:
            if strict:
                raise ProtocolError(f"record {record.subject} seq {record.stream_seq}", e.reason) from None


def run_filter(run_id: str) -> str:
    """Subject filter of a run's events (validates the run id)."""
    return events_filter(run_id)


class LogWriter:
    """Write a log file: ``with LogWriter(path, run_id=...) as w: w.write(record)``; atomic on success."""

    def __init__(self, path: Path, *, run_id: str) -> None:
        self.path = Path(path)
        self.header = LogHeader(run_id=run_id, filter_subject=run_filter(run_id), exported_at=time.time())
        self.count = 0
        self._tmp = self.path.with_name(self.path.name + ".part")
        self._file: IO[bytes] | None = None

    def __enter__(self) -> LogWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        gz = self.path.suffix == ".gz"
        f: IO[bytes] = gzip.open(self._tmp, "wb") if gz else self._tmp.open("wb")  # type: ignore[assignment]
        f.write(MAGIC)
        self._file = f
        self._frame(_encoder.encode(self.header))
        return self

    def _frame(self, body: bytes) -> None:
        assert self._file is not None, "use LogWriter as a context manager"
        self._file.write(_LEN.pack(len(body)))
        self._file.write(body)

    def write(self, record: LogRecord) -> None:
        """Append one record."""
        self._frame(_encoder.encode(record))
        self.count += 1

    def __exit__(self, et: type[BaseException] | None, *rest: object) -> None:
        assert self._file is not None
        self._file.close()
        if et is None:
            os.replace(self._tmp, self.path)
        else:
            self._tmp.unlink(missing_ok=True)  # never leave a half-written log behind


def record_for(event: EpisodeEvent, stream_seq: int) -> LogRecord:
    """The record a published ``event`` would have (subject, headers, bytes as the Publisher sends them)."""
    kind = str(type(event).__struct_config__.tag)
    headers = {MSG_ID_HEADER: event.event_id, CODEC_HEADER: CODEC_VERSION}
    return LogRecord(
        subject=event_subject(event.run_id, kind),
        headers=headers,
        data=encode(event),
        stream_seq=stream_seq,
        ts=event.ts,
    )


def write_events(path: Path, events: Iterable[EpisodeEvent], *, run_id: str) -> int:
    """Write ``events`` as a log file without a server (sequences 1..n); returns the count."""
    with LogWriter(path, run_id=run_id) as writer:
        for seq, event in enumerate(events, start=1):
            writer.write(record_for(event, seq))
    return writer.count
