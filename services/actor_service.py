"""The actor service: pull task assignments, run episodes, publish their events, ack the tasks.

```
 LEAFE_TASKS ──fetch (durable actors-<run>, shared)──► up to C episodes ──events──► Publisher ──► LEAFE_EVENTS
      ▲   in_progress every N s while an episode runs       │ flush (every event acked by JetStream)
      └────────── ack ◄──────────────────────────────────────┘ then ack the task
 LEAFE_WEIGHTS ──(core subscription)──► latest announced version (logs; events carry the engine's own)
```

:class:`ActorService` owns fetching, concurrency and shutdown; :class:`EpisodeRunner` serves one
delivery: open a Publisher, run the explorer (``mode = explore``), one plain rollout
(``rollout``/``eval``) or the expert's demonstration (``demo``, ``actors/demo.py``) on a pooled env,
flush (every event acked by JetStream), then ack the task, extending its AckWait with in-progress acks
meanwhile. One durable consumer name per run is shared by every actor, so JetStream spreads the work
queue. An actor that dies mid-episode leaves the task unacked; JetStream redelivers it after
``ack_wait_s`` and the next attempt is a new episode (``episode_id_for(task_key, attempt)``), while the
partial one, lacking ``EpisodeFinished``, is recognisable as abandoned. Cancellation (drain, shutdown)
naks at once; any other error naks with a delay, and terminates the task on its ``max_attempts``-th
delivery.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from actors.config import ActorServiceConfig
from actors.demo import DemoRunner
from actors.engine import Engine
from actors.env_pool import EnvFactory, EnvPool
from actors.episode import EpisodeSpec, EpisodeSummary
from actors.explorer import Explorer
from actors.rollout import run_rollout
from envs.registry import make_env
from envs.sandbox import SandboxUnavailable
from protocol.codec import CODEC_HEADER, ProtocolError, decode_task, decode_weights
from protocol.config import config_digest
from protocol.events import EpisodeEvent
from protocol.prompt import ChatTokenizer
from protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    TASKS,
    WEIGHTS,
    actors_durable,
    dead_letter_subject,
    task_subject,
    validate_run_id,
    weights_subject,
)
from protocol.tasks import TaskAssignment, episode_id_for
from services.bus import Consumer, Delivery, MessageTooLargeError, Publisher, wait_for_streams
from services.metrics import ActorMetrics, TimedEngine

__all__ = ["ActorService", "ActorStats", "EpisodeRunner", "PublisherSink"]

log = structlog.get_logger(__name__)
STREAMS_USED = (TASKS.name, EVENTS.name, WEIGHTS.name, DEAD_LETTERS.name)
"""The streams the actor waits for on start (made by `leafe streams ensure`; it may not create them)."""


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


class PublisherSink:
    """``EventSink`` that publishes through the bus ``Publisher`` (queued; acks awaited by ``flush``)."""

    def __init__(self, publisher: Publisher, metrics: ActorMetrics | None = None) -> None:
        self.publisher = publisher
        self.metrics = metrics

    async def emit(self, event: EpisodeEvent) -> None:
        """Queue ``event`` for publishing on its subject (and count it when the sink has metrics)."""
        await self.publisher.publish_event(event)
        if self.metrics is not None:
            self.metrics.observe_event(event)


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
    ) -> None:
        self.js = js
        self.metrics = metrics or ActorMetrics()
        self.engine: Engine = TimedEngine(engine, self.metrics.engine_latency)
        self.tokenizer = tokenizer
        self.config = config
        self.pool = pool
        self.run_id = run_id
        self.actor_id = actor_id
        self.stats = stats

    async def serve(self, delivery: Delivery[TaskAssignment]) -> None:
        """Run the delivered task's episode and ack, nak or terminate the delivery."""
        task, attempt = delivery.value, delivery.num_delivered
        episode_id = episode_id_for(task.task_key, attempt)
        structlog.contextvars.bind_contextvars(
            run_id=self.run_id, actor_id=self.actor_id, episode_id=episode_id, task_key=task.task_key
        )
        log.info("actor.episode.started", attempt=attempt, env=task.env, task_id=task.task_id, mode=task.mode)
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
        except Exception as e:  # per-task failure: logged with context, counted, retried or terminated
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
        # Not transient: a sandbox without its isolation refuses on every attempt on this machine, and an
        # event over the size limit would be too large again.
        if attempt >= self.config.max_attempts or isinstance(e, SandboxUnavailable | MessageTooLargeError):
            self.stats.failed += 1
            log.error("actor.task.failed", attempt=attempt, error=error, exc_info=e)
            await delivery.term()
        else:
            self.stats.retried += 1
            log.warning("actor.task.retry", attempt=attempt, error=error, delay_s=self.config.retry_delay_s)
            await delivery.nak(self.config.retry_delay_s)

    async def _keepalive(self, delivery: Delivery[TaskAssignment]) -> None:
        while True:
            await asyncio.sleep(self.config.in_progress_interval_s)
            try:
                await delivery.in_progress()
            except Exception as e:  # a lost keepalive only risks a redelivery; the episode goes on
                log.warning("actor.task.keepalive_failed", error=f"{type(e).__name__}: {e}")

    def _spec(self, task: TaskAssignment, attempt: int, episode_id: str, digest: str) -> EpisodeSpec:
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
        digest = config_digest(explorer_cfg if explore else [rollout_cfg, demo_cfg] if demo else rollout_cfg)
        spec = self._spec(task, attempt, episode_id, digest)
        env = await self.pool.acquire(task.env, task.env_options, in_thread=in_thread)
        reusable = False
        try:
            async with Publisher(self.js) as publisher:
                sink = PublisherSink(publisher, self.metrics)
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
                elif demo:  # the expert's demonstration (+ Early Experience alternatives when configured)
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


class ActorService:
    """Pulls tasks and runs up to ``config.concurrency`` episodes at once (see the module docstring)."""

    def __init__(
        self,
        *,
        nc: Client,
        run_id: str,
        engine: Engine,
        tokenizer: ChatTokenizer,
        config: ActorServiceConfig,
        actor_id: str,
        env_factory: EnvFactory | None = None,
        max_tasks: int | None = None,
        streams_timeout_s: float = 120.0,
        metrics: ActorMetrics | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.run_id = validate_run_id(run_id)
        self.config = config
        self.actor_id = actor_id
        self.max_tasks = max_tasks
        self.streams_timeout_s = streams_timeout_s
        self.pool = EnvPool(env_factory or make_env, max_idle=config.env_pool_size)
        self.stats = ActorStats()
        self.metrics = metrics or ActorMetrics()
        """Prometheus metrics (``services/metrics.py``); served by ``leafe actor --metrics-port``."""
        self.runner = EpisodeRunner(
            js=self.js,
            engine=engine,
            tokenizer=tokenizer,
            config=config,
            pool=self.pool,
            run_id=self.run_id,
            actor_id=actor_id,
            stats=self.stats,
            metrics=self.metrics,
        )
        self.durable = actors_durable(self.run_id, config.durable)
        """Consumer name: unique per run, because every run's tasks share the LEAFE_TASKS stream."""
        self.latest_weights: str | None = None
        """Latest ``WeightsPublished.version`` seen (informational: events carry the engine's version)."""
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event | None = None) -> ActorStats:
        """Serve tasks until ``stop`` is set (or ``max_tasks`` were taken), then drain; returns stats."""
        stop = stop or asyncio.Event()
        await wait_for_streams(self.js, STREAMS_USED, timeout_s=self.streams_timeout_s)
        consumer = self._consumer()
        await consumer.start()
        weights_sub = await self._follow_weights()
        log.info(
            "actor.started", run_id=self.run_id, actor_id=self.actor_id, concurrency=self.config.concurrency
        )
        try:
            await self._fetch_loop(consumer, stop)
            await self._finish_running(stop)
            await self._drain()
        finally:
            if self._running:  # cancelled from outside: abandon what is left
                await self._abandon_running()
            await weights_sub.unsubscribe()
            await consumer.close()
            self.pool.close()
        log.info("actor.stopped", **msgspec.structs.asdict(self.stats))
        return self.stats

    def _consumer(self) -> Consumer[TaskAssignment]:
        return Consumer(
            self.js,
            stream=TASKS.name,
            durable=self.durable,
            filter_subject=task_subject(self.run_id),
            decode=decode_task,
            dead_letter_subject=dead_letter_subject(self.run_id, TASKS.name),
            batch=1,
            ack_wait_s=self.config.ack_wait_s,
            max_ack_pending=max(4096, self.config.concurrency),
        )

    async def _fetch_loop(self, consumer: Consumer[TaskAssignment], stop: asyncio.Event) -> None:
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set() and (self.max_tasks is None or self.stats.taken < self.max_tasks):
                if len(self._running) >= self.config.concurrency:
                    await asyncio.wait({*self._running, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                for delivery in await consumer.fetch(self.config.fetch_timeout_s):
                    if stop.is_set():
                        await delivery.nak()
                        continue
                    self._spawn(delivery)
        finally:
            stopping.cancel()

    def _spawn(self, delivery: Delivery[TaskAssignment]) -> None:
        self.stats.taken += 1
        task = asyncio.create_task(self.runner.serve(delivery), name=f"episode:{delivery.value.task_key}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _finish_running(self, stop: asyncio.Event) -> None:
        """After the task quota: let running episodes finish, unless a stop request comes first."""
        if not self._running or stop.is_set():
            return
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while self._running and not stop.is_set():
                await asyncio.wait({*self._running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()

    async def _drain(self) -> None:
        if not self._running:
            return
        log.info("actor.draining", running=len(self._running), timeout_s=self.config.drain_timeout_s)
        await asyncio.wait(set(self._running), timeout=self.config.drain_timeout_s)
        await self._abandon_running()

    async def _abandon_running(self) -> None:
        tasks = set(self._running)
        for task in tasks:
            task.cancel()
        if tasks:
            log.warning("actor.abandoning", episodes=len(tasks))
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow_weights(self) -> Any:
        subject = weights_subject(self.run_id)

        def note(data: bytes, headers: dict[str, str] | None) -> None:
            try:
                w = decode_weights(data, (headers or {}).get(CODEC_HEADER))
            except ProtocolError as e:
                log.warning("actor.weights.undecodable", error=str(e))
                return
            self.latest_weights = w.version
            log.info("actor.weights.published", version=w.version, learner_step=w.learner_step)

        try:
            last = await self.js.get_last_msg(WEIGHTS.name, subject)
            note(last.data or b"", last.headers)
        except NotFoundError:
            pass  # no weights announced yet: the base model is being served

        async def on_msg(msg: Msg) -> None:
            note(msg.data, msg.headers)

        return await self.nc.subscribe(subject, cb=on_msg)
