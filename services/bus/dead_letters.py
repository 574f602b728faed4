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

Redrive: ``leafe replayer redrive`` publishes the originals of chosen dead letters again on their
subject with ``Leafe-Redrive`` (the original's seq), once their cause is gone
(``services/replayer/redrive.py``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import structlog
from nats.js.errors import APIError

from leafe.protocol.codec import CODEC_HEADER, message_bytes
from leafe.protocol.subjects import DEAD_LETTERS

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
    "DeadLetter",
    "dead_letter_limit",
    "dead_letter_message",
    "letters_filter",
    "publish_dead_letter",
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
_REASON_CHARS = 512
_HEADER_CHARS = 1024


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
) -> DeadLetter:
    """The dead letter of ``data`` (rejected for ``reason``, of kind ``code``), fitting
    ``max_bytes``.

    ``key`` (the original's stream seq, or ``sample-<id>``: one subject token) is the last token of
    its subject; ``origin`` are the ``Leafe-Original-*``/``Leafe-Sample-Id`` headers that locate the
    original.
    """
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
    }
    if codec is not None:
        headers[CODEC_HEADER] = _clean(codec, 16)
    if message_bytes(data, headers) > max_bytes:
        headers[TRUNCATED_HEADER] = "true"
        data = data[: max(0, max_bytes - message_bytes(b"", headers))]
    return DeadLetter(f"{dead_subject}.{key}", data, headers)


def letters_filter(dead_subject: str) -> str:
    """Subject filter of every dead letter written under ``dead_subject`` (one subject per
    letter)."""
    return f"{dead_subject}.>"


async def publish_dead_letter(js: Any, letter: DeadLetter) -> bool:
    """Store ``letter`` and wait for its ack; ``False`` when its subject holds a letter already (a
    redo: only the writer's role may publish there, so what is there is its own letter of the same
    original)."""
    try:
        await js.publish(letter.subject, letter.data, headers=letter.headers)
    except APIError as e:
        if e.err_code == _WRONG_LAST_SEQUENCE:
            return False
        raise
    return True


def dead_letter_limit(js: Any) -> int:
    """Largest dead letter this connection may send: the server's ``max_payload`` and the
    stream's."""
    server = int(getattr(js._nc, "max_payload", 0) or DEAD_LETTERS.max_msg_bytes)
    return min(server, DEAD_LETTERS.max_msg_bytes)
