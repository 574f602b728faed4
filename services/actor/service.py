"""The actor service: pull task assignments, run episodes, publish their events, ack the tasks.

```
 LEAFE_TASKS ──fetch (durable actors-<run>, shared)──► up to C episodes ──events──► Publisher ──►
      ▲   in_progress every N s while an episode runs       │                        LEAFE_EVENTS
      │                                                     │ flush (every event acked by JetStream)
      └────────── ack ◄─────────────────────────────────────┘ then ack the task
 LEAFE_WEIGHTS ──(last message, re-read at most every 10 s)──► latest announced version
                        (the staleness gate, actors/staleness.py; events carry the engine's own)
```

:class:`ActorService` owns fetching, concurrency and shutdown; :class:`EpisodeRunner`
(``services/actor/episode.py``) serves one delivery: open a Publisher, run the explorer (``mode =
explore``), one plain rollout (``rollout``/``eval``) or the expert's demonstration (``demo``,
``actors/demo.py``) on a pooled env, flush (every event acked by JetStream), then ack the task,
extending its AckWait with in-progress acks meanwhile. One durable consumer name per run is shared
by every actor, so JetStream spreads the work queue. An actor that dies mid-episode leaves the task
unacked; JetStream redelivers it after ``ack_wait_s`` and the next attempt is a new episode
(``episode_id_for(task_key, attempt, actor_id)``: ``<task_key>.a<attempt>@<actor>``, which admits
no other actor's events), while the partial one, lacking ``EpisodeFinished``, is recognisable as
abandoned. Cancellation (drain, shutdown) naks at once; any other error naks with a
delay, and terminates the task on its ``max_attempts``-th delivery.
"""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import structlog
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from leafe.actors.config import ActorServiceConfig
from leafe.actors.engine import Engine
from leafe.actors.env_pool import EnvFactory, EnvPool
from leafe.actors.staleness import StalenessGate
from leafe.envs.registry import make_env
from leafe.learner.weight_store import version_index
from leafe.protocol.codec import CODEC_HEADER, ProtocolError, decode_task, decode_weights
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    TASKS,
    WEIGHTS,
    actors_durable,
    dead_letter_subject,
    task_subject,
    validate_actor_id,
    validate_run_id,
    weights_subject,
)
from leafe.protocol.tasks import TaskAssignment
from leafe.services.actor.episode import ActorStats, EpisodeRunner, PublisherSink
from leafe.services.bus import Consumer, Delivery, wait_for_streams
from leafe.services.metrics import ActorMetrics
from leafe.services.probes import Probe, attach

__all__ = ["ActorService", "ActorStats", "EpisodeRunner", "PublisherSink"]

log = structlog.get_logger(__name__)
STREAMS_USED = (TASKS.name, EVENTS.name, WEIGHTS.name, DEAD_LETTERS.name)
"""The streams the actor waits for on start (made by `leafe streams ensure`; it may not create
them)."""
_WEIGHTS_POLL_S = 10.0
"""How often the latest weights announcement is read (it is informational: events carry the
engine's)."""


class ActorService:
    """Pulls tasks and runs up to ``config.concurrency`` episodes at once (see the module
    docstring)."""

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
        self.actor_id = validate_actor_id(actor_id)
        self.max_tasks = max_tasks
        self.streams_timeout_s = streams_timeout_s
        self.pool = EnvPool(env_factory or make_env, max_idle=config.env_pool_size)
        self.stats = ActorStats()
        self.metrics = metrics or ActorMetrics()
        """Prometheus metrics (``services/metrics.py``); served by ``leafe actor
        --metrics-port``."""
        self.probe = Probe("actor", stale_after_s=max(120.0, 3 * config.engine.timeout_s))
        """``/healthz`` (``services/probes.py``): progress is a fetch, an engine poll or a published
        event; three request timeouts without any means every episode in flight is stuck."""
        attach(self.metrics.registry, self.probe)
        self.probe.connected(nc)
        self.runner = EpisodeRunner(
            js=self.js,
            engine=engine,
            tokenizer=tokenizer,
            config=config,
            pool=self.pool,
            run_id=self.run_id,
            actor_id=self.actor_id,
            stats=self.stats,
            metrics=self.metrics,
            probe=self.probe,
        )
        self.durable = actors_durable(self.run_id, config.durable)
        """Consumer name: unique per run, because every run's tasks share the LEAFE_TASKS stream."""
        self.latest_weights: str | None = None
        """Latest ``WeightsPublished.version`` seen: the learner's version the staleness gate counts
        (events carry the engine's own version)."""
        self._running: set[asyncio.Task[None]] = set()
        self.engine = engine
        self.engine_waiting = False
        """True while the fetch loop holds back because the engine is not ready."""
        self._ready_checked = -math.inf
        self._weights_checked = -math.inf
        self.gate = StalenessGate(config.staleness)
        """The staleness gate (``actors/staleness.py``): no new training episode while this
        actor's samples would lag the learner past its ``max_policy_lag``."""

    async def run(self, stop: asyncio.Event | None = None) -> ActorStats:
        """Serve tasks until ``stop`` is set (or ``max_tasks`` were taken), then drain; returns
        stats."""
        stop = stop or asyncio.Event()
        await wait_for_streams(self.js, STREAMS_USED, timeout_s=self.streams_timeout_s)
        consumer = self._consumer()
        await consumer.start()
        self.probe.bound(self.durable)
        await self._refresh_weights()
        log.info(
            "actor.started",
            run_id=self.run_id,
            actor_id=self.actor_id,
            concurrency=self.config.concurrency,
        )
        try:
            await self._fetch_loop(consumer, stop)
            await self._finish_running(stop)
            await self._drain()
        finally:
            self.probe.unbound()
            if self._running:  # cancelled from outside: abandon what is left
                await self._abandon_running()
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
            # the actor's own subject: its NATS user may write task dead letters only under its id
            dead_letter_subject=f"{dead_letter_subject(self.run_id, TASKS.name)}.{self.actor_id}",
            batch=1,
            ack_wait_s=self.config.ack_wait_s,
            max_ack_pending=max(4096, self.config.concurrency),
        )

    async def _fetch_loop(self, consumer: Consumer[TaskAssignment], stop: asyncio.Event) -> None:
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set() and (
                self.max_tasks is None or self.stats.taken < self.max_tasks
            ):
                if len(self._running) >= self.config.concurrency:
                    await asyncio.wait(
                        {*self._running, stopping}, return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                if not await self._engine_ready(stop):
                    break
                await self._refresh_weights()
                if not await self._gate_open(stop):
                    break
                deliveries = await consumer.fetch(self.config.fetch_timeout_s)
                self.probe.progress()
                for delivery in deliveries:
                    if stop.is_set():
                        await delivery.nak()
                        continue
                    self._spawn(delivery)
        finally:
            stopping.cancel()

    async def _engine_ready(self, stop: asyncio.Event) -> bool:
        """Take no task while the engine cannot generate (SGLang loading its model for up to 30
        minutes, a router without a healthy worker, an episode that just met an unreachable engine):
        poll the engine's ``ready()`` every ``engine.ready_poll_s`` until it answers, so a cold
        start burns no delivery. Engines without ``ready()`` (in-process fakes) are always ready.
        False when ``stop`` came first."""
        ready = getattr(self.engine, "ready", None)
        if ready is None:
            return True
        now = time.monotonic()
        if (
            not self.runner.engine_down
            and now - self._ready_checked < self.config.engine.ready_poll_s
        ):
            return True
        waited = False
        while not await ready():
            if not waited:
                log.warning("actor.engine.waiting", poll_s=self.config.engine.ready_poll_s)
                waited = True
            self.engine_waiting = True
            self.probe.progress()  # waiting for a loading engine is this loop's work, not a hang
            try:
                async with asyncio.timeout(self.config.engine.ready_poll_s):
                    await stop.wait()
                return False
            except TimeoutError:
                pass
        if waited:
            log.info("actor.engine.ready", waited_s=round(time.monotonic() - now, 1))
        self.engine_waiting = self.runner.engine_down = False
        self._ready_checked = time.monotonic()
        return True

    @property
    def learner_version(self) -> int:
        """The index of the learner's latest push (0 before any)."""
        return (version_index(self.latest_weights) or 0) if self.latest_weights else 0

    async def _gate_open(self, stop: asyncio.Event) -> bool:
        """Hold new tasks back while the staleness gate is closed: re-read the learner's latest
        push every second until the gate opens (or, after ``max_wait_s`` without a push, lend one
        version's credit). False when ``stop`` came first."""
        if self.gate.may_start(self.learner_version):
            return True
        cfg = self.config.staleness
        version, since, t0 = self.learner_version, time.monotonic(), time.monotonic()
        log.info(
            "actor.gate.closed",
            version=version,
            started=self.gate.started,
            running=len(self._running),
        )
        try:
            while not self.gate.may_start(self.learner_version):
                self.probe.progress()  # waiting for the learner is this loop's work, not a hang
                try:
                    async with asyncio.timeout(1.0):
                        await stop.wait()
                    return False
                except TimeoutError:
                    pass
                self._weights_checked = -math.inf
                await self._refresh_weights()
                if self.learner_version != version:
                    version, since = self.learner_version, time.monotonic()
                elif time.monotonic() - since >= cfg.max_wait_s:
                    self.gate.lend()
                    self.metrics.gate_lent.inc()
                    since = time.monotonic()
                    log.warning("actor.gate.lent", version=version, waited_s=cfg.max_wait_s, lent=1)
        finally:
            self.metrics.gate_wait.inc(time.monotonic() - t0)
        log.info("actor.gate.open", version=version, waited_s=round(time.monotonic() - t0, 1))
        return True

    def _spawn(self, delivery: Delivery[TaskAssignment]) -> None:
        self.stats.taken += 1
        self.gate.on_start(delivery.value.mode, self.learner_version)
        task = asyncio.create_task(
            self.runner.serve(delivery), name=f"episode:{delivery.value.task_key}"
        )
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
        log.info(
            "actor.draining", running=len(self._running), timeout_s=self.config.drain_timeout_s
        )
        await asyncio.wait(set(self._running), timeout=self.config.drain_timeout_s)
        await self._abandon_running()

    async def _abandon_running(self) -> None:
        tasks = set(self._running)
        for task in tasks:
            task.cancel()
        if tasks:
            log.warning("actor.abandoning", episodes=len(tasks))
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _refresh_weights(self) -> None:
        """The run's latest ``WeightsPublished``, read at most every ``_WEIGHTS_POLL_S``. Read, not
        subscribed: a subscriber receives the learner's publish with its reply inbox, and an actor
        may answer what it receives (its NATS user acks tasks through ``allow_responses``), so it
        subscribes to nothing."""
        now = time.monotonic()
        if now - self._weights_checked < _WEIGHTS_POLL_S:
            return
        self._weights_checked = now
        try:
            last = await self.js.get_last_msg(WEIGHTS.name, weights_subject(self.run_id))
        except NotFoundError:
            return  # no weights announced yet: the base model is being served
        try:
            w = decode_weights(last.data or b"", (last.headers or {}).get(CODEC_HEADER))
        except ProtocolError as e:
            log.warning("actor.weights.undecodable", error=str(e))
            return
        if w.version != self.latest_weights:
            self.latest_weights = w.version
            log.info("actor.weights.published", version=w.version, learner_step=w.learner_step)
