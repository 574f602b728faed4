"""The online learner service, rank 0 of ``leafe learner``: samples -> steps -> checkpoints ->
pushes.

```
 LEAFE_SAMPLES ──fetch──► SampleBuffer (seq order) ──take──► TrainCmd ─► Executor (all ranks, FSDP2)
      ▲  in_progress every ack_wait/3 for held + buffered          │ every checkpoint_every steps
      └───── ack after the checkpoint that covers them ◄─ CheckpointCmd (DCP: weights + samples_seq)
                                                                   │ every push_every steps
 LEAFE_WEIGHTS ◄── WeightsPublished ◄── ExportCmd <store>/v<N>/ ◄──┘ (checkpoint first, then export)
```

| loop     | main                             | heartbeat                  |
|----------|----------------------------------|----------------------------|
| produces | steps, checkpoints, pushes       | in-progress acks           |
| consumes | deliveries                       | held + buffered deliveries |
| waits on | a full batch (tail: flush)       | ack_wait_s / 3             |

Exactly-once relative to the checkpointed weights: the checkpoint records ``samples_seq`` (every
sequence <= it was trained or deliberately dropped). On start the durable consumer is re-created to
deliver from ``samples_seq + 1``, so samples trained before the checkpoint are never trained again
and those trained after it (lost with the process) are trained again. Acks follow checkpoints and
only keep JetStream's pending window small. A push checkpoints first (recording the new version
index), then exports and publishes; a crash in between is repaired on start by re-exporting the
checkpointed weights under the same version, so a version name always means one set of weights.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from leafe.learner.batching import out_of_vocab
from leafe.learner.checkpoint import Progress
from leafe.learner.config import LearnerConfig
from leafe.learner.executor import CheckpointCmd, Executor, ExportCmd, NoopCmd, TrainCmd
from leafe.learner.model_io import ManifestError, verify_manifest
from leafe.learner.online import Batch, SampleBuffer, policy_lag
from leafe.learner.scalars import NullScalarWriter, ScalarWriter, write_step_scalars
from leafe.learner.trainer import StepStats
from leafe.learner.weight_store import prune_versions, version_name
from leafe.protocol import WeightsPublished, dead_letter_subject, decode_sample, weights_subject
from leafe.protocol.codec import CODEC_HEADER, ProtocolError
from leafe.protocol.samples import Sample
from leafe.protocol.subjects import DEAD_LETTERS, SAMPLES, WEIGHTS, learner_durable, samples_filter
from leafe.services.bus import Consumer, Delivery, NatsOptions, Publisher, connect, wait_for_streams
from leafe.services.bus.connection import confined_role
from leafe.services.learner.control import ControlFile, apply_threads
from leafe.services.metrics import LearnerMetrics
from leafe.services.probes import Probe, attach

__all__ = ["OnlineLearner", "SampleConsumer", "StepCallback"]

log = structlog.get_logger(__name__)
STREAMS_USED = (SAMPLES.name, WEIGHTS.name, DEAD_LETTERS.name)
"""The streams the learner waits for on start (made by `leafe streams ensure`)."""

PROBE_STALE_S = 1800.0
"""``/healthz`` fails after this long without a fetch or step: above the slowest step + checkpoint +
export of a large model on GPU (the export of a 7B model writes ~15 GB)."""
StepCallback = Callable[[StepStats, list[str], Progress], None]
"""Called after each step with the stats, the trained sample ids and the progress (not yet
checkpointed)."""
_NOOP_EVERY_S = 300.0


class SampleConsumer(Consumer[Sample]):
    """The learner's durable consumer, re-created on start to deliver from ``start_seq`` (the
    checkpoint's ``samples_seq + 1``): the checkpoint, not the consumer's ack floor, says where
    training resumes."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        run_id: str,
        durable: str,
        start_seq: int,
        vocab_size: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(
            js,
            stream=SAMPLES.name,
            durable=durable,
            filter_subject=samples_filter(run_id),
            decode=decode_sample,
            admit=None
            if vocab_size is None
            else functools.partial(_admit_sample, vocab_size=vocab_size),
            dead_letter_subject=dead_letter_subject(run_id, SAMPLES.name),
            deliver_policy="by_start_sequence",
            **kw,
        )
        # leafe.services.bus.Consumer has no start-sequence parameter; its config is a plain nats-py
        # dataclass.
        self._config.opt_start_seq = max(1, start_seq)
        self._js_ctx = js

    async def start(self) -> None:
        """Delete any previous durable consumer of this name, then create it at ``start_seq``; under
        the learner role, which may not (services/bus/durables.py), bind the admin's durable
        instead: what it redelivers at or below the checkpoint is set aside as a duplicate
        (``SampleBuffer.floor``)."""
        if confined_role(self._js_ctx._nc) is None:
            try:
                await self._js_ctx.delete_consumer(self.stream, self.durable)
            except NotFoundError:
                pass  # first start: nothing to replace
        await super().start()


def _admit_sample(
    subject: str, headers: Mapping[str, str] | None, data: bytes, *, vocab_size: int
) -> Sample:
    """The sample, if every token id has a row in the model's embedding; else ``ProtocolError`` (the
    consumer dead-letters it with the reason, as the replayer does an event with such an id)."""
    sample = decode_sample(data, headers.get(CODEC_HEADER) if headers else None)
    why = out_of_vocab(sample, vocab_size)
    if why is not None:
        raise ProtocolError("sample", why)
    return sample


def _manifest_sha256(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


class OnlineLearner:
    """Rank 0 of ``leafe learner``; see the module docstring."""

    def __init__(
        self,
        cfg: LearnerConfig,
        executor: Executor,
        progress: Progress,
        *,
        run_id: str,
        nats: NatsOptions | str,
        store: Path,
        base_model: str,
        on_step: StepCallback | None = None,
        metrics: LearnerMetrics | None = None,
        scalars: ScalarWriter | None = None,
        control: ControlFile | None = None,
    ) -> None:
        self.cfg = cfg
        self.executor = executor
        self.progress = progress
        self.checkpointed = progress
        self.run_id = run_id
        self.nats = NatsOptions(url=nats) if isinstance(nats, str) else nats
        self.store = Path(store)
        self.base_model = base_model
        self.on_step = on_step
        self.metrics = metrics or LearnerMetrics()
        """Prometheus metrics (``services/metrics.py``); served by ``leafe learner
        --metrics-port``."""
        self.scalars = scalars or NullScalarWriter()
        """TensorBoard scalars of every step (``leafe learner --tensorboard-dir``)."""
        self.control = control or ControlFile(None)
        """Threads and, in a phased run, the released samples (``services/learner/control.py``)."""
        self.metrics.progress(step=progress.step, samples_seq=progress.samples_seq)
        self.buffer: SampleBuffer[Delivery[Sample]] = SampleBuffer(
            kinds=cfg.kinds, max_policy_lag=cfg.max_policy_lag
        )
        self.buffer.floor = progress.samples_seq
        self.held: list[Delivery[Sample]] = []
        self.steps_here = 0
        self._pushed_at_step: int | None = None
        self._last_command = time.monotonic()
        self.probe = Probe("learner", stale_after_s=PROBE_STALE_S)
        """``/healthz`` (``services/probes.py``): progress is a fetch or a finished
        step/checkpoint/push."""
        attach(self.metrics.registry, self.probe)

    async def run(self, stop: asyncio.Event) -> Progress:
        """Train until ``stop`` is set (or ``stop_after_steps``); then checkpoint, ack and
        return."""
        async with AsyncExitStack() as stack:
            nc = await connect(self.nats, name=f"learner-{self.run_id}")
            stack.push_async_callback(nc.close)
            self.probe.connected(nc)
            js = nc.jetstream()
            await wait_for_streams(js, STREAMS_USED, timeout_s=self.nats.streams_timeout_s)
            consumer = SampleConsumer(
                js,
                run_id=self.run_id,
                durable=learner_durable(self.run_id, self.cfg.durable),
                start_seq=self.progress.samples_seq + 1,
                vocab_size=self.executor.trainer.vocab_size,
                batch=self.cfg.fetch_batch,
                ack_wait_s=self.cfg.ack_wait_s,
                max_ack_pending=self.cfg.max_ack_pending,
            )
            await stack.enter_async_context(consumer)
            self.probe.bound(consumer.durable)
            stack.callback(self.probe.unbound)
            pub = await stack.enter_async_context(Publisher(js))
            heartbeat = asyncio.create_task(self._heartbeat(), name="learner.heartbeat")
            stack.push_async_callback(self._cancel, heartbeat)
            log.info(
                "learner.started",
                run_id=self.run_id,
                start_seq=self.progress.samples_seq + 1,
                step=self.progress.step,
                version_index=self.progress.version_index,
            )
            await self._announce_current(pub)
            await self._loop(consumer, pub, stop)
            if (
                self.cfg.push_on_stop
                and self.steps_here > 0
                and self._pushed_at_step != self.progress.step
            ):
                await self._push(pub)  # checkpoints too
            else:
                await self._checkpoint()
        return self.progress

    @staticmethod
    async def _cancel(task: asyncio.Task[None]) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def _done(self, stop: asyncio.Event) -> bool:
        limit = self.cfg.stop_after_steps
        return stop.is_set() or (limit > 0 and self.steps_here >= limit)

    async def _loop(self, consumer: SampleConsumer, pub: Publisher, stop: asyncio.Event) -> None:
        tc = self.cfg.trainer
        while not self._done(stop):
            fetched = await consumer.fetch(timeout=1.0)
            self.probe.progress()
            if fetched:
                self.buffer.add(fetched)
                log.debug(
                    "learner.fetched",
                    count=len(fetched),
                    buffered=len(self.buffer),
                    held=len(self.held),
                )
            control = self.control.read()
            release = control.release_seq
            if release is not None:
                await self._train_release(release, pub)
            while release is None and not self._done(stop):
                batch = self.buffer.next_batch(
                    tc.batch.global_batch,
                    self.progress.version_index,
                    max_wait_s=self.cfg.max_batch_wait_s,
                    min_batch=self.cfg.min_batch,
                    flush=control.flush,
                )
                if batch is None:
                    break
                if await self._train(batch):
                    await self._after_step(pub)
                self.probe.progress()
            if (
                self._held_count()
                >= self.cfg.max_ack_pending - tc.batch.global_batch - self.cfg.fetch_batch
            ):
                await (
                    self._checkpoint()
                )  # free JetStream's pending window before it blocks delivery
            await self._keep_followers_alive()

    async def _train_release(self, release_seq: int, pub: Publisher) -> None:
        """A phased run: once every sample up to ``release_seq`` is here, train them all (sample-id
        order, ``SampleBuffer.take_release``) with no checkpoint in between, then push (checkpoint
        only when no step was taken), so that the phase's batches, steps and pushed weights do not
        depend on timing."""
        if self.progress.samples_seq >= release_seq or not self.buffer.holds_through(release_seq):
            return
        tc, steps = self.cfg.trainer, 0
        batches = self.buffer.take_release(
            release_seq, tc.batch.global_batch, self.progress.version_index
        )
        for batch in batches:
            steps += await self._train(batch)
        log.info(
            "learner.release.trained", release_seq=release_seq, steps=steps, batches=len(batches)
        )
        await (self._push(pub) if steps else self._checkpoint())

    def _held_count(self) -> int:
        return len(self.held) + len(self.buffer)

    async def _submit(self, cmd: Any) -> Any:
        self._last_command = time.monotonic()
        threads = self.control.read().threads
        return await asyncio.to_thread(self._apply, cmd, threads)

    def _apply(self, cmd: Any, threads: int) -> Any:
        apply_threads(threads)  # in the thread that runs the command (torch's pools are per thread)
        return self.executor.submit(cmd)

    async def _keep_followers_alive(self) -> None:
        if (
            self.executor.trainer.env.world_size > 1
            and time.monotonic() - self._last_command > _NOOP_EVERY_S
        ):
            await self._submit(NoopCmd())

    async def _train(self, batch: Batch[Delivery[Sample]]) -> bool:
        """Train the batch's samples (if any are left after filtering); True if a step was taken."""
        self.held.extend(batch.consumed)
        dropped = batch.stale + batch.ignored
        if dropped or batch.unknown_version:
            log.info(
                "learner.samples.filtered",
                stale=batch.stale,
                ignored_kind=batch.ignored,
                unknown_version=batch.unknown_version,
                max_policy_lag=self.cfg.max_policy_lag,
            )
        p = self.progress
        stats: StepStats | None = None
        started = time.perf_counter()
        if batch.samples:
            stats = await self._submit(TrainCmd(samples=batch.samples))
            dropped += stats.skipped  # too long or empty: consumed, never trained
        seconds = time.perf_counter() - started
        self.progress = msgspec.structs.replace(
            p,
            step=stats.step if stats is not None else p.step,
            samples_seq=max(p.samples_seq, batch.max_seq),
            samples_trained=p.samples_trained + (stats.samples if stats is not None else 0),
            samples_dropped=p.samples_dropped + dropped,
        )
        self._count(batch, stats)
        if stats is None or stats.samples == 0:
            if batch.consumed:
                self.metrics.skipped_batches.inc()
            return False
        self._flag(stats)
        self.steps_here += 1
        log.info(
            "learner.step", samples_seq=self.progress.samples_seq, **msgspec.to_builtins(stats)
        )
        lag = max(
            (policy_lag(s.policy_version, p.version_index) or 0 for s in batch.samples), default=0
        )
        tokens_per_second = stats.real_tokens / seconds if seconds > 0 else 0.0
        self.metrics.observe_step(stats, tokens_per_second=tokens_per_second, policy_lag=lag)
        self.metrics.observe_lags(batch.lags)
        write_step_scalars(self.scalars, stats, tokens_per_second=tokens_per_second, policy_lag=lag)
        if self.on_step is not None:
            self.on_step(stats, [s.sample_id for s in batch.samples], self.progress)
        return True

    def _flag(self, stats: StepStats) -> None:
        """Count a step that was partial, had its gradient clipped or a token dual-clipped (the
        run report's step counts)."""
        tc = self.cfg.trainer
        flags = {
            "partial": stats.samples < tc.batch.global_batch,
            "grad_clipped": 0 < tc.optim.max_grad_norm < stats.grad_norm,
            "dual_clipped": stats.dual_clipped > 0,
        }
        for why, flagged in flags.items():
            if flagged:
                self.metrics.flagged_steps.labels(why=why).inc()

    def _count(self, batch: Batch[Delivery[Sample]], stats: StepStats | None) -> None:
        m = self.metrics
        m.progress(step=self.progress.step, samples_seq=self.progress.samples_seq)
        m.dropped("stale", batch.stale)
        m.dropped("ignored_kind", batch.ignored)
        m.dropped("unusable", stats.skipped if stats is not None else 0)

    async def _after_step(self, pub: Publisher) -> None:
        tc, step = self.cfg.trainer, self.progress.step
        if tc.push_every and step % tc.push_every == 0:
            await self._push(pub)
        elif tc.checkpoint_every and step % tc.checkpoint_every == 0:
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """Checkpoint if anything changed since the last one, then ack what it covers."""
        if self.progress != self.checkpointed:
            with self.metrics.checkpoint_seconds.time():
                await self._submit(CheckpointCmd(progress=self.progress))
            self.checkpointed = self.progress
        acked = self.held + self.buffer.pop_duplicates()
        self.held = []
        for d in acked:
            await d.ack()

    async def _push(self, pub: Publisher) -> None:
        self._pushed_at_step = self.progress.step
        self.progress = msgspec.structs.replace(
            self.progress, version_index=self.progress.version_index + 1
        )
        with self.metrics.push_seconds.time():
            await self._checkpoint()
            await self._export_and_publish(pub)

    async def _announce_current(self, pub: Publisher) -> None:
        """On start: make sure the checkpoint's latest version is exported and announced
        (idempotent)."""
        if self.progress.version_index > 0:
            await self._export_and_publish(pub)

    async def _export_and_publish(self, pub: Publisher) -> None:
        version = version_name(self.progress.version_index)
        out = self.store / version
        digest = await self._existing_export(out)
        if digest is None:
            extra = {
                "learner_step": self.progress.step,
                "samples_seq": self.progress.samples_seq,
                "run_id": self.run_id,
            }
            t0 = time.perf_counter()
            digest = await self._submit(ExportCmd(out_dir=str(out), version=version, extra=extra))
            log.info(
                "learner.weights.exported",
                version=version,
                path=str(out),
                seconds=time.perf_counter() - t0,
            )
        event = WeightsPublished(
            event_id=f"weights.{self.run_id}.{version}",
            run_id=self.run_id,
            version=version,
            uri=str(out.resolve()),
            manifest_sha256=str(digest),
            learner_step=self.progress.step,
            base_model=self.base_model,
            samples_seq=self.progress.samples_seq,
            ts=time.time(),
        )
        await pub.publish(weights_subject(self.run_id), event)
        await pub.flush()
        log.info(
            "learner.weights.published", version=version, step=self.progress.step, uri=event.uri
        )
        pruned = prune_versions(self.store, self.cfg.trainer.retain_versions, protect={version})
        if pruned:
            log.info(
                "learner.weights.pruned", versions=pruned, retain=self.cfg.trainer.retain_versions
            )

    @staticmethod
    async def _existing_export(out: Path) -> str | None:
        if not (out / "manifest.json").is_file():
            return None
        try:
            await asyncio.to_thread(verify_manifest, out)
        except ManifestError as e:
            log.warning("learner.weights.export_invalid", path=str(out), error=str(e))
            return None
        return _manifest_sha256(out)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            pending: Sequence[Delivery[Sample]] = [*self.held, *self.buffer.pending()]
            for d in pending:
                await d.in_progress()
