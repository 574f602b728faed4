"""``leafe replayer redrive``: fold again what the replayer dead-lettered for a cause that is gone.

    leafe replayer redrive --nats URL --run RUN [--reason "(max_open_"] [--dry-run]

A flood of episodes that never finish fills ``max_open_episodes`` (or ``max_open_bytes``), and every
valid episode after it is refused and dead-lettered until the flood is closed as abandoned
(``stale_timeout_s``). Its events are not lost: each dead letter names its original
(``Leafe-Original-Subject/-Stream/-Seq``) and carries its bytes (``services.bus.dead_letters``). Once the
cause is gone, this command publishes the originals of the run's event dead letters whose reason
contains ``--reason`` (default: a cap was reached, ``(max_open_``; which covers the later events of a
refused episode, whose reason repeats the cap's) again on their own subject, in original order, with
``Leafe-Redrive: <original seq>``; the replayer then tries each such episode against the caps anew
(``Replayer._readmit``). Sample ids depend only on event ids, so a redriven episode gives the samples an
offline rebuild gives; events that are folded already are duplicates the fold ignores.

Only what the replayer itself could have received is published again: an original must come from
``LEAFE_EVENTS``, lie on an events subject of ``--run``, have the sha256 its letter recorded, and pass
``protocol.codec.admit_event``; anything else is skipped and counted. Each copy's ``Nats-Msg-Id`` is
``<run>.redrive.<dead letter seq>``, so running the command twice publishes nothing new (within the
events stream's duplicate window), while a letter written when a redriven copy was refused again gets its
own id. Needs a NATS user that may read ``LEAFE_DEAD`` and publish events (the admin).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from dataclasses import asdict, dataclass
from typing import Any

import nats.errors as nats_errors
import structlog
from nats.aio.msg import Msg

from protocol.codec import CODEC_HEADER, MSG_ID_HEADER, Admission, ProtocolError, admit_event
from protocol.subjects import DEAD_LETTERS, EVENTS, dead_letter_subject, event_subject_parts, validate_run_id
from services.bus import NatsOptions, add_nats_arguments, connect, nats_options, read_stream, redact
from services.bus.dead_letters import (
    ERROR_HEADER,
    ORIGINAL_SEQ_HEADER,
    ORIGINAL_SHA256_HEADER,
    ORIGINAL_STREAM_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    REDRIVE_HEADER,
    TRUNCATED_HEADER,
)
from services.logsetup import configure_logging

__all__ = ["CAP_REASON", "RedriveStats", "main", "redrive"]

log = structlog.get_logger(__name__)

CAP_REASON = "(max_open_"
"""What the reasons of cap refusals contain (``max_open_episodes``, ``max_open_per_actor``,
``max_open_bytes``; ``learner.materializers.lifecycle``)."""


@dataclass
class RedriveStats:
    """What a redrive found and did."""

    letters: int = 0
    """Event dead letters of the run."""
    selected: int = 0
    """Those whose reason matched."""
    published: int = 0
    """Originals published again (new messages)."""
    already: int = 0
    """Originals published by an earlier redrive (dropped by the duplicate window)."""
    skipped: int = 0
    """Matched, but not an admissible event of the run (or its original is gone): never published."""
    originals: int = 0
    """Distinct originals to publish (letters of one original, from repeated refusals, count once)."""


def _skip(stats: RedriveStats, letter: Msg, why: str) -> None:
    stats.skipped += 1
    log.warning("redrive.skipped", dead_letter_seq=letter.metadata.sequence.stream, why=why[:200])


async def _original(js: Any, letter: Msg, seq: int) -> bytes | None:
    """The original's bytes: the letter's body when whole, else the stored original (``None`` if gone)."""
    h = letter.headers or {}
    if TRUNCATED_HEADER not in h:
        return bytes(letter.data)
    try:
        return bytes((await js.get_msg(EVENTS.name, seq)).data or b"")
    except nats_errors.Error:
        return None


async def _pick(js: Any, run_id: str, letter: Msg, stats: RedriveStats, admission: Admission) -> Any:
    """``(seq, subject, data, codec)`` of the letter's original if it may be published again, else ``None``."""
    h = letter.headers or {}
    subject = h.get(ORIGINAL_SUBJECT_HEADER, "")
    try:
        seq = int(h.get(ORIGINAL_SEQ_HEADER, ""))
        run, _, _ = event_subject_parts(subject)
    except ValueError as e:
        return _skip(stats, letter, f"no events subject or seq: {e}")
    if h.get(ORIGINAL_STREAM_HEADER) != EVENTS.name or run != run_id:
        return _skip(stats, letter, f"not an event of run {run_id!r}: {subject!r}")
    data = await _original(js, letter, seq)
    if data is None or hashlib.sha256(data).hexdigest() != h.get(ORIGINAL_SHA256_HEADER):
        return _skip(stats, letter, f"original seq {seq} is gone or differs from its letter's sha256")
    codec = h.get(CODEC_HEADER)
    try:
        admit_event(subject, {CODEC_HEADER: codec} if codec else None, data, admission)
    except ProtocolError as e:
        return _skip(stats, letter, e.reason)
    return seq, subject, data, codec


async def redrive(
    js: Any,
    run_id: str,
    *,
    reason: str = CAP_REASON,
    dry_run: bool = False,
    admission: Admission = Admission(),
) -> RedriveStats:
    """Publish again the originals of ``run_id``'s event dead letters whose reason contains ``reason``."""
    run_id = validate_run_id(run_id)
    stats = RedriveStats()
    picked: dict[int, tuple[int, str, bytes, str | None]] = {}
    async for letter in read_stream(
        js, stream=DEAD_LETTERS.name, filter_subject=dead_letter_subject(run_id, EVENTS.name)
    ):
        stats.letters += 1
        if reason not in (letter.headers or {}).get(ERROR_HEADER, ""):
            continue
        stats.selected += 1
        chosen = await _pick(js, run_id, letter, stats, admission)
        if chosen is not None:
            seq, subject, data, codec = chosen
            picked.setdefault(seq, (letter.metadata.sequence.stream, subject, data, codec))
    stats.originals = len(picked)
    for seq in sorted(picked):
        letter_seq, subject, data, codec = picked[seq]
        if dry_run:
            continue
        headers = {MSG_ID_HEADER: f"{run_id}.redrive.{letter_seq}", REDRIVE_HEADER: str(seq)}
        if codec:
            headers[CODEC_HEADER] = codec
        ack = await js.publish(subject, data, headers=headers)
        if getattr(ack, "duplicate", False):
            stats.already += 1
        else:
            stats.published += 1
    log.info("redrive.done", run_id=run_id, dry_run=dry_run, **asdict(stats))
    return stats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leafe replayer redrive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_nats_arguments(p)
    p.add_argument("--run", required=True, help="run whose dead-lettered events are published again")
    p.add_argument(
        "--reason", default=CAP_REASON, help=f"text the reason must contain (default {CAP_REASON!r})"
    )
    p.add_argument("--dry-run", action="store_true", help="count what would be published; publish nothing")
    p.add_argument("--log-level", default="warning", help="log level (default warning)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``leafe replayer redrive``; prints one summary line (or one error line)."""
    p = _parser()
    args = p.parse_args(argv)
    configure_logging(json=False, level=args.log_level)
    try:
        opts = nats_options(args)
        validate_run_id(args.run)
    except ValueError as e:
        p.error(str(e))
    try:
        stats = asyncio.run(_redrive(opts, args.run, args.reason, args.dry_run))
    except (OSError, ValueError, nats_errors.Error) as e:
        print(f"leafe replayer redrive: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    done = f"would publish {stats.originals}" if args.dry_run else f"published {stats.published}"
    print(
        f"redrive {args.run}: {stats.letters} event dead letters, {stats.selected} matching {args.reason!r}; "
        f"{done}, already published {stats.already}, skipped {stats.skipped}"
    )
    return 0


async def _redrive(opts: NatsOptions, run_id: str, reason: str, dry_run: bool) -> RedriveStats:
    if not opts.url:
        raise ValueError("no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    try:
        nc = await connect(opts, name="leafe-redrive")
    except (OSError, nats_errors.Error) as e:
        raise ConnectionError(f"no NATS connection to {redact(opts.url)}: {type(e).__name__}: {e}") from e
    try:
        return await redrive(nc.jetstream(), run_id, reason=reason, dry_run=dry_run)
    finally:
        await nc.close()
