"""Durable pull consumers for the LEAFE streams (re-exported by ``leafe.services.bus``; import from
there).

A :class:`Consumer` binds a durable, explicitly acked pull consumer and turns messages into typed
:class:`Delivery` objects, through ``decode(data, codec_header)`` or, when given, ``admit(subject,
headers, data)`` (the replayer's ``leafe.protocol.codec.admit_event``: size, headers, subject).
Messages that fail never reach the caller: they are dead-lettered
(``leafe.services.bus.dead_letters``: the reason in ``Leafe-Error``, its ``ProtocolError.category``
in ``Leafe-Error-Code``, the original's subject, stream, seq, size and sha256, the body truncated
only if it would not fit), then acked and counted in ``dead_letters``; a dead letter is stored
before its message is acked, and storing it again after a crash is a no-op (its subject, keyed by
the original's seq, holds it already; nobody else may write there).

Pulling goes through :class:`leafe.services.bus.pull.Puller` (batched requests, no per-message
task). Acks are plain publishes on the message's reply subject: they go into the connection's write
buffer and are flushed together, never waiting for a reply per message, and :meth:`Consumer.consume`
sends each one only after the handler returned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from leafe.protocol.codec import CODEC_HEADER, MSG_ID_HEADER, ProtocolError
from leafe.services.bus.connection import confined_role
from leafe.services.bus.dead_letters import (
    ERROR_HEADER,
    ORIGINAL_SEQ_HEADER,
    ORIGINAL_STREAM_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    DeadLetter,
    dead_letter_limit,
    dead_letter_message,
    publish_dead_letter,
)
from leafe.services.bus.pull import ConsumerError, Puller

__all__ = ["ERROR_HEADER", "Consumer", "Delivery", "dead_letter_of"]

log = structlog.get_logger(__name__)
T = TypeVar("T")
DURABLES_COMMAND = "leafe streams ensure --run RUN (as the NATS admin)"
"""What creates a run's durable consumers, for the messages of services that wait for them."""
Admit = Callable[[str, Mapping[str, str] | None, bytes], T]


class Delivery(Generic[T]):
    """One decoded message; ack it only once its effect is durable."""

    __slots__ = ("_msg", "subject", "value")

    def __init__(self, value: T, msg: Msg) -> None:
        self.value = value
        """The decoded message."""
        self.subject = msg.subject
        """Subject it was published on."""
        self._msg = msg

    @property
    def stream_seq(self) -> int:
        """Sequence of the message in its stream."""
        return int(self._msg.metadata.sequence.stream)

    @property
    def num_delivered(self) -> int:
        """Delivery attempt (2+ means it was redelivered after a nak, a crash or ack_wait)."""
        return int(self._msg.metadata.num_delivered)

    @property
    def msg_id(self) -> str | None:
        """The ``Nats-Msg-Id`` it was published with."""
        return (self._msg.headers or {}).get(MSG_ID_HEADER)

    @property
    def msg(self) -> Msg:
        """The raw message (bytes and headers as stored; for dead letters)."""
        return self._msg

    async def ack(self) -> None:
        """Acknowledge: JetStream will not deliver it to this consumer again."""
        await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery, after ``delay`` seconds when given."""
        await self._msg.nak(delay)

    async def in_progress(self) -> None:
        """Still working on it: restart the ack_wait timer (may be called many times)."""
        await self._msg.in_progress()

    async def term(self) -> None:
        """Never deliver it again (without acking its effect)."""
        await self._msg.term()

    def __repr__(self) -> str:
        return f"Delivery(subject={self.subject!r}, value={type(self.value).__name__})"


class Consumer(Generic[T]):
    """A durable pull consumer yielding decoded deliveries (see the module docstring)."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        decode: Callable[[bytes, str | None], T],
        dead_letter_subject: str,
        admit: Admit[T] | None = None,
        batch: int = 256,
        ack_wait_s: float = 30.0,
        max_ack_pending: int = 4096,
        deliver_policy: str = "all",
        max_deliver: int = -1,
        bind_timeout_s: float = 120.0,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._js = js
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.batch = batch
        self.ack_wait_s = ack_wait_s
        self.bind_timeout_s = bind_timeout_s
        """How long a service role waits for the admin's durable before :meth:`start` raises."""
        self._decode = decode
        self._admit = admit
        self._dead_subject = dead_letter_subject
        self._config = ConsumerConfig(
            name=durable,
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            max_deliver=max_deliver,
            filter_subject=filter_subject,
            deliver_policy=DeliverPolicy(deliver_policy),
        )
        self._puller: Puller | None = None
        self.dead_letters = 0
        """Undecodable messages moved to the dead-letter subject."""
        self.dead_letters_by_category: dict[str, int] = {}
        """Dead letters per ``ProtocolError.category`` (``leafe.protocol.codec.REFUSALS``)."""
        self.handler_failures = 0
        """Handler exceptions in :meth:`consume` (each message was nak'ed for redelivery)."""

    async def start(self) -> None:
        """Bind the durable consumer (idempotent); see :mod:`leafe.services.bus.durables` for who
        makes it.

        Under a service role (a connection confined to its own inbox prefix) the durable is the
        admin's: it is bound as it is, never created or changed, and waited for up to
        ``bind_timeout_s`` (logging what is missing and the command that makes it). Its ``ack_wait``
        is adopted; a ``max_ack_pending`` below what this service asked for raises
        :class:`ConsumerError`. An admin identity (tests, one-off tools) still creates a missing
        durable, or updates the changeable settings of an existing one. A different filter subject
        always raises :class:`ConsumerError`: the durable would carry its old position and pending
        redeliveries into the new role.
        """
        if self._puller is not None:
            return
        existing = await self._existing()
        if existing is not None and existing.filter_subject != self.filter_subject:
            raise ConsumerError(
                f"durable consumer {self.durable!r} on {self.stream!r} exists with filter "
                f"{existing.filter_subject!r}, not {self.filter_subject!r}; use another durable "
                "name"
            )
        if confined_role(self._js._nc) is not None:
            self._adopt(existing or await self._wait_for_durable())
        else:
            try:
                await self._js.add_consumer(self.stream, self._config)
            except APIError as e:
                raise ConsumerError(
                    f"cannot create durable consumer {self.durable!r} on stream {self.stream!r} "
                    f"(filter {self.filter_subject!r}): {e}"
                ) from e
        puller = Puller(self._js, self.stream, self.durable)
        await puller.start()
        self._puller = puller

    async def _existing(self) -> ConsumerConfig | None:
        try:
            return (await self._js.consumer_info(self.stream, self.durable)).config
        except NotFoundError:
            return None

    async def _wait_for_durable(self) -> ConsumerConfig:
        deadline = time.monotonic() + self.bind_timeout_s
        while True:
            log.warning(
                "bus.consumer.waiting",
                stream=self.stream,
                durable=self.durable,
                create_with=DURABLES_COMMAND,
            )
            await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
            existing = await self._existing()
            if existing is not None:
                if existing.filter_subject != self.filter_subject:
                    raise ConsumerError(
                        f"durable consumer {self.durable!r} on {self.stream!r} has filter "
                        f"{existing.filter_subject!r}, not {self.filter_subject!r}"
                    )
                return existing
            if time.monotonic() >= deadline:
                raise ConsumerError(
                    f"durable consumer {self.durable!r} on stream {self.stream!r} not there after "
                    f"{self.bind_timeout_s:g}s; create it with {DURABLES_COMMAND}"
                )

    def _adopt(self, existing: ConsumerConfig) -> None:
        """Bind the admin's durable as it is: its ack_wait rules the in-progress acks."""
        have_pending = int(existing.max_ack_pending or 0)
        if 0 < have_pending < int(self._config.max_ack_pending or 0):
            raise ConsumerError(
                f"durable consumer {self.durable!r} on {self.stream!r} allows max_ack_pending "
                f"{have_pending}, "
                f"this service needs {self._config.max_ack_pending}; raise it with "
                f"{DURABLES_COMMAND}"
            )
        ack_wait = float(existing.ack_wait or self.ack_wait_s)
        if abs(ack_wait - self.ack_wait_s) > 1e-3:
            log.warning(
                "bus.consumer.ack_wait_differs",
                durable=self.durable,
                durable_s=ack_wait,
                asked_s=self.ack_wait_s,
            )
            self.ack_wait_s = ack_wait

    async def close(self) -> None:
        """Stop pulling and push buffered acks to the server (the durable consumer stays)."""
        if self._puller is not None:
            puller, self._puller = self._puller, None
            await puller.close()
            await self._js._nc.flush()

    async def __aenter__(self) -> Consumer[T]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def fetch(
        self,
        timeout: float = 1.0,  # noqa: ASYNC109
        *,
        max_messages: int | None = None,
    ) -> list[Delivery[T]]:
        """Up to ``batch`` (or ``max_messages``) deliveries in stream order; ``[]`` after
        ``timeout`` s."""
        if self._puller is None:
            raise ConsumerError(f"consumer {self.durable!r} is not started; call start() first")
        msgs = await self._puller.pull(min(self.batch, max_messages or self.batch), timeout)
        out: list[Delivery[T]] = []
        decode, admit = self._decode, self._admit
        for i, msg in enumerate(msgs):
            headers = msg.headers
            try:
                if admit is not None:
                    value = admit(msg.subject, headers, msg.data)
                else:
                    value = decode(msg.data, headers.get(CODEC_HEADER) if headers else None)
            except ProtocolError as e:
                try:
                    await self._dead_letter(msg, e.reason, e.category)
                    self.dead_letters_by_category[e.category] = (
                        self.dead_letters_by_category.get(e.category, 0) + 1
                    )
                except ConsumerError:
                    for m in (*(d._msg for d in out), *msgs[i:]):
                        await m.nak()  # hand the whole batch back at once, not after ack_wait
                    raise
                continue
            out.append(Delivery(value, msg))
        return out

    async def _dead_letter(self, msg: Msg, reason: str, code: str) -> None:
        letter = dead_letter_of(self._js, msg, reason, self._dead_subject, code=code)
        try:
            await publish_dead_letter(self._js, letter)
        except Exception as e:
            seq = msg.metadata.sequence.stream
            raise ConsumerError(
                f"cannot dead-letter {msg.subject} seq {seq} to {self._dead_subject!r} "
                f"({reason[:200]}): {type(e).__name__}: {e}"
            ) from e
        await msg.ack()
        self.dead_letters += 1
        log.warning(
            "bus.dead_letter",
            consumer=self.durable,
            subject=msg.subject,
            stream_seq=msg.metadata.sequence.stream,
            dead_letter_subject=self._dead_subject,
            reason=letter.headers[ERROR_HEADER],
            truncated=len(letter.data) < len(msg.data),
        )

    async def consume(
        self,
        handler: Callable[[Delivery[T]], Awaitable[None]],
        *,
        stop: asyncio.Event | None = None,
        limit: int | None = None,
        fetch_timeout: float = 1.0,
        nak_delay_s: float = 1.0,
        stop_on_error: bool = False,
    ) -> int:
        """Call ``handler`` on each delivery in order and ack it after the handler returned.

        A handler exception is logged, counted and the message nak'ed (redelivered after
        ``nak_delay_s``); with ``stop_on_error`` the rest of the batch is nak'ed too and the
        exception re-raised, so a handler that needs strict per-subject order never sees a later
        message first. Deliveries still waiting in a batch get in-progress acks every ``ack_wait_s /
        3`` s, so slow handlers do not trigger redelivery. Returns the number handled successfully,
        once ``stop`` is set or that number reaches ``limit`` (it never goes past it).
        """
        handled = 0
        while (stop is None or not stop.is_set()) and (limit is None or handled < limit):
            batch = await self.fetch(
                fetch_timeout, max_messages=None if limit is None else limit - handled
            )
            if not batch:
                continue
            cursor = [0]
            keepalive = asyncio.create_task(self._keepalive(batch, cursor))
            try:
                for i, delivery in enumerate(batch):
                    cursor[0] = i
                    if not await self._handle(
                        handler, delivery, nak_delay_s, batch[i + 1 :], stop_on_error
                    ):
                        continue
                    handled += 1
            finally:
                keepalive.cancel()
        return handled

    async def _handle(
        self,
        handler: Callable[[Delivery[T]], Awaitable[None]],
        delivery: Delivery[T],
        nak_delay_s: float,
        rest: list[Delivery[T]],
        stop_on_error: bool,
    ) -> bool:
        try:
            await handler(delivery)
        except Exception as e:
            self.handler_failures += 1
            log.warning(
                "bus.consume.handler_failed",
                consumer=self.durable,
                subject=delivery.subject,
                stream_seq=delivery.stream_seq,
                msg_id=delivery.msg_id,
                error=f"{type(e).__name__}: {e}",
                exc_info=True,
            )
            await delivery.nak(nak_delay_s)
            if stop_on_error:
                for other in rest:
                    await other.nak()
                raise
            return False
        await delivery.ack()
        return True

    async def _keepalive(self, batch: list[Delivery[T]], cursor: list[int]) -> None:
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for delivery in batch[cursor[0] :]:
                await delivery.in_progress()


def dead_letter_of(
    js: JetStreamContext, msg: Msg, reason: str, dead_subject: str, *, code: str
) -> DeadLetter:
    """The dead letter of stored message ``msg`` (keyed by its seq; see ``dead_letters``), of kind
    ``code``."""
    meta = msg.metadata
    origin = {
        ORIGINAL_SUBJECT_HEADER: msg.subject,
        ORIGINAL_STREAM_HEADER: meta.stream,
        ORIGINAL_SEQ_HEADER: str(meta.sequence.stream),
    }
    return dead_letter_message(
        dead_subject,
        msg.data,
        reason,
        key=str(meta.sequence.stream),
        origin=origin,
        max_bytes=dead_letter_limit(js),
        codec=(msg.headers or {}).get(CODEC_HEADER),
        code=code,
    )
