"""The JetStream bus: connect, create or wait for the LEAFE streams, publish typed messages, consume
them.

Every service talks to NATS through this package::

    nc = await connect(nats_options(args))  # or connect(url); flags in services/bus/connection.py
    js = nc.jetstream()
    # made by the admin: `leafe streams ensure` runs ensure_streams(js), idempotent, from STREAMS
    await wait_for_streams(js, [EVENTS.name], timeout_s=opts.streams_timeout_s)
    async with Publisher(js) as pub:        # flushes (awaits every ack) on exit
        await pub.publish_event(event)      # Nats-Msg-Id = event id, Leafe-Codec = codec version
    consumer = Consumer(js, stream="LEAFE_EVENTS", durable="replayer", filter_subject=...,
                        decode=decode_event,
                        dead_letter_subject=dead_letter_subject(run, "LEAFE_EVENTS"))
    await consumer.start()
    await consumer.consume(handler)         # acks each message after handler(delivery) returned

| module          | what                                                                    |
|-----------------|-------------------------------------------------------------------------|
| `connection`    | `NatsOptions`, `connect`: the shared flags -> a reconnecting client     |
| `streams`       | `ensure_streams`/`check_streams` (admin), `wait_for_streams` (services) |
| `auth`          | per-role nkey users and accounts from deploy/base/nats/, TLS blocks     |
| `publisher`     | `Publisher`: batched publishing, every ack awaited, `PublishError`      |
| `consumer`      | `Consumer`/`Delivery`: durable pull consumers with dead letters         |
| `durables`      | `ensure_durables` (admin): each run's durables; services only bind      |
| `dead_letters`  | dead letters: reason, origin, digest, truncation, stored once, writer   |
| `pull`          | `Puller`: the pull protocol spoken directly (the fast path)             |
| `reader`        | `read_stream`, `read_range`: read a subject range once, in order        |
| `nats_server`   | `EmbeddedNats`: a real nats-server child process                        |
| `nats_cluster`  | `NatsCluster`: a local cluster of them (`leafe nats --cluster N`)       |
"""

from leafe.services.bus.connection import (
    NatsOptions,
    add_nats_arguments,
    connect,
    nats_options,
    redact,
)
from leafe.services.bus.consumer import ERROR_HEADER, Consumer, Delivery
from leafe.services.bus.durables import DurableMismatchError, DurableSpec, ensure_durables
from leafe.services.bus.publisher import MessageTooLargeError, Publisher, PublishError
from leafe.services.bus.pull import ConsumerError
from leafe.services.bus.reader import read_range, read_stream
from leafe.services.bus.streams import (
    StreamMismatchError,
    StreamsMissingError,
    check_streams,
    ensure_streams,
    stream_config,
    wait_for_streams,
)

__all__ = [
    "ERROR_HEADER",
    "Consumer",
    "ConsumerError",
    "Delivery",
    "DurableMismatchError",
    "DurableSpec",
    "MessageTooLargeError",
    "NatsOptions",
    "PublishError",
    "Publisher",
    "StreamMismatchError",
    "StreamsMissingError",
    "add_nats_arguments",
    "check_streams",
    "connect",
    "ensure_durables",
    "ensure_streams",
    "nats_options",
    "read_range",
    "read_stream",
    "redact",
    "stream_config",
    "wait_for_streams",
]
