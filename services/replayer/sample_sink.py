"""Storing the replayer's samples on ``LEAFE_SAMPLES``: every one acknowledged, or dead-lettered.

:meth:`SampleSink.store` publishes a batch of samples (``Nats-Msg-Id`` = sample id, so a retry or a
recovery's republish is stored once) and retries what JetStream did not acknowledge, up to
``attempts`` times, then raises :class:`ReplayerError` (the replayer exits; a restart recovers). A
sample over the samples limit (the stream's ``max_msg_bytes``, the server's ``max_payload``, or
``max_sample_bytes``) cannot be stored and retrying cannot help: it is dead-lettered with the reason
and the batch goes on. Its dead letter goes where all of the replayer's go, under
``leafe.<run>.dead.leafe_events`` (the only dead subjects the ``replayer`` NATS role may publish to,
``deploy/base/nats/permissions.json``), told apart by its ``Leafe-Sample-Id`` and
``Leafe-Original-Stream: LEAFE_SAMPLES`` headers and its code ``sample_too_large``, on a subject
keyed by sample id (``...dead.leafe_events.sample-<id>``), so a redo is a no-op
(``leafe.services.bus.dead_letters``). ``leafe replay`` rebuilds such samples into datasets.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from leafe.protocol.codec import CODEC_VERSION, encode
from leafe.protocol.samples import Sample
from leafe.protocol.subjects import EVENTS, SAMPLES, dead_letter_subject, sample_subject
from leafe.services.bus import MessageTooLargeError, Publisher, PublishError
from leafe.services.bus.dead_letters import (
    ORIGINAL_STREAM_HEADER,
    SAMPLE_ID_HEADER,
    dead_letter_limit,
    dead_letter_message,
    publish_dead_letter,
)

__all__ = ["ReplayerError", "SampleSink"]

log = structlog.get_logger(__name__)


class ReplayerError(RuntimeError):
    """The replayer cannot continue (samples could not be stored); a restart recovers."""


class SampleSink:
    """Publishes samples of one run with retries; dead-letters the ones too large to store."""

    def __init__(
        self, js: Any, run_id: str, *, attempts: int, max_pending: int, max_sample_bytes: int | None
    ) -> None:
        self.js = js
        self.run_id = run_id
        self.attempts = attempts
        self.publisher = Publisher(js, max_pending=max_pending, max_msg_bytes=max_sample_bytes)
        self.dead_subject = dead_letter_subject(run_id, EVENTS.name)
        self.published = 0
        """Samples acknowledged by JetStream."""
        self.dead_lettered = 0
        """Samples dead-lettered for their size (each counted once, redos excluded)."""

    async def store(self, samples: list[Sample]) -> list[Sample]:
        """Publish ``samples`` until each is acknowledged or dead-lettered; returns those published.
        :class:`ReplayerError` after ``attempts`` rounds with some still unacknowledged."""
        pending = {s.sample_id: s for s in samples}
        for attempt in range(1, self.attempts + 1):
            if not pending:
                return []
            try:
                for sid, s in list(pending.items()):
                    try:
                        await self.publisher.publish(sample_subject(self.run_id, s.kind), s)
                    except MessageTooLargeError as e:
                        await self._dead_letter(s, str(e))
                        del pending[sid]
                await self.publisher.flush()
                self.published += len(pending)
                return list(pending.values())
            except PublishError as e:
                log.warning(
                    "replayer.publish.retry", attempt=attempt, unacked=len(e.unacked), error=str(e)
                )
                try:
                    await (
                        self.publisher.flush()
                    )  # settle what is in flight; all of `pending` is retried
                except PublishError:
                    pass  # already being retried as part of `pending`
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        raise ReplayerError(
            f"{len(pending)} samples not acknowledged after {self.attempts} attempts"
        )

    async def _dead_letter(self, sample: Sample, reason: str) -> None:
        origin = {
            ORIGINAL_STREAM_HEADER: SAMPLES.name,
            SAMPLE_ID_HEADER: sample.sample_id,
            "Leafe-Episode-Id": sample.episode_id,
        }
        letter = dead_letter_message(
            self.dead_subject,
            encode(sample),
            reason,
            key=f"sample-{sample.sample_id}",
            origin=origin,
            max_bytes=dead_letter_limit(self.js),
            codec=CODEC_VERSION,
            code="sample_too_large",
        )
        if await publish_dead_letter(self.js, letter):
            self.dead_lettered += 1
        log.warning(
            "replayer.sample.dead_letter",
            sample_id=sample.sample_id,
            episode_id=sample.episode_id[:80],
            bytes=len(letter.data),
            reason=reason[:300],
        )
