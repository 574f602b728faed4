"""Batched, acknowledged JetStream publishing with bounded outstanding acks and size limits.

Publishing is asynchronous (``publish_async``) with at most ``max_pending`` unacknowledged messages:
``publish`` returns once the message is queued and blocks while the window is full (backpressure).
No failure is hidden: a message whose ack is an error or does not arrive within ``ack_timeout_s`` is
listed in the :class:`PublishError` that ``flush`` raises; a message that could not even be sent raises
:class:`PublishError` from ``publish`` itself. Republishing a listed message is safe (JetStream stores a
``Nats-Msg-Id`` once within the stream's duplicate window). That dedupe is per stream, not per run:
ids must be unique across all runs sharing the server, or a later run's message is dropped as a
"duplicate" (counted in ``Publisher.duplicates`` and logged as ``bus.publish.duplicates``).

Sizes are checked before anything is sent: a message over its stream's ``StreamSpec.max_msg_bytes``
(events: 1 MiB) or the server's ``max_payload`` (headers included, as the server counts them; a larger
one would close the connection) raises :class:`MessageTooLargeError` naming it, its size and the limit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck

from protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, encode, message_bytes, message_id
from protocol.events import EpisodeEvent
from protocol.subjects import MAX_PAYLOAD, event_subject, stream_for_subject

__all__ = ["MessageTooLargeError", "PublishError", "Publisher"]

log = structlog.get_logger(__name__)


class PublishError(RuntimeError):
    """Messages JetStream did not acknowledge; they may or may not be stored, so republish them."""

    def __init__(self, message: str, unacked: list[str], reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.unacked = unacked
        """Message ids (``Nats-Msg-Id``) without an ack, in publish order."""
        self.reasons = reasons or {}
        """Why, per message id."""


class MessageTooLargeError(ValueError):
    """A message over its size limit: refused before sending (republishing cannot help)."""

    def __init__(self, subject: str, msg_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"{msg_id} to {subject!r} is {size:,} bytes (headers included), over the limit of {limit:,} "
            "bytes for its stream; nothing was sent"
        )
        self.subject = subject
        self.msg_id = msg_id
        self.size = size
        self.limit = limit


def _summary(reasons: dict[str, str]) -> str:
    first_id, first_reason = next(iter(reasons.items()))
    return f"{len(reasons)} message(s) not acknowledged by JetStream (first: {first_id}: {first_reason})"


class Publisher:
    """Batched, acknowledged publishing with bounded outstanding acks (see the module docstring).

    When the window of ``max_pending`` unacked messages is full, ``publish`` waits until half of it is
    acked (refilling one slot at a time would turn batched socket writes into one write per message).
    Keep ``max_pending`` at most the JetStreamContext's ``publish_async_max_pending`` (4000 by default).
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        max_pending: int = 2048,
        ack_timeout_s: float = 30.0,
        max_msg_bytes: int | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._js = js
        self._max_pending = max_pending
        self._ack_timeout_s = ack_timeout_s
        self._pending: deque[tuple[str, asyncio.Future[PubAck], float]] = deque()
        self._failed: dict[str, str] = {}
        self._acked_since_flush = 0
        self._dups_since_flush = 0
        self._first_dup: str | None = None
        self._subjects: dict[tuple[str, type, str], str] = {}
        self._max_msg_bytes = max_msg_bytes
        self._limits: dict[str, int] = {}
        self.published = 0
        """Messages handed to the server so far."""
        self.acked = 0
        """Messages acknowledged so far (stored, or recognised as already stored)."""
        self.duplicates = 0
        """Acks that said the ``Nats-Msg-Id`` was already stored (a retry, or an id reused by mistake)."""

    @property
    def pending(self) -> int:
        """Messages sent whose ack has not been processed yet."""
        return len(self._pending)

    async def publish(self, subject: str, msg: msgspec.Struct) -> None:
        """Encode and publish ``msg``; returns once queued, waits while ``max_pending`` acks are pending."""
        headers = {MSG_ID_HEADER: message_id(msg), CODEC_HEADER: CODEC_VERSION}
        await self.publish_raw(subject, encode(msg), headers)

    async def publish_event(self, event: EpisodeEvent) -> None:
        """Publish an episode event on ``leafe.<run>.events.<kind>.<actor_id>`` (the server refuses a token
        other than the connection's own actor id)."""
        key = (event.run_id, type(event), event.actor_id)
        subject = self._subjects.get(key)
        if subject is None:
            kind = type(event).__struct_config__.tag
            subject = self._subjects[key] = event_subject(event.run_id, str(kind), event.actor_id)
        await self.publish(subject, event)

    def limit(self, subject: str) -> int:
        """Largest message (header block + body) this publisher sends to ``subject``."""
        limit = self._limits.get(subject)
        if limit is None:
            spec = stream_for_subject(subject)
            server = int(getattr(self._js._nc, "max_payload", 0) or MAX_PAYLOAD)
            limit = min(server, spec.max_msg_bytes if spec is not None else server)
            if self._max_msg_bytes is not None:
                limit = min(limit, self._max_msg_bytes)
            if len(self._limits) < 4096:  # a few subjects per run; never an unbounded cache
                self._limits[subject] = limit
        return limit

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Publish already-encoded bytes (log import); ``headers`` must carry ``Nats-Msg-Id``.

        Raises :class:`MessageTooLargeError` (nothing sent) when the message is over :meth:`limit`.
        """
        msg_id = headers.get(MSG_ID_HEADER)
        if not msg_id:
            raise ValueError(f"publish to {subject!r} without a {MSG_ID_HEADER} header: {headers!r}")
        size, limit = message_bytes(data, headers), self.limit(subject)
        if size > limit:
            raise MessageTooLargeError(subject, msg_id, size, limit)
        self._reap()
        if len(self._pending) >= self._max_pending:
            await self._make_room()
        loop = asyncio.get_running_loop()
        try:
            future = await self._js.publish_async(subject, data, headers=headers)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            raise PublishError(
                f"could not send {msg_id} to {subject!r}: {reason}"
                + (
                    f"; {len(self._pending)} earlier message(s) await their ack (see flush())"
                    if self._pending
                    else ""
                ),
                [msg_id],
                {msg_id: reason},
            ) from e
        self._pending.append((msg_id, future, loop.time() + self._ack_timeout_s))
        self.published += 1

    def _settle(self, msg_id: str, future: asyncio.Future[PubAck]) -> None:
        if future.cancelled():
            self._failed[msg_id] = f"no ack within {self._ack_timeout_s}s"
            return
        exc = future.exception()
        if exc is not None:
            self._failed[msg_id] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return
        self.acked += 1
        self._acked_since_flush += 1
        if future.result().duplicate:
            self.duplicates += 1
            self._dups_since_flush += 1
            self._first_dup = self._first_dup or msg_id

    def _reap(self) -> None:
        pending = self._pending
        while pending and pending[0][1].done():
            msg_id, future, _ = pending.popleft()
            self._settle(msg_id, future)

    async def _make_room(self) -> None:
        loop = asyncio.get_running_loop()
        while len(self._pending) > self._max_pending // 2:
            _, future, deadline = self._pending[0]
            if not future.done():
                await asyncio.wait((future,), timeout=max(0.0, deadline - loop.time()))
                if not future.done():
                    future.cancel()  # frees nats-py's slot; the message is reported by flush()
            self._reap()

    async def flush(self) -> int:
        """Await every outstanding ack; returns how many messages were acked since the last flush.

        Raises :class:`PublishError` listing every message without an ack (error, or none within
        ``ack_timeout_s`` of its publish) since the last flush.
        """
        self._reap()
        if self._pending:
            loop = asyncio.get_running_loop()
            timeout = max(0.0, self._pending[-1][2] - loop.time())
            await asyncio.wait([f for _, f, _ in self._pending], timeout=timeout)
            while self._pending:
                msg_id, future, _ = self._pending.popleft()
                if not future.done():
                    future.cancel()
                self._settle(msg_id, future)
        acked, self._acked_since_flush = self._acked_since_flush, 0
        if self._dups_since_flush:
            # Expected after a retry; otherwise an id was reused (e.g. the same task key in two runs).
            log.warning("bus.publish.duplicates", count=self._dups_since_flush, first=self._first_dup)
            self._dups_since_flush, self._first_dup = 0, None
        if self._failed:
            failed, self._failed = self._failed, {}
            log.error("bus.publish.unacked", count=len(failed), first=list(failed.items())[:5])
            raise PublishError(_summary(failed), list(failed), failed)
        return acked

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if e is None:
            await self.flush()
            return
        try:
            await self.flush()
        except PublishError as pe:
            e.add_note(f"also: {pe} (ids: {pe.unacked[:20]})")  # the original error propagates
