"""Batched, acknowledged JetStream publishing with bounded outstanding acks and size limits.

Publishing is asynchronous (``publish_async``) with at most ``max_pending`` unacknowledged messages:
``publish`` returns once the message is queued and blocks while the window is full (backpressure). A
message whose ack is an error or does not arrive within ``ack_timeout_s`` (a server killed with it
in flight, an ack lost across a reconnect) is republished by ``flush``, up to ``retries`` times,
once the connection is back: that is safe because JetStream stores a ``Nats-Msg-Id`` once within the
stream's duplicate window (a message that was stored but not acked comes back as a duplicate). No
failure is hidden: what still has no ack is listed in the :class:`PublishError` that ``flush``
raises; a message that could not even be sent raises :class:`PublishError` from ``publish`` itself.
That dedupe is per stream, not per run: ids must be unique across all runs sharing the server, or a
later run's message is dropped as a "duplicate" (counted in ``Publisher.duplicates`` and logged as
``bus.publish.duplicates``).

Sizes are checked before anything is sent: a message over its stream's ``StreamSpec.max_msg_bytes``
(events: 1 MiB) or the server's ``max_payload`` (headers included, as the server counts them; a
larger one would close the connection) raises :class:`MessageTooLargeError` naming it, its size and
the limit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType
from typing import NamedTuple

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck

from leafe.protocol.codec import (
    CODEC_HEADER,
    CODEC_VERSION,
    MSG_ID_HEADER,
    encode,
    message_bytes,
    message_id,
)
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import MAX_PAYLOAD, event_subject, stream_for_subject

__all__ = ["MessageTooLargeError", "PublishError", "Publisher"]

log = structlog.get_logger(__name__)


class PublishError(RuntimeError):
    """Messages JetStream did not acknowledge; they may or may not be stored, so republish them."""

    def __init__(
        self, message: str, unacked: list[str], reasons: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.unacked = unacked
        """Message ids (``Nats-Msg-Id``) without an ack, in publish order."""
        self.reasons = reasons or {}
        """Why, per message id."""


class MessageTooLargeError(ValueError):
    """A message over its size limit: refused before sending (republishing cannot help)."""

    def __init__(self, subject: str, msg_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"{msg_id} to {subject!r} is {size:,} bytes (headers included), over the limit of "
            f"{limit:,} "
            "bytes for its stream; nothing was sent"
        )
        self.subject = subject
        self.msg_id = msg_id
        self.size = size
        self.limit = limit


class _Message(NamedTuple):
    msg_id: str
    subject: str
    data: bytes
    headers: dict[str, str]


class _Pending(NamedTuple):
    msg_id: str
    future: asyncio.Future[PubAck]
    deadline: float
    message: _Message | None
    """Kept for a republish when the publisher retries."""


def _transient(exc: BaseException | None) -> bool:
    """Whether a republish may succeed: no ack, a lost connection, no responder (a stream leader
    being elected), or the server unavailable; not a refusal such as a bad request or a missing
    stream."""
    if isinstance(exc, nats.js.errors.APIError):
        return isinstance(exc, nats.js.errors.ServiceUnavailableError | nats.js.errors.ServerError)
    return True


def _summary(reasons: dict[str, str]) -> str:
    first_id, first_reason = next(iter(reasons.items()))
    return (
        f"{len(reasons)} message(s) not acknowledged by JetStream "
        f"(first: {first_id}: {first_reason})"
    )


class Publisher:
    """Batched, acknowledged publishing with bounded outstanding acks (see the module docstring).

    When the window of ``max_pending`` unacked messages is full, ``publish`` waits until half of it
    is acked (refilling one slot at a time would turn batched socket writes into one write per
    message). Keep ``max_pending`` at most the JetStreamContext's ``publish_async_max_pending``
    (4000 by default).
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        max_pending: int = 2048,
        ack_timeout_s: float = 30.0,
        max_msg_bytes: int | None = None,
        retries: int = 2,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self._js = js
        self._max_pending = max_pending
        self._ack_timeout_s = ack_timeout_s
        self._retries = retries
        self._pending: deque[_Pending] = deque()
        self._failed: dict[str, str] = {}
        self._resend: dict[str, _Message] = {}
        """Failed messages ``flush`` may republish (only kept when ``retries`` > 0)."""
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
        """Acks that said the ``Nats-Msg-Id`` was already stored (a retry, or an id reused by
        mistake)."""
        self.republished = 0
        """Messages sent again by ``flush`` because their earlier send had no ack."""

    @property
    def pending(self) -> int:
        """Messages sent whose ack has not been processed yet."""
        return len(self._pending)

    async def publish(self, subject: str, msg: msgspec.Struct) -> None:
        """Encode and publish ``msg``; returns once queued, waits while ``max_pending`` acks are
        pending."""
        headers = {MSG_ID_HEADER: message_id(msg), CODEC_HEADER: CODEC_VERSION}
        await self.publish_raw(subject, encode(msg), headers)

    async def publish_event(self, event: EpisodeEvent) -> None:
        """Publish an episode event on ``leafe.<run>.events.<kind>.<actor_id>`` (the server refuses
        a token other than the connection's own actor id)."""
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
            raise ValueError(
                f"publish to {subject!r} without a {MSG_ID_HEADER} header: {headers!r}"
            )
        size, limit = message_bytes(data, headers), self.limit(subject)
        if size > limit:
            raise MessageTooLargeError(subject, msg_id, size, limit)
        self._reap()
        if len(self._pending) >= self._max_pending:
            await self._make_room()
        await self._send(_Message(msg_id, subject, data, headers))

    async def _send(self, msg: _Message) -> None:
        msg_id, subject = msg.msg_id, msg.subject
        loop = asyncio.get_running_loop()
        try:
            future = await self._js.publish_async(subject, msg.data, headers=msg.headers)
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
        kept = msg if self._retries else None
        self._pending.append(_Pending(msg_id, future, loop.time() + self._ack_timeout_s, kept))
        self.published += 1

    def _settle(self, entry: _Pending) -> None:
        msg_id, future = entry.msg_id, entry.future
        if future.cancelled() or future.exception() is not None:
            exc = None if future.cancelled() else future.exception()
            if exc is None:
                self._failed[msg_id] = f"no ack within {self._ack_timeout_s}s"
            else:
                self._failed[msg_id] = (
                    f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                )
            if entry.message is not None and _transient(exc):
                self._resend[msg_id] = entry.message
            return
        self.acked += 1
        self._acked_since_flush += 1
        if future.result().duplicate:
            self.duplicates += 1
            self._dups_since_flush += 1
            self._first_dup = self._first_dup or msg_id

    def _reap(self) -> None:
        pending = self._pending
        while pending and pending[0].future.done():
            self._settle(pending.popleft())

    async def _make_room(self) -> None:
        loop = asyncio.get_running_loop()
        while len(self._pending) > self._max_pending // 2:
            future, deadline = self._pending[0].future, self._pending[0].deadline
            if not future.done():
                await asyncio.wait((future,), timeout=max(0.0, deadline - loop.time()))
                if not future.done():
                    future.cancel()  # frees nats-py's slot; the message is reported by flush()
            self._reap()

    async def flush(self) -> int:
        """Await every outstanding ack; returns how many messages were acked since the last flush.

        Messages without an ack are republished up to ``retries`` times (each round once the
        connection is back). Raises :class:`PublishError` listing every message still without an ack
        (error, or none within ``ack_timeout_s`` of its last send) since the last flush.
        """
        await self._await_pending()
        for attempt in range(1, self._retries + 1):
            if not self._failed:
                break
            await self._republish(attempt)
            await self._await_pending()
        self._resend.clear()
        acked, self._acked_since_flush = self._acked_since_flush, 0
        if self._dups_since_flush:
            # Expected after a retry; otherwise an id was reused (e.g. the same task key in two
            # runs).
            log.warning(
                "bus.publish.duplicates", count=self._dups_since_flush, first=self._first_dup
            )
            self._dups_since_flush, self._first_dup = 0, None
        if self._failed:
            failed, self._failed = self._failed, {}
            log.error("bus.publish.unacked", count=len(failed), first=list(failed.items())[:5])
            raise PublishError(_summary(failed), list(failed), failed)
        return acked

    async def _await_pending(self) -> None:
        self._reap()
        if not self._pending:
            return
        loop = asyncio.get_running_loop()
        timeout = max(0.0, self._pending[-1].deadline - loop.time())
        await asyncio.wait([p.future for p in self._pending], timeout=timeout)
        while self._pending:
            entry = self._pending.popleft()
            if not entry.future.done():
                entry.future.cancel()
            self._settle(entry)

    async def _republish(self, attempt: int) -> None:
        """Send every failed message again that is kept for it, once the connection is back."""
        again = [self._resend.pop(i) for i in list(self._failed) if i in self._resend]
        if not again:
            return
        log.warning(
            "bus.publish.republishing",
            count=len(again),
            attempt=attempt,
            first=next(iter(self._failed.items())),
        )
        await self._connected(timeout_s=self._ack_timeout_s)
        for msg in again:
            del self._failed[msg.msg_id]
            try:
                await self._send(msg)
            except PublishError as e:
                self._failed[msg.msg_id] = e.reasons.get(msg.msg_id, str(e))
                self._resend[msg.msg_id] = msg
                continue
            self.republished += 1
            if len(self._pending) >= self._max_pending:
                await self._make_room()

    async def _connected(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the client is connected again; a send while it
        reconnects would only be buffered behind the reconnect anyway."""
        nc = self._js._nc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not getattr(nc, "is_connected", True) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(
                0.1
            )  # nats-py offers no awaitable for "reconnected" besides a callback

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
