"""Dead letters: where a rejected message goes, with its reason, so nothing refused is lost.

A dead letter is published on ``<dead subject>.<key>`` (stream ``LEAFE_DEAD``; the dead subject is
``leafe.<run>.dead.<stream>`` of the consumer's stream: the replayer's all go to
``dead.leafe_events``, samples it could not store included; an actor's to ``dead.leafe_tasks.<actor
id>``) with the reason in ``Leafe-Error``, its code in ``Leafe-Error-Code`` (a small fixed set: what
tools select letters by, never the reason's text, which can quote the input) and where the original
lives in ``Leafe-Original-Subject/-Stream/-Seq`` (or ``Leafe-Sample-Id``); its body is the
original's bytes, with their size and sha256 in ``Leafe-Original-Bytes`` and
``Leafe-Original-Sha256``.

The key is a function of the original alone (its stream seq, or ``sample-<sample id>`` for a sample
that was never stored), so each letter has a subject of its own, and it is published with
``Nats-Expected-Last-Subject-Sequence: 0``: JetStream stores it only if that subject is empty. A
redo after a crash is refused as "wrong last sequence" and taken as stored: a restarted consumer can
always redo it, and acks a message only after its dead letter is stored. Why not a ``Nats-Msg-Id``:
JetStream deduplicates ids stream-wide, whatever the subject, so anyone who may publish anything
into ``LEAFE_DEAD`` (an actor, its task letters) could store a predictable id first and make the
real letter a "duplicate" that is never written. A subject is what NATS permissions pin: only the
replayer may publish ``dead.leafe_events.*``, only the learner ``dead.leafe_samples.*``, each actor
only ``dead.leafe_tasks.<its id>.*``.

Sizes: a dead letter must fit the server's ``max_payload`` (headers included, or the server closes
the connection). When the original plus the dead letter's headers would not fit, the body is the
original's first bytes and ``Leafe-Truncated`` is set; the original stays in its stream at
``Leafe-Original-Seq`` (a sample too large to store is rebuilt from its source events by ``leafe
replay``).

The writer's own: every letter carries ``Leafe-Writer`` (the role that wrote it, from its
connection: ``replayer``, ``learner``, ``actor``, or ``admin``). A subject of a letter may hold a
message that is no letter: a NATS request names the subject its answer goes to, and the server
publishes the answer there without checking the requester's publish permissions, so a role that may
ask JetStream anything could once store an answer on the next letter's subject (actors no longer
can: they live in a NATS account of their own, ``deploy/base/nats/accounts.json``). A server's
answer carries no ``Leafe-Writer``, so it is never taken for the letter: when the subject is not
empty, :func:`store_once` reads its last message (a direct get pinned to the writer's own letter
subjects, ``permissions.json``) and takes the letter as stored only if that message is this writer's
letter of the same original (writer, original seq or sample id, sha256); anything else is stepped
over (the letter is stored after it, ``Nats-Expected-Last-Subject-Sequence`` = its seq) and logged
as ``bus.dead_letter.foreign``. When the last message cannot be read (no permission, a stream
without ``allow_direct``) the letter is not taken as stored: the call raises and the consumer does
not ack. Redrive marks its work the same way (``services/replayer/redrive.py``).

Redrive: ``leafe replayer redrive`` publishes the originals of chosen dead letters again on their
subject with ``Leafe-Redrive`` (the original's seq), once their cause is gone
(``services/replayer/redrive.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import nats.errors
import structlog
from nats.js.errors import APIError

from leafe.protocol.codec import CODEC_HEADER, message_bytes
from leafe.protocol.subjects import DEAD_LETTERS
from leafe.services.bus.connection import confined_role

__all__ = [
    "ERROR_CODE_HEADER",
    "ERROR_HEADER",
    "EXPECTED_EMPTY_HEADER",
    "ORIGINAL_BYTES_HEADER",
    "ORIGINAL_SEQ_HEADER",
    "ORIGINAL_SHA256_HEADER",
    "ORIGINAL_STREAM_HEADER",
    "ORIGINAL_SUBJECT_HEADER",
    "REDRIVE_HEADER",
    "SAMPLE_ID_HEADER",
    "TRUNCATED_HEADER",
    "WRITER_HEADER",
    "DeadLetter",
    "ForeignMessageError",
    "dead_letter_limit",
    "dead_letter_message",
    "letter_writer",
    "letters_filter",
    "publish_dead_letter",
    "store_once",
]

log = structlog.get_logger(__name__)

ERROR_HEADER = "Leafe-Error"
"""Header of a dead-lettered message: why it was rejected (text for people; may quote the input)."""
ERROR_CODE_HEADER = "Leafe-Error-Code"
"""Header of a dead letter: which kind of refusal it is (``leafe.protocol.codec.REFUSALS``, the
fold's ``leafe.learner.materializers.lifecycle`` codes, ``sample_too_large``); set by the writer,
never from input."""
EXPECTED_EMPTY_HEADER = "Nats-Expected-Last-Subject-Sequence"
"""JetStream stores the message only if its subject's last sequence is this value (``0``: no message
yet)."""
_WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when ``Nats-Expected-Last-Subject-Sequence`` does not hold."""
_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")
ORIGINAL_SUBJECT_HEADER = "Leafe-Original-Subject"
ORIGINAL_STREAM_HEADER = "Leafe-Original-Stream"
ORIGINAL_SEQ_HEADER = "Leafe-Original-Seq"
"""Stream sequence of the original (absent for a sample that was never stored)."""
ORIGINAL_BYTES_HEADER = "Leafe-Original-Bytes"
"""Size of the original body in bytes."""
ORIGINAL_SHA256_HEADER = "Leafe-Original-Sha256"
"""sha256 (hex) of the original body."""
TRUNCATED_HEADER = "Leafe-Truncated"
"""Present (``true``) when the body is only the original's first bytes."""
SAMPLE_ID_HEADER = "Leafe-Sample-Id"
"""Id of a dead-lettered sample."""
REDRIVE_HEADER = "Leafe-Redrive"
"""On an event published again by ``leafe replayer redrive``: the stream seq of the dead-lettered
original (the replayer then lets an episode refused for a cap be tried again)."""
WRITER_HEADER = "Leafe-Writer"
"""On a dead letter or a redrive marker: the role that wrote it (:func:`letter_writer`). Only the
roles that may publish on its subject can set it, and no server answer carries it."""
WRITER_MAX_CHARS = 32
"""Room kept for ``Leafe-Writer`` when a letter's size is fitted before its writer is known."""
_LETTER_IDENTITY = (WRITER_HEADER, ORIGINAL_SEQ_HEADER, SAMPLE_ID_HEADER, ORIGINAL_SHA256_HEADER)
"""Headers that make a stored message this writer's letter of this original."""
_STEP_OVER = 16
"""Foreign messages :func:`store_once` steps over on one subject before it gives up."""
_READ_TIMEOUT_S = 5.0
"""How long reading a subject's last message may take."""
_REASON_CHARS = 512
_HEADER_CHARS = 1024


class ForeignMessageError(RuntimeError):
    """A letter or marker could not be stored: its subject kept receiving messages that are not its
    writer's, or its last message could not be read to tell."""


class DeadLetter:
    """A dead letter ready to publish: subject, body, headers."""

    __slots__ = ("data", "headers", "subject")

    def __init__(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers


def _clean(text: str, limit: int) -> str:
    return " ".join(text.split()).encode("ascii", "backslashreplace").decode()[:limit]


def dead_letter_message(
    dead_subject: str,
    data: bytes,
    reason: str,
    *,
    key: str,
    origin: Mapping[str, str],
    max_bytes: int,
    codec: str | None = None,
    code: str = "rejected",
    writer: str = "",
) -> DeadLetter:
    """The dead letter of ``data`` (rejected for ``reason``, of kind ``code``), fitting
    ``max_bytes``.

    ``key`` (the original's stream seq, or ``sample-<id>``: one subject token) is the last token of
    its subject; ``origin`` are the ``Leafe-Original-*``/``Leafe-Sample-Id`` headers that locate the
    original. ``writer`` (``Leafe-Writer``) is the role writing it; empty: the role of the
    connection that publishes it (:func:`publish_dead_letter`), with room kept for it.
    """
    if len(writer) > WRITER_MAX_CHARS or not _KEY.fullmatch(writer or "x"):
        raise ValueError(f"a letter's writer is a role name: {writer[:80]!r}")
    if not _KEY.fullmatch(key) or not _KEY.fullmatch(code):
        raise ValueError(
            f"a dead letter's key and code are subject tokens: {key[:80]!r}, {code[:80]!r}"
        )
    headers = {
        ERROR_HEADER: _clean(reason, _REASON_CHARS) or "rejected",
        ERROR_CODE_HEADER: code,
        **{k: _clean(v, _HEADER_CHARS) for k, v in origin.items()},
        ORIGINAL_BYTES_HEADER: str(len(data)),
        ORIGINAL_SHA256_HEADER: hashlib.sha256(data).hexdigest(),
        EXPECTED_EMPTY_HEADER: "0",
        WRITER_HEADER: writer,
    }
    if codec is not None:
        headers[CODEC_HEADER] = _clean(codec, 16)
    sized = headers if writer else {**headers, WRITER_HEADER: "w" * WRITER_MAX_CHARS}
    if message_bytes(data, sized) > max_bytes:
        headers[TRUNCATED_HEADER] = "true"
        sized[TRUNCATED_HEADER] = "true"
        data = data[: max(0, max_bytes - message_bytes(b"", sized))]
    return DeadLetter(f"{dead_subject}.{key}", data, headers)


def letters_filter(dead_subject: str) -> str:
    """Subject filter of every dead letter written under ``dead_subject`` (one subject per
    letter)."""
    return f"{dead_subject}.>"


def letter_writer(js: Any) -> str:
    """``Leafe-Writer`` of what this connection writes: its service role (``replayer``,
    ``learner``, ``actor``, ...), or ``admin`` for the admin or an identity of its own."""
    return confined_role(js._nc) or "admin"


async def publish_dead_letter(js: Any, letter: DeadLetter) -> bool:
    """Store ``letter`` and wait for its ack; ``False`` when its subject holds this writer's letter
    of the same original already (a redo). Whatever else is there (a server's answer) is stepped
    over (:func:`store_once`)."""
    headers = dict(letter.headers)
    headers[WRITER_HEADER] = headers.get(WRITER_HEADER) or letter_writer(js)
    return await store_once(js, letter.subject, letter.data, headers, identity=_LETTER_IDENTITY)


async def store_once(
    js: Any,
    subject: str,
    data: bytes,
    headers: Mapping[str, str],
    *,
    identity: Sequence[str] = (WRITER_HEADER,),
    stream: str = DEAD_LETTERS.name,
) -> bool:
    """Store a message on a subject of its own (a dead letter, a redrive marker) exactly once.

    JetStream stores it only on top of what the subject holds
    (``Nats-Expected-Last-Subject-Sequence``: first ``0``, nothing). When something is there, its
    last message is read (a direct get of ``stream``): if it is the writer's own, the same as this
    one by the ``identity`` headers (``Leafe-Writer`` first among them), this is a redo and returns
    ``False``; anything else (a server's answer that a request named this subject as its reply,
    which carries no ``Leafe-Writer``) is stepped over: the message is stored after it. Returns
    ``True`` once stored. Raises :class:`ForeignMessageError` when the last message cannot be read
    (then nothing tells a redo from a foreign message) or after :data:`_STEP_OVER` foreign ones.
    """
    if not headers.get(WRITER_HEADER) or WRITER_HEADER not in identity:
        raise ValueError(f"a message stored once names its writer ({WRITER_HEADER}): {subject!r}")
    expected = 0
    for _ in range(_STEP_OVER):
        try:
            await js.publish(
                subject, data, headers={**headers, EXPECTED_EMPTY_HEADER: str(expected)}
            )
        except APIError as e:
            if e.err_code != _WRONG_LAST_SEQUENCE:
                raise
        else:
            return True
        last = await _last_message(js, stream, subject)
        if last is None:  # gone between the two calls (or not replicated yet): from the start
            expected = 0
            await asyncio.sleep(0.05)
            continue
        seq, found = last
        if all(found.get(h) == headers.get(h) for h in identity):
            return False
        log.warning(
            "bus.dead_letter.foreign",
            subject=subject,
            seq=seq,
            writer=_clean(found.get(WRITER_HEADER, ""), 40),
            headers=len(found),
        )
        expected = seq
    raise ForeignMessageError(
        f"{subject}: {_STEP_OVER} messages that are not {headers[WRITER_HEADER]}'s landed there "
        "first; nothing stored"
    )


async def _last_message(js: Any, stream: str, subject: str) -> tuple[int, dict[str, str]] | None:
    """Seq and headers of the last message on ``subject`` (a direct get), ``None`` when there is
    none; raises :class:`ForeignMessageError` when it cannot be read.

    Spoken directly, not through nats-py's ``get_last_msg``: a stored message may itself carry a
    status line (a pull's ``404 No Messages`` that a request sent here), which nats-py would take
    for "no such message"; what tells a stored message is its ``Nats-Sequence``."""
    try:
        reply = await js._nc.request(
            f"{js._prefix}.DIRECT.GET.{stream}.{subject}", b"", timeout=_READ_TIMEOUT_S
        )
    except nats.errors.Error as e:
        raise ForeignMessageError(
            f"{subject} is not empty and its last message cannot be read to tell a redo from a "
            f"foreign message ({type(e).__name__}: {e}); needs a direct get of {stream} on it "
            "(permissions.json) and the stream's allow_direct (`leafe streams ensure`)"
        ) from e
    found = {k: str(v) for k, v in (reply.headers or {}).items()}
    if "Nats-Sequence" in found:
        return int(found["Nats-Sequence"]), found
    if found.get("Status") == "404":
        return None
    raise ForeignMessageError(
        f"{subject}: direct get of {stream} answered {found.get('Status')} "
        f"{found.get('Description', '')}".strip()
    )


def dead_letter_limit(js: Any) -> int:
    """Largest dead letter this connection may send: the server's ``max_payload`` and the
    stream's."""
    server = int(getattr(js._nc, "max_payload", 0) or DEAD_LETTERS.max_msg_bytes)
    return min(server, DEAD_LETTERS.max_msg_bytes)
