"""Reading a stream once, in order, without touching the durable consumers: log export, recovery.

Both readers use an ephemeral, unacked consumer that is deleted afterwards; the stream is not modified.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from protocol.subjects import EVENTS
from services.bus.pull import ConsumerError, Puller

__all__ = ["read_range", "read_stream"]

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
    Raises :class:`ConsumerError` if the server stops delivering before the end.
    """
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
                    f"stream {stream} stopped delivering {filter_subject!r} after {got} of {total} messages"
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


async def read_range(
    js: Any, *, filter_subject: str, start_seq: int, end_seq: int, batch: int = 512
) -> AsyncIterator[Any]:
    """Messages of ``LEAFE_EVENTS`` matching ``filter_subject`` with ``start_seq <= seq <= end_seq``."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    if end_seq < start_seq:
        return
    name = f"leafe-recover-{js._nc._nuid.next().decode()}"
    config = ConsumerConfig(
        name=name,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        filter_subject=filter_subject,
        inactive_threshold=60.0,
        mem_storage=True,
    )
    await js.add_consumer(EVENTS.name, config)
    sub = await js.pull_subscribe_bind(consumer=name, stream=EVENTS.name)
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=2.0)
            except NatsTimeout:
                return  # nothing left (the range's last message was deleted by limits)
            for msg in msgs:
                seq = int(msg.metadata.sequence.stream)
                if seq > end_seq:
                    return
                yield msg
                if seq == end_seq:
                    return
    finally:
        await sub.unsubscribe()
        try:
            await js.delete_consumer(EVENTS.name, name)
        except Exception as e:  # reaped by inactive_threshold anyway
            log.debug("replay.read_range.cleanup", consumer=name, error=str(e))
