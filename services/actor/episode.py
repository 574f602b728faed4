"""One task assignment served by the actor service: episode, event publishing, keepalive,
ack/nak/term.

For each delivery :class:`EpisodeRunner` opens a Publisher, runs the explorer (``mode = explore``),
a demonstration (``demo``) or one plain rollout (``rollout``/``eval``) on a pooled env, flushes
(every event acked by JetStream), then acks the task, extending its AckWait with in-progress acks
meanwhile. Cancellation (drain, shutdown) naks at once; a sandbox that cannot isolate, an event
over the size limit or a prompt over the engines' context length (``PromptTooLong``, never sent)
terminates the task at once (they would fail again); any other error naks with a
delay and terminates the task on its ``max_attempts``-th delivery. The fetching side is
``services/actor/service.py``.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
from nats.js import JetStreamContext
from prometheus_client import Histogram

from leafe.actors.client import EngineUnavailable
from leafe.actors.config import ActorServiceConfig
from leafe.actors.demo import DemoRunner
from leafe.actors.engine import Completion, Engine, PromptTooLong, SamplingParams
from leafe.actors.env_pool import EnvPool
from leafe.actors.episode import EpisodeSpec, EpisodeSummary
from leafe.actors.explorer import Explorer
from leafe.actors.rollout import run_rollout
from leafe.envs.sandbox.launch import SandboxUnavailable
from leafe.protocol.config import config_digest
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.tasks import TaskAssignment, episode_id_for
from leafe.services.bus import Delivery, MessageTooLargeError, Publisher
from leafe.services.metrics import ActorMetrics
from leafe.services.probes import Probe

__all__ = ["ActorStats", "EpisodeRunner", "PublisherSink"]

log = structlog.get_logger(__name__)
_OUTAGES_KEPT = 10_000
"""Task keys whose engine outages an actor remembers (oldest forgotten first)."""


class TimedEngine:
    """An :class:`Engine` that records each ``generate`` call's duration in a histogram."""

    def __init__(self, engine: Engine, latency: Histogram) -> None:
        self.engine = engine
        self.latency = latency

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
    ) -> list[Completion]:
        """The wrapped engine's ``generate``, timed (failed calls too)."""
        t0 = time.perf_counter()
        try:
            return await self.engine.generate(input_ids, params, n=n, return_logprob=return_logprob)
        finally:
            self.latency.observe(time.perf_counter() - t0)

    async def weight_version(self) -> str:
        """The wrapped engine's version."""
        return await self.engine.weight_version()


class ActorStats(msgspec.Struct, kw_only=True):
    """Counters of one actor service."""

    taken: int = 0
    """Task deliveries started."""
    done: int = 0
    """Episodes finished and acked."""
    succeeded: int = 0
    """Finished episodes in which some branch succeeded."""
    retried: int = 0
    """Deliveries nak'ed after an error, for a later attempt."""
    failed: int = 0
    """Tasks terminated after ``max_attempts`` deliveries."""
    abandoned: int = 0
    """Episodes cancelled (shutdown) and nak'ed for redelivery."""
    events: int = 0
    """Events published by finished episodes."""
    engine_outages: int = 0
    """Deliveries nak'ed because the engine could not be reached (never counted as attempts)."""


class PublisherSink:
    """``EventSink`` that publishes through the bus ``Publisher`` (queued; acks awaited by
    ``flush``)."""

    def __init__(
        self, publisher: Publisher, metrics: ActorMetrics | None = None, probe: Probe | None = None
    ) -> None:
        self.publisher = publisher
        self.metrics = metrics
        self.probe = probe

    async def emit(self, event: EpisodeEvent) -> None:
        """Queue ``event`` for publishing on its subject (and count it when the sink has
        metrics)."""
        await self.publisher.publish_event(event)
        if self.metrics is not None:
            self.metrics.observe_event(event)
        if self.probe is not None:
            self.probe.progress()


class EpisodeRunner:
    """Serves deliveries of task assignments (see the module docstring)."""

    def __init__(
        self,
        *,
        js: JetStreamContext,
        engine: Engine,
        tokenizer: ChatTokenizer,
        config: ActorServiceConfig,
        pool: EnvPool,
        run_id: str,
        actor_id: str,
        stats: ActorStats,
        metrics: ActorMetrics | None = None,
        probe: Probe | None = None,
    ) -> None:
        self.js = js
        self.probe = probe
        self.metrics = metrics or ActorMetrics()
        self.engine: Engine = TimedEngine(engine, self.metrics.engine_latency)
        self.tokenizer = tokenizer
        self.config = config
        self.pool = pool
        self.run_id = run_id
        self.actor_id = actor_id
        self.stats = stats
        self.engine_down = False
        """Set when an episode met an unreachable engine: the fetch loop checks readiness before
        fetching."""
        self._outages: dict[str, int] = {}
        """Deliveries per task key that ended on an unreachable engine (not counted as attempts)."""

    async def serve(self, delivery: Delivery[TaskAssignment]) -> None:
        """Run the delivered task's episode and ack, nak or terminate the delivery."""
        task, attempt = delivery.value, delivery.num_delivered
        # <task_key>.a<attempt>@<actor>: only this actor's events are admitted into it
        episode_id = episode_id_for(task.task_key, attempt, self.actor_id)
        structlog.contextvars.bind_contextvars(
            run_id=self.run_id,
            actor_id=self.actor_id,
            episode_id=episode_id,
            task_key=task.task_key,
        )
        log.info(
            "actor.episode.started",
            attempt=attempt,
            env=task.env,
            task_id=task.task_id,
            mode=task.mode,
        )
        keepalive = asyncio.create_task(self._keepalive(delivery))
        started = time.monotonic()
        outcome = "error"
        self.metrics.in_flight.inc()
        try:
            if task.run_id != self.run_id:
                raise ValueError(
                    f"task {task.task_key!r} belongs to run {task.run_id!r}, not {self.run_id!r}"
                )
            summary = await self._episode(task, attempt, episode_id)
            await delivery.ack()
            outcome = "success" if summary.success else "failure" if not summary.error else "error"
        except asyncio.CancelledError:
            outcome = "abandoned"
            self.stats.abandoned += 1
            log.warning("actor.episode.abandoned", attempt=attempt)
            try:
                await asyncio.shield(delivery.nak())
            except Exception as e:  # connection gone: JetStream redelivers after ack_wait instead
                log.warning("actor.task.nak_failed", error=f"{type(e).__name__}: {e}")
            raise
        except (
            Exception
        ) as e:  # per-task failure: logged with context, counted, retried or terminated
            await self._failed(delivery, attempt, e)
            return
        finally:
            keepalive.cancel()
            self.metrics.in_flight.dec()
            self.metrics.episode_ended(task.mode, outcome)
        self.stats.done += 1
        self.stats.succeeded += summary.success
        self.stats.events += summary.events
        elapsed = round(time.monotonic() - started, 3)
        log.info("actor.task.acked", attempt=attempt, elapsed_s=elapsed, success=summary.success)

    async def _failed(self, delivery: Delivery[TaskAssignment], attempt: int, e: Exception) -> None:
        error = f"{type(e).__name__}: {e}"
        if isinstance(e, EngineUnavailable):
            await self._engine_unavailable(delivery, attempt, error)
            return
        attempt -= self._outages.get(delivery.value.task_key, 0)
        # Not transient: a sandbox without its isolation refuses on every attempt on this machine,
        # an event over the size limit would be too large again, and so would (mostly) an episode
        # whose prompt outgrew the engines' context.
        if attempt >= self.config.max_attempts or isinstance(
            e, SandboxUnavailable | MessageTooLargeError | PromptTooLong
        ):
            self.stats.failed += 1
            log.error("actor.task.failed", attempt=attempt, error=error, exc_info=e)
            await delivery.term()
        else:
            self.stats.retried += 1
            log.warning(
                "actor.task.retry", attempt=attempt, error=error, delay_s=self.config.retry_delay_s
            )
            await delivery.nak(self.config.retry_delay_s)

    async def _engine_unavailable(
        self, delivery: Delivery[TaskAssignment], attempt: int, error: str
    ) -> None:
        """The engine could not be reached: the episode never got its answer, so the task is not to
        blame. Nak it (redelivered after ``retry_delay_s``), never terminate it, and remember the
        outage so this actor does not count that delivery among the task's ``max_attempts``; the
        fetch loop meanwhile waits for a ready engine before taking any task
        (``ActorService._engine_ready``)."""
        self.engine_down = True
        self.stats.engine_outages += 1
        key = delivery.value.task_key
        self._outages[key] = self._outages.get(key, 0) + 1
        while len(self._outages) > _OUTAGES_KEPT:
            del self._outages[next(iter(self._outages))]
        log.warning(
            "actor.task.engine_unavailable",
            attempt=attempt,
            error=error,
            delay_s=self.config.retry_delay_s,
        )
        await delivery.nak(self.config.retry_delay_s)

    async def _keepalive(self, delivery: Delivery[TaskAssignment]) -> None:
        while True:
            await asyncio.sleep(self.config.in_progress_interval_s)
            try:
                await delivery.in_progress()
            except Exception as e:  # a lost keepalive only risks a redelivery; the episode goes on
                log.warning("actor.task.keepalive_failed", error=f"{type(e).__name__}: {e}")

    def _spec(
        self, task: TaskAssignment, attempt: int, episode_id: str, digest: str
    ) -> EpisodeSpec:
        return EpisodeSpec(
            run_id=self.run_id,
            episode_id=episode_id,
            actor_id=self.actor_id,
            task_key=task.task_key,
            env=task.env,
            task_id=task.task_id,
            split=task.split,
            seed=task.seed,
            mode=task.mode,
            attempt=attempt,
            group_id=task.group_id,
            group_size=task.group_size,
            config_digest=digest,
        )

    async def _episode(self, task: TaskAssignment, attempt: int, episode_id: str) -> EpisodeSummary:
        explore, demo = task.mode == "explore", task.mode == "demo"
        rollout_cfg = self.config.rollout_config(task.env)
        explorer_cfg = self.config.explorer_config(task.env)
        demo_cfg = self.config.demo_config(task.env)
        in_thread = explorer_cfg.env_in_thread if explore else rollout_cfg.env_in_thread
        digest = config_digest(
            explorer_cfg if explore else [rollout_cfg, demo_cfg] if demo else rollout_cfg
        )
        spec = self._spec(task, attempt, episode_id, digest)
        env = await self.pool.acquire(task.env, task.env_options, in_thread=in_thread)
        reusable = False
        try:
            async with Publisher(self.js) as publisher:
                sink = PublisherSink(publisher, self.metrics, self.probe)
                if explore:
                    explorer = Explorer(
                        engine=self.engine,
                        tokenizer=self.tokenizer,
                        env=env,
                        config=explorer_cfg,
                        sink=sink,
                        spec=spec,
                    )
                    summary = await explorer.run()
                elif (
                    demo
                ):  # the expert's demonstration (+ Early Experience alternatives when configured)
                    engine = self.engine if demo_cfg.uses_engine else None
                    runner = DemoRunner(
                        tokenizer=self.tokenizer,
                        env=env,
                        spec=spec,
                        rollout=rollout_cfg,
                        demo=demo_cfg,
                        sink=sink,
                        engine=engine,
                    )
                    summary = await runner.run()
                else:
                    summary = await run_rollout(
                        engine=self.engine,
                        tokenizer=self.tokenizer,
                        env=env,
                        spec=spec,
                        config=rollout_cfg,
                        sink=sink,
                    )
                await publisher.flush()
            reusable = not summary.error
            return summary
        finally:
            self.pool.release(env, task.env, task.env_options, reusable=reusable)
