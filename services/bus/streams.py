"""The LEAFE streams on JetStream: created from ``protocol.subjects.STREAMS``, idempotently."""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from protocol.subjects import STREAMS, StreamSpec

__all__ = ["StreamMismatchError", "ensure_streams", "stream_config"]

log = structlog.get_logger(__name__)


class StreamMismatchError(RuntimeError):
    """A stream exists with a configuration that cannot be changed into the spec's."""


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
    )


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value  # nats-py returns enums as plain strings


def _differences(have: StreamConfig, want: StreamConfig) -> dict[str, tuple[Any, Any]]:
    diffs: dict[str, tuple[Any, Any]] = {}
    for field in ("subjects", "retention", "storage", "num_replicas"):
        a, b = _plain(getattr(have, field)), _plain(getattr(want, field))
        if field == "subjects":
            a, b = sorted(a or []), sorted(b or [])
        if a != b:
            diffs[field] = (a, b)
    for field in ("max_age", "duplicate_window"):
        a, b = float(getattr(have, field) or 0.0), float(getattr(want, field) or 0.0)
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6):
            diffs[field] = (a, b)
    return diffs


async def ensure_streams(
    js: JetStreamContext, specs: Sequence[StreamSpec] = STREAMS, *, replicas: int | None = None
) -> None:
    """Create each stream, or update an existing one whose changeable settings differ.

    Idempotent. Storage and retention cannot change in place: a stream that differs there raises
    :class:`StreamMismatchError` naming the stream and both values, and is left untouched.
    ``replicas`` (``NatsOptions.stream_replicas``; 3 on a clustered JetStream) overrides every spec's.
    """
    if replicas is not None:
        if not 1 <= replicas <= 5:
            raise ValueError(f"stream replicas = {replicas}: expected an integer from 1 to 5")
        specs = [msgspec.structs.replace(spec, replicas=replicas) for spec in specs]
    for spec in specs:
        want = stream_config(spec)
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(want)
            log.info("bus.stream.created", stream=spec.name, subjects=spec.subjects)
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
            )
            await js.update_stream(updated)
            log.info("bus.stream.updated", stream=spec.name, changes={k: v[1] for k, v in diffs.items()})
