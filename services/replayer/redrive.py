"""``leafe replayer redrive``: fold again what the replayer dead-lettered for a cause that is gone.

    leafe replayer redrive --nats URL --run RUN [--code max_open_episodes ...] [--dry-run]

A flood of episodes that never finish fills ``max_open_episodes`` (or a byte cap), and every valid
episode after it is refused and dead-lettered until the flood is closed as abandoned
(``stale_timeout_s``). Its events are not lost: each dead letter names its original
(``Leafe-Original-Subject/-Stream/-Seq``) and carries its bytes
(``leafe.services.bus.dead_letters``). Once the cause is gone, this command publishes the originals
of the run's event dead letters whose code (``Leafe-Error-Code``, written by the replayer) is one of
``--code`` (default: every cap, ``leafe.learner.materializers.lifecycle.CAP_CODES``; which covers
the later events of a refused episode, whose code repeats the cap's) again on their own subject, in
original order, with ``Leafe-Redrive: <original seq>``; the replayer then tries each such episode
against the caps anew (``Replayer._readmit``). Sample ids depend only on event ids, so a redriven
episode gives the samples an offline rebuild gives; events that are folded already are duplicates
the fold ignores. Letters are chosen by code, never by their reason's text: a reason can quote what
the publisher wrote (a branch id ``(max_open_...``).

Only what the replayer itself could have received is published again: an original must come from
``LEAFE_EVENTS``, lie on an events subject of ``--run``, have the sha256 its letter recorded, and
pass ``leafe.protocol.codec.admit_event``; anything else is skipped and counted. A redriven letter
is marked on ``leafe.<run>.dead.redriven.<letter seq>`` (written once,
``leafe.services.bus.dead_letters.store_once``), and marked letters are not published again, so
running the command twice publishes nothing new, while a letter written when a redriven copy was
refused again is a letter of its own. Only the admin may write markers, and a marker counts only if
it carries the redrive's ``Leafe-Writer`` (``admin``): a server's answer that some request sent to a
marker subject (its reply subject) is no marker, is counted as ``foreign``, and the marker is
stored after it (such an answer once made a redrive report "already published" and publish
nothing). Messages on the letter subjects that are no letter (no ``Leafe-Error-Code``) are counted
as ``foreign`` too and never published. Markers written before ``Leafe-Writer`` existed do not
count: a redrive after the upgrade may publish their letters once more, duplicates the fold
ignores. Each copy's ``Nats-Msg-Id``
(``<run>.redrive.<letter seq>.<random>``) is one no publisher can predict, so nobody can store it
first and make the copy a dropped "duplicate" (a predictable id once let any actor empty a redrive).
The markers are written once every copy is out, so an episode's copies go out back to back (within
``stale_timeout_s`` of each other); a crash in between publishes those copies once more next time:
duplicate events the fold ignores. Needs a NATS user that may read ``LEAFE_DEAD`` and publish events
and markers (the admin).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import secrets
import sys
from dataclasses import asdict, dataclass
from typing import Any

import nats.errors as nats_errors
import structlog
from nats.aio.msg import Msg

from leafe.learner.materializers.lifecycle import CAP_CODES
from leafe.protocol.codec import CODEC_HEADER, MSG_ID_HEADER, Admission, ProtocolError, admit_event
from leafe.protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    dead_letter_subject,
    event_subject_parts,
    validate_run_id,
)
from leafe.services.bus import (
    NatsOptions,
    add_nats_arguments,
    connect,
    nats_options,
    read_stream,
    redact,
)
from leafe.services.bus.dead_letters import (
    ERROR_CODE_HEADER,
    ORIGINAL_SEQ_HEADER,
    ORIGINAL_SHA256_HEADER,
    ORIGINAL_STREAM_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    REDRIVE_HEADER,
    TRUNCATED_HEADER,
    WRITER_HEADER,
    ForeignMessageError,
    letter_writer,
    letters_filter,
    store_once,
)
from leafe.services.logsetup import configure_logging

__all__ = ["RedriveStats", "main", "redrive", "redriven_subject"]

log = structlog.get_logger(__name__)


def redriven_subject(run_id: str, letter_seq: int) -> str:
    """Where redrive marks a dead letter it published again: ``leafe.<run>.dead.redriven.<letter
    seq>``."""
    return f"{dead_letter_subject(run_id, 'redriven')}.{int(letter_seq)}"


@dataclass
class RedriveStats:
    """What a redrive found and did."""

    letters: int = 0
    """Event dead letters of the run."""
    selected: int = 0
    """Those whose code was asked for."""
    published: int = 0
    """Originals published again (new messages)."""
    already: int = 0
    """Selected letters an earlier redrive published again (marked), left alone."""
    skipped: int = 0
    """Matched, but not an admissible event of the run (or its original is gone): never
    published."""
    originals: int = 0
    """Distinct originals to publish (letters of one original, from repeated refusals, count
    once)."""
    foreign: int = 0
    """Messages on the run's letter or marker subjects that are no letter or marker of ours (a
    server's answer sent there as a reply): never published, never taken for a marker."""


def _skip(stats: RedriveStats, letter: Msg, why: str) -> None:
    stats.skipped += 1
    log.warning("redrive.skipped", dead_letter_seq=letter.metadata.sequence.stream, why=why[:200])


async def _original(js: Any, letter: Msg, seq: int) -> bytes | None:
    """The original's bytes: the letter's body when whole, else the stored original (``None`` if
    gone)."""
    h = letter.headers or {}
    if TRUNCATED_HEADER not in h:
        return bytes(letter.data)
    try:
        return bytes((await js.get_msg(EVENTS.name, seq)).data or b"")
    except nats_errors.Error:
        return None


async def _pick(
    js: Any, run_id: str, letter: Msg, stats: RedriveStats, admission: Admission
) -> Any:
    """``(seq, subject, data, codec)`` of the letter's original if it may be published again, else
    ``None``."""
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
        return _skip(
            stats, letter, f"original seq {seq} is gone or differs from its letter's sha256"
        )
    codec = h.get(CODEC_HEADER)
    try:
        admit_event(subject, {CODEC_HEADER: codec} if codec else None, data, admission)
    except ProtocolError as e:
        return _skip(stats, letter, e.reason)
    return seq, subject, data, codec


async def _marked(js: Any, run_id: str, stats: RedriveStats) -> set[int]:
    """Letter seqs an earlier redrive marked as published again: markers with this redrive's
    ``Leafe-Writer`` (anything else there is counted as foreign)."""
    subject = letters_filter(dead_letter_subject(run_id, "redriven"))
    writer, marked = letter_writer(js), set()
    async for m in read_stream(js, stream=DEAD_LETTERS.name, filter_subject=subject):
        if (m.headers or {}).get(WRITER_HEADER) != writer:
            stats.foreign += 1
            log.warning("redrive.foreign_marker", subject=m.subject, seq=m.metadata.sequence.stream)
            continue
        marked.add(int(m.subject.rsplit(".", 1)[1]))
    return marked


async def _mark(js: Any, run_id: str, letter_seqs: list[int], copy_seq: int) -> None:
    """Mark each letter as published again (as the copy at ``copy_seq``); one marked already (by a
    concurrent redrive) is left, anything else on its subject stepped over."""
    headers = {REDRIVE_HEADER: str(copy_seq), WRITER_HEADER: letter_writer(js)}
    for letter_seq in letter_seqs:
        await store_once(js, redriven_subject(run_id, letter_seq), b"", headers)


async def redrive(
    js: Any,
    run_id: str,
    *,
    codes: frozenset[str] = CAP_CODES,
    dry_run: bool = False,
    admission: Admission = Admission(),
) -> RedriveStats:
    """Publish again the originals of ``run_id``'s event dead letters whose code is one of ``codes``
    and that no earlier redrive published again."""
    run_id = validate_run_id(run_id)
    stats = RedriveStats()
    marked = await _marked(js, run_id, stats)
    picked: dict[int, tuple[list[int], str, bytes, str | None]] = {}
    letters = letters_filter(dead_letter_subject(run_id, EVENTS.name))
    async for letter in read_stream(js, stream=DEAD_LETTERS.name, filter_subject=letters):
        code = (letter.headers or {}).get(ERROR_CODE_HEADER)
        if code is None:  # no letter: a server's answer sent here as a reply
            stats.foreign += 1
            continue
        stats.letters += 1
        if code not in codes:
            continue
        stats.selected += 1
        letter_seq = letter.metadata.sequence.stream
        if letter_seq in marked:
            stats.already += 1
            continue
        chosen = await _pick(js, run_id, letter, stats, admission)
        if chosen is not None:
            seq, subject, data, codec = chosen
            picked.setdefault(seq, ([], subject, data, codec))[0].append(letter_seq)
    stats.originals = len(picked)
    copies: list[tuple[list[int], int]] = []
    for seq in sorted(picked):
        letter_seqs, subject, data, codec = picked[seq]
        if dry_run:
            continue
        headers = {
            MSG_ID_HEADER: f"{run_id}.redrive.{letter_seqs[0]}.{secrets.token_hex(8)}",
            REDRIVE_HEADER: str(seq),
        }
        if codec:
            headers[CODEC_HEADER] = codec
        ack = await js.publish(subject, data, headers=headers)
        copies.append((letter_seqs, ack.seq))
        stats.published += 1
    for (
        letter_seqs,
        copy_seq,
    ) in copies:  # after every copy: an episode's copies go out back to back
        await _mark(js, run_id, letter_seqs, copy_seq)
    log.info("redrive.done", run_id=run_id, dry_run=dry_run, **asdict(stats))
    return stats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leafe replayer redrive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_nats_arguments(p)
    p.add_argument(
        "--run", required=True, help="run whose dead-lettered events are published again"
    )
    p.add_argument(
        "--code",
        action="append",
        choices=sorted(CAP_CODES),
        help="refusal code (Leafe-Error-Code) of the letters to publish again; repeat for several "
        "(default: every cap)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="count what would be published; publish nothing"
    )
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
        codes = frozenset(args.code or CAP_CODES)
        stats = asyncio.run(_redrive(opts, args.run, codes, args.dry_run))
    except (OSError, ValueError, nats_errors.Error, ForeignMessageError) as e:
        print(
            f"leafe replayer redrive: {type(e).__name__}: {' '.join(str(e).split())}",
            file=sys.stderr,
        )
        return 1
    done = f"would publish {stats.originals}" if args.dry_run else f"published {stats.published}"
    print(
        f"redrive {args.run}: {stats.letters} event dead letters, {stats.selected} with codes "
        f"{','.join(sorted(codes))}; "
        f"{done}, already published {stats.already}, skipped {stats.skipped}"
        + (f"; {stats.foreign} foreign messages ignored" if stats.foreign else "")
    )
    return 0


async def _redrive(
    opts: NatsOptions, run_id: str, codes: frozenset[str], dry_run: bool
) -> RedriveStats:
    if not opts.url:
        raise ValueError("no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    try:
        nc = await connect(opts, name="leafe-redrive")
    except (OSError, nats_errors.Error) as e:
        raise ConnectionError(
            f"no NATS connection to {redact(opts.url)}: {type(e).__name__}: {e}"
        ) from e
    try:
        return await redrive(nc.jetstream(), run_id, codes=codes, dry_run=dry_run)
    finally:
        await nc.close()
