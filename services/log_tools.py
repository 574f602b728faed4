"""``leafe log export|import|inspect``: move a run's event log between JetStream and a file, and look at it.

    leafe log export  --nats URL --run RUN --out run.leafelog     # LEAFE_EVENTS of RUN -> file
    leafe log import  --nats URL --in run.leafelog [--run NEWRUN] # file -> LEAFE_EVENTS (idempotent)
    leafe log inspect --file run.leafelog [--episode ID] [--json] # or --nats URL --run RUN

``--nats`` defaults to ``$LEAFE_NATS_URL`` (credentials: ``--creds`` or ``$LEAFE_NATS_CREDS``).

The file format (``.leafelog``, length-prefixed msgpack records with a header) is ``services/log_file.py``.

Import republishes every record with its ``Nats-Msg-Id``, so importing a file twice (within the
stream's duplicate window, a day by default) stores it once. ``--run NEWRUN`` rewrites subjects and
each event's ``run_id``, and publishes under ``<event_id>@<NEWRUN>`` so a copy next to the original run
on the same server is not mistaken for a duplicate of it.

Library use (offline replay): :func:`iter_log_file`, :func:`read_events`, :func:`read_stream_events`;
:func:`write_events` writes a log file from events without a server (tests, fixtures).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext

from protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, ProtocolError, encode
from protocol.events import EpisodeEvent
from protocol.subjects import EVENTS, event_subject, validate_run_id
from services.bus import Publisher, connect, ensure_streams, read_stream
from services.log_file import (
    MAGIC,
    LogFileError,
    LogHeader,
    LogRecord,
    LogWriter,
    decode_record,
    iter_log_file,
    iter_log_records,
    read_events,
    read_log_header,
    record_for,
    run_filter,
    write_events,
)

__all__ = [
    "MAGIC",
    "ImportStats",
    "LogFileError",
    "LogHeader",
    "LogRecord",
    "LogWriter",
    "export_run",
    "import_log",
    "iter_log_file",
    "iter_log_records",
    "iter_stream_events",
    "iter_stream_records",
    "main",
    "read_events",
    "read_log_header",
    "read_stream_events",
    "record_for",
    "write_events",
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


async def import_log(js: JetStreamContext, path: Path, *, run_id: str | None = None) -> ImportStats:
    """Publish every record of ``path`` to ``LEAFE_EVENTS`` (creating streams as needed); idempotent.

    With ``run_id`` the records are moved to that run (subjects, payload ``run_id``, dedupe id).
    Raises :class:`services.bus.PublishError` if any record was not acknowledged.
    """
    if run_id is not None:
        validate_run_id(run_id)
    await ensure_streams(js)
    records = 0
    async with Publisher(js) as pub:
        for record in iter_log_records(path):
            if run_id is None:
                await pub.publish_raw(record.subject, record.data, dict(record.headers))
            else:
                await pub.publish_raw(*_renamed(record, run_id))
            records += 1
    return ImportStats(records=records, stored=pub.acked - pub.duplicates, duplicates=pub.duplicates)


async def _with_js(args: argparse.Namespace, work: Callable[[JetStreamContext], Awaitable[R]]) -> R:
    if not args.nats:
        raise SystemExit("leafe log: no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    nc = await connect(args.nats, creds=args.creds, name="leafe-log")
    try:
        return await work(nc.jetstream())
    finally:
        await nc.close()


def _parser() -> argparse.ArgumentParser:
    from services.nats_server import nats_url_from_env

    url, creds = nats_url_from_env()
    parser = argparse.ArgumentParser(
        prog="leafe log", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("export", "stream -> file"),
        ("import", "file -> stream"),
        ("inspect", "summarize a log"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--nats", default=url, help="NATS URL (default $LEAFE_NATS_URL)")
        p.add_argument("--creds", default=creds, help="NATS .creds file (default $LEAFE_NATS_CREDS)")
        p.add_argument("--log-level", default="warning", help="log level (default warning)")
    exp, imp, ins = (sub.choices[n] for n in ("export", "import", "inspect"))
    exp.add_argument("--run", required=True, help="run id to export")
    exp.add_argument("--out", type=Path, required=True, help="output file (.gz to compress)")
    imp.add_argument("--in", dest="inp", type=Path, required=True, help="log file to import")
    imp.add_argument("--run", default=None, help="import under this run id instead of the original")
    src = ins.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", type=Path, help="log file to inspect")
    src.add_argument("--run", help="run id to inspect on the server (needs --nats)")
    ins.add_argument("--episode", default=None, help="dump this episode's events")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    ins.add_argument("--limit", type=int, default=50, help="episodes listed (default 50)")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``leafe log``."""
    from services.log_inspect import render, summarize, summarize_stream
    from services.logs import configure_logging

    args = _parser().parse_args(argv)
    configure_logging(json=False, level=args.log_level)
    if args.command == "export":
        n = asyncio.run(_with_js(args, lambda js: export_run(js, args.run, args.out)))
        print(f"exported {n} events of run {args.run} to {args.out}")
        return 0
    if args.command == "import":
        stats = asyncio.run(_with_js(args, lambda js: import_log(js, args.inp, run_id=args.run)))
        print(f"imported {stats.records} records from {args.inp}: ", end="")
        print(f"{stats.stored} stored, {stats.duplicates} already there")
        return 0
    if args.file is not None:
        result = summarize(iter_log_records(args.file), episode=args.episode)
    else:
        result = asyncio.run(
            _with_js(
                args, lambda js: summarize_stream(iter_stream_records(js, args.run), episode=args.episode)
            )
        )
    summary, dump = result
    render(summary, dump, as_json=args.json, limit=args.limit)
    if args.episode is not None and not dump:
        print(f"leafe log inspect: episode {args.episode!r} is not in the log", file=sys.stderr)
        return 1
    return 0
