"""Dead letters: where a rejected message goes, with its reason, so nothing refused is lost.

A dead letter is published on ``leafe.<run>.dead.<stream>`` (stream ``LEAFE_DEAD``; the consumer's
stream: the replayer's all go to ``dead.leafe_events``, samples it could not store included) with the
reason in ``Leafe-Error`` and where the original lives in ``Leafe-Original-Subject/-Stream/-Seq`` (or
``Leafe-Sample-Id``); its body is the original's bytes, with their size and sha256 in
``Leafe-Original-Bytes`` and ``Leafe-Original-Sha256``.
Its ``Nats-Msg-Id`` is a function of the original alone (``dead.<stream>.<seq>``, or
``dead.<stream>.<sample id>`` for a sample that was never stored), so dead-lettering the same message
again after a crash is stored once: a restarted consumer can always redo it, and acks a message only
after its dead letter is stored.

Sizes: a dead letter must fit the server's ``max_payload`` (headers included, or the server closes the
connection). When the original plus the dead letter's headers would not fit, the body is the original's
first bytes and ``Leafe-Truncated`` is set; the original stays in its stream at ``Leafe-Original-Seq``
(a sample too large to store is rebuilt from its source events by ``leafe replay``).

Redrive: ``leafe replayer redrive`` publishes the originals of chosen dead letters again on their subject
with ``Leafe-Redrive`` (the original's seq), once their cause is gone (``services/replayer/redrive.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import structlog

from protocol.codec import CODEC_HEADER, MSG_ID_HEADER, message_bytes
from protocol.subjects import DEAD_LETTERS

__all__ = [
    "ERROR_HEADER",
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
    "publish_dead_letter",
]

log = structlog.get_logger(__name__)

ERROR_HEADER = "Leafe-Error"
"""Header of a dead-lettered message: why it was rejected."""
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
"""On an event published again by ``leafe replayer redrive``: the stream seq of the dead-lettered original
(the replayer then lets an episode refused for a cap be tried again)."""
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
    stream: str,
    key: str,
    origin: Mapping[str, str],
    max_bytes: int,
    codec: str | None = None,
) -> DeadLetter:
    """The dead letter of ``data`` (rejected for ``reason``), fitting ``max_bytes`` on the wire.

    ``key`` (the original's stream seq, or a sample id) makes the ``Nats-Msg-Id``; ``origin`` are the
    ``Leafe-Original-*``/``Leafe-Sample-Id`` headers that locate the original.
    """
    headers = {
        ERROR_HEADER: _clean(reason, _REASON_CHARS) or "rejected",
        **{k: _clean(v, _HEADER_CHARS) for k, v in origin.items()},
        ORIGINAL_BYTES_HEADER: str(len(data)),
        ORIGINAL_SHA256_HEADER: hashlib.sha256(data).hexdigest(),
        MSG_ID_HEADER: _clean(f"dead.{stream}.{key}", _HEADER_CHARS),
    }
    if codec is not None:
        headers[CODEC_HEADER] = _clean(codec, 16)
    if message_bytes(data, headers) > max_bytes:
        headers[TRUNCATED_HEADER] = "true"
        data = data[: max(0, max_bytes - message_bytes(b"", headers))]
    return DeadLetter(dead_subject, data, headers)


async def publish_dead_letter(js: Any, letter: DeadLetter) -> bool:
    """Store ``letter`` and wait for its ack; ``False`` when it was already stored (a redo)."""
    ack = await js.publish(letter.subject, letter.data, headers=letter.headers)
    return not bool(getattr(ack, "duplicate", False))


def dead_letter_limit(js: Any) -> int:
    """Largest dead letter this connection may send: the server's ``max_payload`` and the stream's."""
    server = int(getattr(js._nc, "max_payload", 0) or DEAD_LETTERS.max_msg_bytes)
    return min(server, DEAD_LETTERS.max_msg_bytes)
