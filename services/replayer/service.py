"""The online replayer: events in, samples out, with no loss and no duplicates (``leafe replayer``).

::

    LEAFE_EVENTS ──durable pull──► fold (leafe.learner.materializers) ──► Publisher
    leafe.<run>.events.>                                                  leafe.<run>.samples.<kind>
        ▲  plain events: acked once the samples they produced are acked
        └─ anchors (each episode's EpisodeStarted): held with in-progress acks until the fold
           releases the episode (finished or abandoned, and for GRPO its group emitted), then acked

Restart at any moment. The fold's per-episode state lives in memory, so a restarted replayer must
see every event of every episode that was still open. Acking every event after its samples are
stored would lose that state; holding every event until its episode ends would make
``max_ack_pending`` a limit on (open episodes x events per episode) and redeliver in a scrambled
order. Instead only each episode's first event, its *anchor*, is held. JetStream's ack floor F
(every seq <= F acked) then stays below the anchor of every episode not yet released, so all their
events lie after F. On start the replayer reads its durable's F and D (last seq delivered to the
previous process), re-folds the range (F, D] with an ephemeral reader
(``leafe.services.bus.read_range``; republishing its samples: same ids, dropped by JetStream's
duplicate window, one day by default), then resumes the durable, which delivers seqs > D and
redelivers the previous process's unacked messages (held anchors become this process's anchors; the
rest are duplicates the fold ignores, or rejects it dead-letters again). Recovery skips what the
fold rejects: the previous process dead-lettered it before acking it, or the durable redelivers it.
Ordering inside a batch: fold -> publish samples -> flush (retry what was not acked) -> dead-letter
rejects -> ack the rest -> dead-letter the anchors of failed episodes and ack the anchors of
released ones; a crash between any two steps is repaired by the next start. Anchors go last, so an
acked anchor means every event of its episode up to its release is acked: after a restart, a
redelivered event of an episode the recovered fold does not know was never applied (it is
dead-lettered, its reason marked "redelivered after a restart": its episode never started, or held
nothing and started below the ack floor). Run exactly one replayer per (run, materializer): the
durable consumer is its identity.

Bad input (see the "Trust" section of ``docs/architecture.md``): every message passes
``leafe.protocol.codec.admit_event`` first (size <= ``max_event_bytes``, a ``Leafe-Codec`` header, a
decodable body, subject run, kind and actor token equal to the event's, event id
``<episode>.<seq>``), or ``leafe.services.bus.Consumer`` dead-letters it. The actor token is the
publisher's NATS identity, so ``max_open_per_actor`` and ``max_open_bytes_per_actor`` cap what each
credential can hold open, whatever its payloads say. An event the fold rejects (``ReplayError``:
unknown branch, Branch before its Reflection, a conflicting copy of an applied id, an episode past
``max_open_episodes``, ``max_open_per_actor``, ``max_open_bytes`` or ``max_open_bytes_per_actor``, a
token id outside the tokenizer's vocabulary...) is dead-lettered with the reason and its code
(``ReplayError.code``); an exception while folding an episode (``EpisodeFailed``) dead-letters that
event and the episode's anchor, and its later events follow. A sample over the samples limit
(``max_sample_bytes``) is dead-lettered instead of stored (``leafe.services.replayer.sample_sink``).
Dead letters are stored before their message is acked, on subjects that make a redo after a crash a
no-op (``leafe.services.bus.dead_letters``); recovery folds the same events through the same checks,
so a restarted process rejects what the crashed one rejected. Episodes without activity for
``stale_timeout_s`` are closed as abandoned. Episodes refused for a cap can be folded later: ``leafe
replayer redrive`` (``services/replayer/redrive.py``) publishes their dead-lettered events again
with ``Leafe-Redrive``, and an EpisodeStarted carrying it is tried against the caps anew
(``_readmit``; in recovery too, so a restart decides the same). SIGTERM/SIGINT: finish the batch in
hand, then exit.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import structlog
from nats.js.errors import NotFoundError

from leafe.learner.materializers import (
    EpisodeFailed,
    Materializer,
    OpenLimits,
    ReplayError,
    make_materializer,
)
from leafe.protocol.codec import (
    FOREIGN_EPISODE,
    Admission,
    ProtocolError,
    admit_event,
    decode_event,
)
from leafe.protocol.events import EpisodeStarted
from leafe.protocol.samples import Sample
from leafe.protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    SAMPLES,
    dead_letter_subject,
    events_filter,
    replayer_durable,
    validate_run_id,
)
from leafe.services.bus import Consumer, NatsOptions, connect, read_range, wait_for_streams
from leafe.services.bus.consumer import dead_letter_of
from leafe.services.bus.dead_letters import ERROR_HEADER, REDRIVE_HEADER, publish_dead_letter
from leafe.services.metrics import ReplayerMetrics
from leafe.services.probes import Probe, attach
from leafe.services.replayer.config import ReplayerConfig, ReplayerStats
from leafe.services.replayer.sample_sink import ReplayerError, SampleSink

__all__ = ["Replayer", "ReplayerConfig", "ReplayerError", "ReplayerStats", "serve"]

log = structlog.get_logger(__name__)
_LAG_CHECK_S = 5.0
"""How often ``leafe_replayer_consumer_lag`` is refreshed from the durable's info."""
STREAMS_USED = (EVENTS.name, SAMPLES.name, DEAD_LETTERS.name)
"""The streams the replayer waits for on start (made by `leafe streams ensure`)."""


class Replayer:
    """A materializer wired to the events stream (see the module docstring for the ack protocol)."""

    def __init__(
        self,
        js: Any,
        *,
        run_id: str,
        fold: Materializer,
        config: ReplayerConfig,
        metrics: ReplayerMetrics | None = None,
    ) -> None:
        self.js = js
        self.run_id = validate_run_id(run_id)
        self.fold = fold
        self.config = config
        self.filter_subject = events_filter(run_id)
        self.durable = replayer_durable(run_id, fold.name)
        self.dead_subject = dead_letter_subject(run_id, EVENTS.name)
        self.admission = Admission(
            max_event_bytes=config.max_event_bytes, require_codec_header=config.require_codec_header
        )
        fold.limits = OpenLimits(
            max_open=config.max_open_episodes,
            max_per_actor=config.max_open_per_actor,
            max_bytes=config.max_open_bytes,
            max_bytes_per_actor=config.max_open_bytes_per_actor,
        )
        self.sink = SampleSink(
            js,
            self.run_id,
            attempts=config.publish_attempts,
            max_pending=config.publish_max_pending,
            max_sample_bytes=config.max_sample_bytes,
        )
        self.consumer: Any = None
        self.anchors: dict[str, Any] = {}
        self.unreleased: set[str] = set()
        self.failed: dict[str, str] = {}
        """Episodes whose fold raised in this batch -> why (their anchors are dead-lettered on
        release)."""
        self.recovery_until = 0
        self.stats = ReplayerStats()
        self.metrics = metrics or ReplayerMetrics()
        """Prometheus metrics (``services/metrics.py``); served by ``leafe replayer
        --metrics-port``."""
        self.metrics.open_episodes.set_function(lambda: self.fold.open_episodes)
        self.metrics.held_anchors.set_function(lambda: len(self.anchors))
        self.probe = Probe("replayer", stale_after_s=max(300.0, 4 * config.ack_wait_s))
        """``/healthz`` (``services/probes.py``): progress is a fetch returning (a batch or
        nothing)."""
        attach(self.metrics.registry, self.probe)
        self._last_lag = 0.0
        self._last_keepalive = time.monotonic()
        self._last_stale = time.monotonic()

    async def start(self) -> None:
        """Recover the state of unreleased episodes, then bind the durable consumer."""
        floor, delivered = await self._position()
        self.consumer = Consumer(
            self.js,
            stream=EVENTS.name,
            durable=self.durable,
            filter_subject=self.filter_subject,
            decode=decode_event,
            admit=functools.partial(admit_event, admission=self.admission),
            dead_letter_subject=self.dead_subject,
            batch=self.config.batch,
            ack_wait_s=self.config.ack_wait_s,
            max_ack_pending=self.config.max_ack_pending,
        )
        if delivered > floor:
            await self._recover(floor + 1, delivered)
        self.recovery_until = delivered
        await self.consumer.start()
        self.probe.connected(
            self.js._nc
        )  # the connection behind the JetStream context (as services/bus)
        self.probe.bound(self.durable)
        log.info(
            "replayer.started",
            durable=self.durable,
            ack_floor=floor,
            delivered=delivered,
            **asdict(self.stats),
        )

    async def _position(self) -> tuple[int, int]:
        try:
            info = await self.js.consumer_info(EVENTS.name, self.durable)
        except NotFoundError:
            return 0, 0
        return int(info.ack_floor.stream_seq or 0), int(info.delivered.stream_seq or 0)

    async def _recover(self, start: int, end: int) -> None:
        now = time.monotonic()
        samples: list[Sample] = []
        async for msg in read_range(
            self.js, filter_subject=self.filter_subject, start_seq=start, end_seq=end
        ):
            try:
                event = admit_event(msg.subject, msg.headers, msg.data, self.admission)
            except ProtocolError:
                continue  # dead-lettered by the previous process's consumer, or redelivered to ours
            self._readmit(event, msg.headers)
            try:
                samples += self.fold.apply(event, now=now)
            except ReplayError:
                if self.fold.knows(event.episode_id):
                    self.stats.recovery_rejected += 1
                else:
                    self.stats.recovery_skipped += 1
                continue
            self.stats.recovered_events += 1
            if isinstance(event, EpisodeStarted) and self.fold.is_open(event.episode_id):
                self.unreleased.add(event.episode_id)
            if len(samples) >= 512:
                await self._publish(samples)
                samples = []
        await self._publish(samples)
        await self._release()
        log.info(
            "replayer.recovered",
            start_seq=start,
            end_seq=end,
            open_episodes=self.fold.open_episodes,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, fold, publish and ack until ``stop`` is set; the batch in hand is always
        finished."""
        if self.consumer is None:
            await self.start()
        while not stop.is_set():
            deliveries = await self.consumer.fetch(timeout=self.config.fetch_timeout_s)
            self.probe.progress()
            if deliveries:
                await self.process(deliveries)
            await self._housekeeping()
        self.probe.unbound()
        await self.consumer.close()
        log.info("replayer.stopped", open_episodes=self.fold.open_episodes, **asdict(self.stats))

    async def process(self, deliveries: Sequence[Any]) -> None:
        """Fold a batch, store its samples, then settle every delivery (see the ordering above)."""
        now = time.monotonic()
        samples: list[Sample] = []
        to_ack: list[Any] = []
        rejected: list[tuple[Any, str, str]] = []
        for d in deliveries:
            event = d.value
            self._readmit(event, d.msg.headers)
            try:
                samples += self.fold.apply(event, now=now)
            except ReplayError as e:
                rejected.append((d, self._why(d, e), e.code))
                continue
            if isinstance(event, EpisodeStarted):
                if self.fold.is_open(event.episode_id):
                    self.unreleased.add(event.episode_id)
                if event.episode_id in self.unreleased:
                    self.anchors[event.episode_id] = (
                        d  # a redelivered anchor replaces the older delivery
                    )
                    continue
            to_ack.append(d)
        self.stats.events += len(deliveries)
        self.metrics.events.inc(len(deliveries))
        self.stats.batches += 1
        await self._publish(samples)
        for d, reason, code in rejected:
            await self._dead_letter(d, reason, code)
            to_ack.append(d)
        for d in to_ack:
            await d.ack()
        await self._release()
        self.stats.anchors_held = len(self.anchors)

    def _readmit(self, event: Any, headers: dict[str, str] | None) -> None:
        """An EpisodeStarted published again by ``leafe replayer redrive`` (``Leafe-Redrive``) of an
        episode refused for a cap is tried against the caps anew. Anyone who may publish events
        could set the header, but it grants nothing a fresh episode id would not: the caps still
        apply."""
        if isinstance(event, EpisodeStarted) and headers and REDRIVE_HEADER in headers:
            if self.fold.readmit(event.episode_id):
                self.stats.redriven += 1
                log.info(
                    "replayer.episode.redriven",
                    episode_id=event.episode_id[:80],
                    original_seq=headers[REDRIVE_HEADER][:20],
                )

    def _why(self, d: Any, error: ReplayError) -> str:
        if isinstance(error, EpisodeFailed):
            self.stats.episodes_failed += 1
            self.failed[error.event.episode_id] = error.reason
        if d.stream_seq <= self.recovery_until and not self.fold.knows(d.value.episode_id):
            # The crashed process may have dead-lettered it already (then this is a no-op), or its
            # episode may lie below the ack floor (an episode that held nothing): say so.
            return f"{error.reason} (redelivered after a restart)"
        return error.reason

    async def _publish(self, samples: list[Sample]) -> None:
        for s in await self.sink.store(samples):
            self.metrics.samples.labels(kind=s.kind).inc()
        self.stats.samples_published = self.sink.published
        self.stats.samples_dead_lettered = self.sink.dead_lettered

    async def _dead_letter(self, d: Any, reason: str, code: str) -> None:
        letter = dead_letter_of(self.js, d.msg, reason, self.dead_subject, code=code)
        await publish_dead_letter(self.js, letter)
        self.stats.dead_letters += 1
        self.metrics.dead_letter(
            "wrong_run"
            if d.value.run_id != self.run_id
            else FOREIGN_EPISODE  # another actor's episode: counted under its own label
            if code == FOREIGN_EPISODE
            else "rejected"
        )
        log.warning(
            "replayer.event.dead_letter",
            event_id=d.value.event_id[:80],
            stream_seq=d.stream_seq,
            reason=letter.headers[ERROR_HEADER],
        )

    async def _release(self) -> None:
        for eid in self.fold.drain_released():
            self.unreleased.discard(eid)
            anchor = self.anchors.pop(eid, None)
            reason = self.failed.pop(eid, None)
            if anchor is None:
                continue
            if reason is not None:
                await self._dead_letter(anchor, reason, "episode_failed")
            await anchor.ack()
        # failures of episodes without a held anchor (dead-lettered event by event)
        self.failed.clear()

    async def _refresh_lag(self, now: float) -> None:
        """``leafe_replayer_consumer_lag`` from the durable's ``num_pending`` (a failed read only
        logs)."""
        self.metrics.admission_refusals(self.consumer.dead_letters_by_category)
        if now - self._last_lag < _LAG_CHECK_S:
            return
        self._last_lag = now
        try:
            info = await self.js.consumer_info(EVENTS.name, self.durable)
        except Exception as e:  # a metric must never stop the replayer; the next check retries
            log.warning("replayer.lag.unknown", error=f"{type(e).__name__}: {e}")
            return
        self.metrics.consumer_lag.set(int(info.num_pending or 0))

    async def _housekeeping(self) -> None:
        now = time.monotonic()
        await self._refresh_lag(now)
        if now - self._last_keepalive >= self.config.ack_wait_s / 3:
            self._last_keepalive = now
            for anchor in list(self.anchors.values()):
                await anchor.in_progress()
            if len(self.anchors) > 0.8 * self.config.max_ack_pending:
                log.warning(
                    "replayer.anchors.high",
                    anchors=len(self.anchors),
                    max_ack_pending=self.config.max_ack_pending,
                )
        if now - self._last_stale >= self.config.stale_check_s:
            self._last_stale = now
            before = self.fold.stats.episodes_abandoned
            await self._publish(self.fold.close_stale(now, self.config.stale_timeout_s))
            await self._release()
            self.stats.stale_closed += self.fold.stats.episodes_abandoned - before
            fold = self.fold.stats
            log.info(
                "replayer.progress",
                open_episodes=self.fold.open_episodes,
                samples_by_kind=dict(fold.samples),
                rejected=fold.rejected,
                prompt_mismatches=fold.prompt_mismatches,
                **asdict(self.stats),
            )


async def serve(
    config: ReplayerConfig,
    *,
    nats: NatsOptions | str,
    run_id: str,
    stop: asyncio.Event,
    metrics: ReplayerMetrics | None = None,
) -> ReplayerStats:
    """Connect, build the materializer, run the replayer until ``stop``; returns its counters."""
    from leafe.learner.model_io import (  # transformers: loaded by the service only
        HFChatTokenizer,
        resolve_model,
    )

    opts = NatsOptions(url=nats) if isinstance(nats, str) else nats
    tokenizer = HFChatTokenizer.from_dir(resolve_model(config.model))
    fold = make_materializer(config.materializer, tokenizer, **config.options)
    nc = await connect(opts, name=f"leafe-replayer-{run_id}")
    try:
        js = nc.jetstream()
        await wait_for_streams(js, STREAMS_USED, timeout_s=opts.streams_timeout_s)
        replayer = Replayer(js, run_id=run_id, fold=fold, config=config, metrics=metrics)
        await replayer.start()
        await replayer.run(stop)
        return replayer.stats
    finally:
        await nc.close()
