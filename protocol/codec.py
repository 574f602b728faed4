"""Wire codec: msgpack bodies with a codec-version header.

Decoders are built once per union. Anything malformed (bad bytes, wrong types, unknown kind, a future
codec version) raises :class:`ProtocolError` naming what was wrong; no other exception escapes
``decode_*``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from protocol.events import EpisodeEvent, WeightsPublished
from protocol.samples import Sample
from protocol.tasks import TaskAssignment

__all__ = [
    "CODEC_HEADER",
    "CODEC_VERSION",
    "MSG_ID_HEADER",
    "ProtocolError",
    "decode_event",
    "decode_sample",
    "decode_task",
    "decode_weights",
    "encode",
    "headers_for",
    "message_id",
]

CODEC_VERSION = "1"
"""Bumped only for incompatible changes; readers accept versions they know."""
CODEC_HEADER = "Leafe-Codec"
MSG_ID_HEADER = "Nats-Msg-Id"
_KNOWN_VERSIONS = frozenset({CODEC_VERSION})

T = TypeVar("T")


class ProtocolError(ValueError):
    """A message that cannot be decoded into the expected type; ``reason`` says why."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"cannot decode {what}: {reason}")
        self.what = what
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(EpisodeEvent)
_task_decoder = msgspec.msgpack.Decoder(TaskAssignment)
_sample_decoder = msgspec.msgpack.Decoder(Sample)
_weights_decoder = msgspec.msgpack.Decoder(WeightsPublished)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of any protocol Struct."""
    return _encoder.encode(msg)


def message_id(msg: Any) -> str:
    """The deterministic id a message is published under (event_id, task_key or sample_id)."""
    for attr in ("event_id", "sample_id", "task_key"):
        value = getattr(msg, attr, None)
        if isinstance(value, str) and value:
            return value
    raise TypeError(f"{type(msg).__name__} has no message id field")


def headers_for(msg: Any) -> dict[str, str]:
    """NATS headers for publishing ``msg``: dedupe id and codec version."""
    return {MSG_ID_HEADER: message_id(msg), CODEC_HEADER: CODEC_VERSION}


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: Any, what: str, codec_version: str | None) -> Any:
    if codec_version is not None and codec_version not in _KNOWN_VERSIONS:
        raise ProtocolError(
            what, f"unknown codec version {codec_version!r} (known: {sorted(_KNOWN_VERSIONS)})"
        )
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(what, f"expected bytes, got {type(data).__name__}")
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(what, f"invalid content: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(what, f"malformed msgpack: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolError(what, f"{type(e).__name__}: {e}") from None


def decode_event(data: bytes, codec_version: str | None = None) -> EpisodeEvent:
    """Decode an episode event; raises :class:`ProtocolError`."""
    return _decode(_event_decoder, data, "episode event", codec_version)  # type: ignore[no-any-return]


def decode_task(data: bytes, codec_version: str | None = None) -> TaskAssignment:
    """Decode a task assignment; raises :class:`ProtocolError`."""
    return _decode(_task_decoder, data, "task assignment", codec_version)  # type: ignore[no-any-return]


def decode_sample(data: bytes, codec_version: str | None = None) -> Sample:
    """Decode a sample; raises :class:`ProtocolError`."""
    return _decode(_sample_decoder, data, "sample", codec_version)  # type: ignore[no-any-return]


def decode_weights(data: bytes, codec_version: str | None = None) -> WeightsPublished:
    """Decode a ``WeightsPublished``; raises :class:`ProtocolError`."""
    return _decode(_weights_decoder, data, "weights announcement", codec_version)  # type: ignore[no-any-return]
