"""``leafe log export|import|inspect``: move a run's event log between JetStream and a file, and
look at it.

    leafe log export  --nats URL --run RUN --out run.leafelog     # LEAFE_EVENTS of RUN -> file
    leafe log import  --nats URL --in run.leafelog [--run NEWRUN] # file -> LEAFE_EVENTS, idempotent
    leafe log inspect --file run.leafelog [--episode ID] [--json] # or --nats URL --run RUN

``--nats`` defaults to ``$LEAFE_NATS_URL`` (credentials: ``--creds`` or ``$LEAFE_NATS_CREDS``).
Import verifies the whole file before it publishes anything: a damaged file is refused (exit 1)
unless ``--partial`` is given, which publishes the records before the first damage, says how many
and where the damage starts (on stderr), and exits 0. Every error is one line on stderr naming the
file and, for damage, the byte offset; ``--debug`` raises it with its traceback instead. Every
record must be an event of the file's run that the replayer would admit
(``services/eventlog/transfer.py``); one that is not (a record on the JetStream API, on another
run's or another stream's subject, with a borrowed dedupe id) is refused in one line and nothing is
imported. Import creates no stream: run it as the ``log-import`` NATS role (``--nats-nkey
<dir>/log-import.nk``), which may publish events and nothing else.

The file format is ``services/eventlog/fileformat.py``; export and import
``services/eventlog/transfer.py``; the summary ``services/eventlog/inspect.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from nats.js import JetStreamContext

from leafe.protocol.codec import Admission, ProtocolError
from leafe.services.bus import PublishError, add_nats_arguments, connect, nats_options
from leafe.services.eventlog.fileformat import LogFileError, iter_log_records
from leafe.services.eventlog.inspect import render, summarize, summarize_stream
from leafe.services.eventlog.transfer import (
    ImportStats,
    export_run,
    import_log,
    iter_stream_records,
)
from leafe.services.logsetup import configure_logging

__all__ = ["main"]

R = TypeVar("R")


async def _with_js(args: argparse.Namespace, work: Callable[[JetStreamContext], Awaitable[R]]) -> R:
    nats = nats_options(args)
    if not nats.url:
        raise SystemExit("leafe log: no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    nc = await connect(nats, name="leafe-log")
    try:
        return await work(nc.jetstream())
    finally:
        await nc.close()


def _parser() -> argparse.ArgumentParser:
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
        p.add_argument("--log-level", default="warning", help="log level (default warning)")
        add_nats_arguments(p)
        p.add_argument(
            "--debug", action="store_true", help="on an error, raise it with its traceback"
        )
    exp, imp, ins = (sub.choices[n] for n in ("export", "import", "inspect"))
    exp.add_argument("--run", required=True, help="run id to export")
    exp.add_argument("--out", type=Path, required=True, help="output file (.gz to compress)")
    imp.add_argument("--in", dest="inp", type=Path, required=True, help="log file to import")
    imp.add_argument("--run", default=None, help="import under this run id instead of the original")
    imp.add_argument(
        "--partial",
        action="store_true",
        help="publish the records before a damaged frame (default: none)",
    )
    imp.add_argument(
        "--legacy-ids",
        action="store_true",
        help="a log recorded before episode ids named their actor: admit its ids, and import "
        "those events as actor 'legacy' (default: refuse them)",
    )
    src = ins.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", type=Path, help="log file to inspect")
    src.add_argument("--run", help="run id to inspect on the server (needs --nats)")
    ins.add_argument("--episode", default=None, help="dump this episode's events")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    ins.add_argument("--limit", type=int, default=50, help="episodes listed (default 50)")
    return parser


def _one_line(e: BaseException) -> str:
    """The error as one line: its message, with the type named when it is not one of ours or the
    OS's."""
    ours = (LogFileError, ProtocolError, PublishError, OSError)
    text = str(e) if isinstance(e, ours) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def _import(args: argparse.Namespace) -> int:
    stats: ImportStats = asyncio.run(
        _with_js(
            args,
            lambda js: import_log(
                js,
                args.inp,
                run_id=args.run,
                partial=args.partial,
                admission=Admission(legacy_episode_ids=args.legacy_ids),
            ),
        )
    )
    if stats.damage is not None:
        n = stats.records
        kept = f"{n} records (frames 1..{n}, the first {stats.bytes} bytes)" if n else "no records"
        print(f"leafe log import: --partial: {stats.damage}", file=sys.stderr)
        print(
            f"imported the good prefix of {args.inp}, {kept}, before the damage at byte "
            f"{stats.bytes}: ",
            end="",
        )
    else:
        print(f"imported {stats.records} records from {args.inp}: ", end="")
    print(f"{stats.stored} stored, {stats.duplicates} already there")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.file is not None:
        result = summarize(iter_log_records(args.file), episode=args.episode)
    else:
        result = asyncio.run(
            _with_js(
                args,
                lambda js: summarize_stream(
                    iter_stream_records(js, args.run), episode=args.episode
                ),
            )
        )
    summary, dump = result
    render(summary, dump, as_json=args.json, limit=args.limit)
    if args.episode is not None and not dump:
        print(f"leafe log inspect: episode {args.episode!r} is not in the log", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "export":
        n = asyncio.run(_with_js(args, lambda js: export_run(js, args.run, args.out)))
        print(f"exported {n} events of run {args.run} to {args.out}")
        return 0
    if args.command == "import":
        return _import(args)
    return _inspect(args)


def main(argv: list[str]) -> int:
    """Entry point of ``leafe log``; an error is one line on stderr and exit code 1 (``--debug``:
    raised)."""
    args = _parser().parse_args(argv)
    configure_logging(json=False, level=args.log_level)
    try:
        return _run(args)
    except Exception as e:
        if args.debug:
            raise
        print(f"leafe log {args.command}: {_one_line(e)}", file=sys.stderr)
        return 1
