"""Durable consumers are the NATS admin's, like streams: made by ``leafe streams ensure --run RUN``,
bound by services.

A durable's configuration decides what every service behind it gets: its filter (which run's
messages), ``max_deliver`` (how often a task is retried), ``ack_wait`` and ``max_ack_pending``.
JetStream treats a create on an existing durable as an update, so a service allowed to create its
durable could change it for every other service of the run (an actor once emptied the run's task
filter, or set ``max_deliver`` 1). So no service role may create, update or delete a consumer
(deploy/base/nats/permissions.json): the admin makes each run's durables here, with
:func:`ensure_durables`, and a service binds the existing one
(:meth:`leafe.services.bus.Consumer.start`: consumer info, next message and acks on its own durable
only), waiting for it as it waits for its streams.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

__all__ = ["DurableMismatchError", "DurableSpec", "consumer_config", "ensure_durables"]

log = structlog.get_logger(__name__)


class DurableMismatchError(RuntimeError):
    """A durable exists with another filter subject: it belongs to something else; never
    rewritten."""


class DurableSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One durable pull consumer, as data (the admin creates it; a service binds it)."""

    stream: str
    """The stream it reads."""
    name: str
    """Durable name (carries the run id: every run shares the streams)."""
    filter_subject: str
    """The run's subjects it delivers."""
    ack_wait_s: float
    """Seconds before an unacked delivery is redelivered."""
    max_ack_pending: int
    """Deliveries that may await their ack at once."""
    max_deliver: int = -1
    """Delivery attempts per message; -1 = unlimited."""


def consumer_config(spec: DurableSpec) -> ConsumerConfig:
    """The JetStream configuration of ``spec``: explicit acks, delivering the whole filter from the
    start."""
    return ConsumerConfig(
        name=spec.name,
        durable_name=spec.name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=spec.ack_wait_s,
        max_ack_pending=spec.max_ack_pending,
        max_deliver=spec.max_deliver,
        filter_subject=spec.filter_subject,
    )


def _differences(have: ConsumerConfig, spec: DurableSpec) -> list[str]:
    diffs = []
    if not math.isclose(float(have.ack_wait or 0.0), spec.ack_wait_s, rel_tol=1e-9, abs_tol=1e-3):
        diffs.append("ack_wait")
    if int(have.max_ack_pending or 0) != spec.max_ack_pending:
        diffs.append("max_ack_pending")
    if int(have.max_deliver or -1) != spec.max_deliver:
        diffs.append("max_deliver")
    return diffs


async def ensure_durables(js: JetStreamContext, specs: Sequence[DurableSpec]) -> dict[str, str]:
    """Create each durable, or update an existing one whose settings differ (admin only);
    idempotent.

    Returns ``{name: created | updated: <fields> | unchanged}``. A durable that exists with another
    filter subject raises :class:`DurableMismatchError` naming both and is left untouched.
    """
    done: dict[str, str] = {}
    for spec in specs:
        try:
            have = (await js.consumer_info(spec.stream, spec.name)).config
        except NotFoundError:
            await js.add_consumer(spec.stream, consumer_config(spec))
            log.info(
                "bus.durable.created",
                stream=spec.stream,
                durable=spec.name,
                filter=spec.filter_subject,
            )
            done[spec.name] = "created"
            continue
        if have.filter_subject != spec.filter_subject:
            raise DurableMismatchError(
                f"durable {spec.name!r} on {spec.stream} exists with filter "
                f"{have.filter_subject!r}, not "
                f"{spec.filter_subject!r}; delete it or use another name"
            )
        diffs = _differences(have, spec)
        if diffs:
            await js.add_consumer(spec.stream, consumer_config(spec))
            log.info("bus.durable.updated", stream=spec.stream, durable=spec.name, changed=diffs)
        done[spec.name] = f"updated: {', '.join(diffs)}" if diffs else "unchanged"
    return done
