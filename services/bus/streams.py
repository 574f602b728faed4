"""The LEAFE streams on JetStream: created from ``leafe.protocol.subjects.STREAMS`` by the admin,
waited for by services.

Creating, updating or deleting a stream is the NATS admin's right alone
(deploy/base/nats/permissions.json): :func:`ensure_streams` runs in ``leafe streams ensure`` (the
deploy Job), in ``leafe run``'s supervisor and in the tests' session fixture. A service only reads
the stream info of the streams it uses, with :func:`wait_for_streams`: it waits (logging what is
missing and the command that creates it) and gives up after its timeout with
:class:`StreamsMissingError`, which names the streams and that command.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from enum import Enum
from typing import Any

import msgspec
import structlog
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError, ServiceUnavailableError

from leafe.protocol.subjects import DEAD_LETTERS, STREAMS, StreamSpec

__all__ = [
    "ENSURE_COMMAND",
    "StreamMismatchError",
    "StreamsMissingError",
    "check_streams",
    "ensure_streams",
    "stream_config",
    "wait_for_streams",
]

log = structlog.get_logger(__name__)
DIRECT_GET = frozenset({DEAD_LETTERS.name})
"""Streams that answer direct gets (``allow_direct``): a letter's writer reads the last message on
its letter's subject to tell its own letter from a foreign message
(``leafe.services.bus.dead_letters.store_once``; permissions pin each role to its own subjects)."""
ENSURE_COMMAND = "leafe streams ensure --nats URL (as the NATS admin)"
"""What creates the streams, for the messages of services that wait for them."""


class StreamMismatchError(RuntimeError):
    """A stream exists with a configuration that cannot be changed into the spec's."""


class StreamsMissingError(RuntimeError):
    """Streams a service needs did not appear within its timeout."""


def stream_config(spec: StreamSpec) -> StreamConfig:
    """The JetStream configuration of a :class:`StreamSpec`."""
    window = spec.duplicate_window_s
    if spec.max_age_s > 0:
        window = min(window, spec.max_age_s)  # the server rejects a window longer than max_age
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy(spec.retention),
        storage=StorageType(spec.storage),
        max_age=spec.max_age_s,
        duplicate_window=window,
        num_replicas=spec.replicas,
        max_msg_size=spec.max_msg_bytes,  # enforced by the server too, not only by our Publisher
        allow_direct=spec.name in DIRECT_GET,
    )


def _plain(value: Any) -> Any:
    return (
        value.value if isinstance(value, Enum) else value
    )  # nats-py returns enums as plain strings


def _differences(have: StreamConfig, want: StreamConfig) -> dict[str, tuple[Any, Any]]:
    diffs: dict[str, tuple[Any, Any]] = {}
    for field in ("subjects", "retention", "storage", "num_replicas", "max_msg_size"):
        a, b = _plain(getattr(have, field)), _plain(getattr(want, field))
        if field == "subjects":
            a, b = sorted(a or []), sorted(b or [])
        if a != b:
            diffs[field] = (a, b)
    if bool(have.allow_direct) != bool(want.allow_direct):
        diffs["allow_direct"] = (bool(have.allow_direct), bool(want.allow_direct))
    for field in ("max_age", "duplicate_window"):
        a, b = float(getattr(have, field) or 0.0), float(getattr(want, field) or 0.0)
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6):
            diffs[field] = (a, b)
    return diffs


def _with_replicas(specs: Sequence[StreamSpec], replicas: int | None) -> Sequence[StreamSpec]:
    if replicas is None:
        return specs
    if not 1 <= replicas <= 5:
        raise ValueError(f"stream replicas = {replicas}: expected an integer from 1 to 5")
    return [msgspec.structs.replace(spec, replicas=replicas) for spec in specs]


async def ensure_streams(
    js: JetStreamContext, specs: Sequence[StreamSpec] = STREAMS, *, replicas: int | None = None
) -> dict[str, str]:
    """Create each stream, or update an existing one whose changeable settings differ (admin only).

    Idempotent; returns what happened to each stream (``created``, ``updated: <fields>``,
    ``unchanged``). Storage and retention cannot change in place: a stream that differs there raises
    :class:`StreamMismatchError` naming the stream and both values, and is left untouched.
    ``replicas`` (``leafe streams ensure --stream-replicas``; 3 on a clustered JetStream) overrides
    every spec's.
    """
    done: dict[str, str] = {}
    for spec in _with_replicas(specs, replicas):
        want = stream_config(spec)
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(want)
            log.info("bus.stream.created", stream=spec.name, subjects=spec.subjects)
            done[spec.name] = "created"
            continue
        diffs = _differences(info.config, want)
        fixed = {k: v for k, v in diffs.items() if k in ("retention", "storage")}
        if fixed:
            raise StreamMismatchError(
                f"stream {spec.name} exists with "
                + ", ".join(f"{k}={have!r} (spec wants {w!r})" for k, (have, w) in fixed.items())
                + "; these cannot be changed in place: delete the stream or change the spec"
            )
        if diffs:
            updated = info.config.evolve(
                subjects=want.subjects,
                max_age=want.max_age,
                duplicate_window=want.duplicate_window,
                num_replicas=want.num_replicas,
                max_msg_size=want.max_msg_size,
                allow_direct=want.allow_direct,
            )
            await js.update_stream(updated)
            log.info(
                "bus.stream.updated", stream=spec.name, changes={k: v[1] for k, v in diffs.items()}
            )
        done[spec.name] = f"updated: {', '.join(sorted(diffs))}" if diffs else "unchanged"
    return done


async def check_streams(
    js: JetStreamContext, specs: Sequence[StreamSpec] = STREAMS, *, replicas: int | None = None
) -> dict[str, str]:
    """Each stream's state against its spec, changing nothing: ``ok``, ``missing``, or ``differs:
    ...`` naming each field with the stream's value and the spec's."""
    state: dict[str, str] = {}
    for spec in _with_replicas(specs, replicas):
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            state[spec.name] = "missing"
            continue
        diffs = _differences(info.config, stream_config(spec))
        shown = "; ".join(
            f"{k} is {have!r}, spec {want!r}" for k, (have, want) in sorted(diffs.items())
        )
        state[spec.name] = f"differs: {shown}" if diffs else "ok"
    return state


async def _missing(js: JetStreamContext, names: Sequence[str]) -> dict[str, str]:
    """The streams of ``names`` that cannot be seen now, each with why (missing, or no answer:
    JetStream not ready yet, or a stream this identity may not read)."""
    out: dict[str, str] = {}
    for name in names:
        try:
            await js.stream_info(name)
        except NotFoundError:
            out[name] = "missing"
        except (NatsTimeoutError, ServiceUnavailableError) as e:
            out[name] = f"no answer ({type(e).__name__})"
    return out


async def wait_for_streams(
    js: JetStreamContext, names: Sequence[str], *, timeout_s: float, interval_s: float = 2.0
) -> None:
    """Return once every stream of ``names`` exists; until then log ``bus.streams.waiting`` (what is
    missing and the command that creates it) every ``interval_s``; after ``timeout_s`` raise
    :class:`StreamsMissingError` naming the streams and that command. Never creates a stream."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = await _missing(js, names)
        if not missing:
            return
        if time.monotonic() >= deadline:
            what = ", ".join(f"{k} ({v})" for k, v in missing.items())
            log.error(
                "bus.streams.missing",
                streams=missing,
                timeout_s=timeout_s,
                create_with=ENSURE_COMMAND,
            )
            raise StreamsMissingError(
                f"streams {what} not there after {timeout_s:g}s; create them with {ENSURE_COMMAND}"
            )
        log.warning("bus.streams.waiting", streams=missing, create_with=ENSURE_COMMAND)
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
