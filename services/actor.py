"""``leafe actor``: pull task assignments, run LEAFE exploration trees or plain rollouts, publish events.

```
 LEAFE_TASKS ──fetch (durable "actors", shared)──► up to C episodes ──events──► Publisher ──► LEAFE_EVENTS
      ▲   in_progress every N s while an episode runs       │ flush (every event acked by JetStream)
      └────────── ack ◄──────────────────────────────────────┘ then ack the task
 LEAFE_WEIGHTS ──(core subscription)──► latest announced version (logs; events carry the engine's own)
```

One durable pull consumer name per run is shared by every actor, so JetStream spreads the work queue.
A task is acked only after its ``EpisodeFinished`` is acknowledged by JetStream; an actor that dies
mid-episode leaves the task unacked, JetStream redelivers it after ``ack_wait_s`` and the next attempt
is a new episode (``episode_id_for(task_key, attempt)``), while the partial one, lacking
``EpisodeFinished``, is recognisable as abandoned. Engine or actor errors nak the task for a delayed
retry, and after ``max_attempts`` deliveries terminate it. SIGTERM: stop fetching, let running episodes
finish for ``drain_timeout_s``, nak the rest (abandoned, redelivered at once to another actor).

Run: ``leafe actor --nats nats://127.0.0.1:4222 --run r1 --engine http://127.0.0.1:30000 --model tiny``.
In-process (``leafe run``): ``await run_actor(nats_url=..., run_id=..., engine=..., tokenizer=...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from actors.config import ActorServiceConfig
from actors.engine import Engine
from actors.env_pool import EnvFactory, EnvPool
from protocol.prompt import ChatTokenizer
from services.actor_episode import ActorStats, EpisodeRunner

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from protocol.tasks import TaskAssignment
    from services.bus import Consumer, Delivery

__all__ = ["ActorService", "ActorStats", "main", "run_actor"]

log = structlog.get_logger(__name__)


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
    ) -> None:
        from protocol.subjects import validate_run_id

        self.nc = nc
        self.js = nc.jetstream()
        self.run_id = validate_run_id(run_id)
        self.config = config
        self.actor_id = actor_id
        self.max_tasks = max_tasks
        self.pool = EnvPool(env_factory or _default_env_factory(), max_idle=config.env_pool_size)
        self.stats = ActorStats()
        self.runner = EpisodeRunner(
            js=self.js, engine=engine, tokenizer=tokenizer, config=config, pool=self.pool,
            run_id=self.run_id, actor_id=actor_id, stats=self.stats,
        )  # fmt: skip
        self.durable = f"{config.durable}-{self.run_id}"
        """Consumer name: unique per run, because every run's tasks share the LEAFE_TASKS stream."""
        self.latest_weights: str | None = None
        """Latest ``WeightsPublished.version`` seen (informational: events carry the engine's version)."""
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event | None = None) -> ActorStats:
        """Serve tasks until ``stop`` is set (or ``max_tasks`` were taken), then drain; returns stats."""
        from services.bus import ensure_streams

        stop = stop or asyncio.Event()
        await ensure_streams(self.js)
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
        from protocol.codec import decode_task
        from protocol.subjects import TASKS, dead_letter_subject, task_subject
        from services.bus import Consumer

        return Consumer(
            self.js, stream=TASKS.name, durable=self.durable, filter_subject=task_subject(self.run_id),
            decode=decode_task, dead_letter_subject=dead_letter_subject(self.run_id, TASKS.name), batch=1,
            ack_wait_s=self.config.ack_wait_s, max_ack_pending=max(4096, self.config.concurrency),
        )  # fmt: skip

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
        from nats.js.errors import NotFoundError

        from protocol.codec import CODEC_HEADER, ProtocolError, decode_weights
        from protocol.subjects import WEIGHTS, weights_subject

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


def _default_env_factory() -> EnvFactory:
    from envs.registry import make_env

    return make_env


async def run_actor(
    *,
    nats_url: str,
    run_id: str,
    tokenizer: ChatTokenizer,
    engine: Engine | None = None,
    engine_urls: list[str] | None = None,
    config: ActorServiceConfig | None = None,
    actor_id: str | None = None,
    stop: asyncio.Event | None = None,
    max_tasks: int | None = None,
    creds: str | None = None,
    env_factory: EnvFactory | None = None,
) -> ActorStats:
    """Connect, serve tasks until ``stop`` (or ``max_tasks``), drain, disconnect. Give ``engine`` or URLs."""
    from services.bus import connect

    if engine is None and not engine_urls:
        raise ValueError("run_actor needs an engine or at least one engine URL")
    actor_id = actor_id or default_actor_id()
    async with AsyncExitStack() as stack:
        nc = await connect(nats_url, creds=creds, name=f"leafe-actor-{actor_id}")
        stack.push_async_callback(nc.close)
        used: Engine = (
            engine if engine is not None else await stack.enter_async_context(_client(engine_urls or []))
        )
        service = ActorService(
            nc=nc, run_id=run_id, engine=used, tokenizer=tokenizer, config=config or ActorServiceConfig(),
            actor_id=actor_id, env_factory=env_factory, max_tasks=max_tasks,
        )  # fmt: skip
        stats = await service.run(stop)
        await nc.flush()  # the last acks leave before the connection closes
        return stats


def _client(urls: list[str]) -> Any:
    from actors.client import SGLangClient

    return SGLangClient(urls)


def default_actor_id() -> str:
    """``<host>-<pid>``."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe actor", description=__doc__.split("\n")[0])
    p.add_argument("--nats", default=os.environ.get("LEAFE_NATS_URL"), help="NATS URL (env LEAFE_NATS_URL)")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--engine", required=True, help="inference server URL(s), comma-separated")
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model dir, 'tiny' or the default (tokenizer)"
    )
    p.add_argument("--config", default=None, help="ActorServiceConfig TOML file")
    p.add_argument("--concurrency", type=int, default=None, help="episodes at once (overrides the config)")
    p.add_argument("--actor-id", default=None, help="actor id in events (default host-pid)")
    p.add_argument("--max-tasks", type=int, default=None, help="exit after this many tasks")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``leafe actor``."""
    args = _parser().parse_args(argv)
    from learner.model_io import HFChatTokenizer, resolve_model
    from services.config import dump_config, load_config
    from services.logsetup import configure_logging

    configure_logging(json=True, level=args.log_level)
    if not args.nats:
        raise SystemExit("leafe actor: give --nats or set LEAFE_NATS_URL")
    config = load_config(args.config, ActorServiceConfig)
    if args.concurrency is not None:
        config = msgspec.structs.replace(config, concurrency=args.concurrency)
    log.info("actor.config", config=dump_config(config), model=args.model)
    tokenizer = HFChatTokenizer.from_dir(resolve_model(args.model))
    urls = [u.strip() for u in args.engine.split(",") if u.strip()]

    async def serve() -> ActorStats:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_actor(
            nats_url=args.nats, run_id=args.run, tokenizer=tokenizer, engine_urls=urls, config=config,
            actor_id=args.actor_id, stop=stop, max_tasks=args.max_tasks,
            creds=os.environ.get("LEAFE_NATS_CREDS") or None,
        )  # fmt: skip

    stats = asyncio.run(serve())
    return 0 if stats.failed == 0 else 1
