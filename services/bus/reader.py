"""Reading a stream once, in order, without touching the durable consumers: log export, recovery.

:func:`read_stream` (log export, the admin's) uses an ephemeral, unacked consumer that is deleted
afterwards; :func:`read_range` (the replayer's recovery) gets each message by sequence, needing no
consumer at all. The stream is never modified.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from leafe.protocol.subjects import EVENTS
from leafe.services.bus.connection import confined_role
from leafe.services.bus.pull import ConsumerError, Puller

__all__ = ["StoredMsg", "read_range", "read_stream"]

log = structlog.get_logger(__name__)


async def read_stream(
    js: JetStreamContext,
    *,
    stream: str,
    filter_subject: str,
    batch: int = 1024,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> AsyncIterator[Msg]:
    """Every message of ``stream`` matching ``filter_subject`` at call time, in stream order.

    Uses an ephemeral, unacked consumer that is deleted afterwards; the stream is not modified.
    Raises :class:`ConsumerError` if the server stops delivering before the end. A service role,
    which may not create a consumer (services/bus/durables.py), reads by sequence instead
    (:func:`read_range`, up to the stream's last sequence now; slower, one request per message).
    """
    if confined_role(js._nc) is not None:
        last = int((await js.stream_info(stream)).state.last_seq or 0)
        async for stored in read_range(
            js, filter_subject=filter_subject, start_seq=1, end_seq=last, stream=stream
        ):
            yield stored  # type: ignore[misc]
        return
    name = f"leafe-read-{js._nc._nuid.next().decode()}"
    config = ConsumerConfig(
        name=name,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=filter_subject,
        inactive_threshold=60.0,
        mem_storage=True,
    )
    info = await js.add_consumer(stream, config)
    total = int(info.num_pending or 0)
    puller = Puller(js, stream, name)
    await puller.start()
    try:
        got = 0
        while got < total:
            msgs = await puller.pull(min(batch, total - got), timeout)
            if not msgs:
                raise ConsumerError(
                    f"stream {stream} stopped delivering {filter_subject!r} after {got} of {total} "
                    "messages"
                )
            for msg in msgs:
                yield msg
            got += len(msgs)
    finally:
        await puller.close()
        try:
            await js.delete_consumer(stream, name)
        except NotFoundError:
            pass  # already reaped by inactive_threshold


class StoredMsg(msgspec.Struct, frozen=True):
    """One stored message as :func:`read_range` returns it (``metadata`` as on a consumer's
    ``Msg``)."""

    subject: str
    headers: dict[str, str] | None
    data: bytes
    seq: int
    stream: str = ""
    time: datetime | None = None

    @property
    def metadata(self) -> Msg.Metadata:
        """Stream sequence and store time, in the shape of a delivered message's metadata."""
        pair = Msg.Metadata.SequencePair(consumer=0, stream=self.seq)
        when = self.time or datetime.fromtimestamp(0, UTC)
        return Msg.Metadata(
            sequence=pair,
            num_pending=0,
            num_delivered=1,
            timestamp=when,
            stream=self.stream,
            consumer="",
        )


async def read_range(
    js: JetStreamContext,
    *,
    filter_subject: str,
    start_seq: int,
    end_seq: int,
    stream: str = EVENTS.name,
) -> AsyncIterator[StoredMsg]:
    """Messages of ``stream`` matching ``filter_subject`` with ``start_seq <= seq <= end_seq``, in
    order.

    Read with the stream's message-get API (``next_by_subj``), one request per message: the
    replayer's recovery after a restart needs no consumer of its own, so its role may neither create
    nor delete one (services/bus/durables.py).
    """
    seq = start_seq
    while seq <= end_seq:
        try:
            msg = await js.get_msg(stream, seq, subject=filter_subject, next=True)
        except NotFoundError:
            return  # nothing left (the range's last messages were deleted by limits)
        if msg.seq is None or msg.seq > end_seq:
            return
        yield StoredMsg(msg.subject or "", msg.headers, msg.data or b"", msg.seq, stream, msg.time)
        seq = msg.seq + 1
