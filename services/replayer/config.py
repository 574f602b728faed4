"""Configuration and counters of the online replayer (``leafe replayer``,
``services/replayer/service.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from leafe.protocol.subjects import EVENTS

__all__ = [
    "DEFAULT_MAX_OPEN_BYTES",
    "DEFAULT_MAX_OPEN_BYTES_PER_ACTOR",
    "ReplayerConfig",
    "ReplayerStats",
]

DEFAULT_MAX_OPEN_BYTES = 512 * 2**20
"""Default cap on the bytes of held episodes, online and offline (a real run holds tens of MB: an
actor runs tens of episodes of a few hundred KB each)."""
DEFAULT_MAX_OPEN_BYTES_PER_ACTOR = DEFAULT_MAX_OPEN_BYTES // 16
"""Default cap on what one actor's events may hold: 32 MiB, a sixteenth of the run's, as
``max_open_per_actor`` is of ``max_open_episodes``; so one credential cannot fill the run's cap
alone."""


class ReplayerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of ``leafe replayer`` (TOML via ``--config``; flags override)."""

    materializer: str = "leafe"
    """Materializer name (``leafe``, ``grpo``, ``rft``)."""
    model: str = "default"
    """Tokenizer source: ``default`` (SmolLM2), ``tiny`` or an HF model directory (must match the
    actors')."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Materializer options, e.g. ``rehearsal_fraction = 0.2``."""
    batch: int = 256
    """Events fetched per pull."""
    ack_wait_s: float = 30.0
    """JetStream AckWait: crash-detection time (held anchors get in-progress acks every third of
    it)."""
    max_ack_pending: int = 20_000
    """Unacked messages the durable may hold: one anchor per open episode plus a batch in flight."""
    max_open_episodes: int = 16_384
    """Episodes held at once (each holds its anchor); an EpisodeStarted past it is dead-lettered.
    ``max_open_episodes + batch`` must fit in ``max_ack_pending``, so anchors never stall the
    consumer."""
    max_open_per_actor: int = 1024
    """Episodes one actor may hold at once (an actor runs tens); past it, dead-lettered. Keyed on
    the events' subject token, which NATS pins to the publisher's credentials
    (``leafe.protocol.codec.admit_event``: ``actor_id`` must equal it; tokenless legacy events are
    all actor ``legacy``)."""
    max_open_bytes: int = DEFAULT_MAX_OPEN_BYTES
    """Bytes the held episodes' events may take together
    (``leafe.learner.materializers.lifecycle.event_bytes``: text and token ids, about their size in
    memory); an EpisodeStarted past it is dead-lettered, and so is any other event that would pass
    it. Bounds the fold's memory."""
    max_open_bytes_per_actor: int = DEFAULT_MAX_OPEN_BYTES_PER_ACTOR
    """Bytes the events one actor published may take in held episodes (keyed, like
    ``max_open_per_actor``, on the subject token NATS pins to the publisher); past it, its events
    are dead-lettered, others' not."""
    max_event_bytes: int = EVENTS.max_msg_bytes
    """Largest event message (headers included); larger ones are dead-lettered, never folded."""
    require_codec_header: bool = True
    """Dead-letter events without ``Leafe-Codec``; ``false`` only for logs written before the
    header."""
    max_sample_bytes: int | None = None
    """Largest sample message stored; ``None``: the samples stream's and the server's limit. Larger
    samples are dead-lettered (``leafe replay`` still writes them to datasets)."""
    stale_timeout_s: float = 3600.0
    """An episode with no event for this long is closed as abandoned (its actor crashed)."""
    stale_check_s: float = 30.0
    """How often abandoned episodes are looked for."""
    fetch_timeout_s: float = 1.0
    """Longest wait for new events before housekeeping runs."""
    publish_attempts: int = 5
    """Attempts to get every sample of a batch acknowledged before the replayer gives up (and
    exits)."""
    publish_max_pending: int = 2048
    """Outstanding sample publishes before ``publish`` waits (backpressure)."""

    def __post_init__(self) -> None:
        for name in (
            "batch",
            "max_ack_pending",
            "max_open_episodes",
            "max_open_per_actor",
            "max_open_bytes",
            "max_open_bytes_per_actor",
            "max_event_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be at least 1")
        if self.max_open_episodes + self.batch > self.max_ack_pending:
            raise ValueError(
                f"max_open_episodes ({self.max_open_episodes}) + batch ({self.batch}) exceeds "
                "max_ack_pending "
                f"({self.max_ack_pending}): held anchors could stall the consumer"
            )


@dataclass
class ReplayerStats:
    """Counters of one replayer process."""

    events: int = 0
    samples_published: int = 0
    dead_letters: int = 0
    recovered_events: int = 0
    recovery_skipped: int = 0
    recovery_rejected: int = 0
    samples_dead_lettered: int = 0
    episodes_failed: int = 0
    anchors_held: int = 0
    stale_closed: int = 0
    redriven: int = 0
    """Refused episodes tried again because ``leafe replayer redrive`` published them again."""
    batches: int = 0
