"""Actors against an engine that is not ready (a real nats-server, a real HTTP client): a cold start
(SGLang loading its model) or an outage mid-run must not burn a task's delivery attempts.

The engine is a small aiohttp server speaking SGLang's wire format (``/ready``, ``/generate``,
``/model_info``) that answers 503 until it is "loaded" and can be taken down for a while mid-run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from leafe.actors.client import SGLangClient, SGLangClientConfig
from leafe.actors.config import ActorServiceConfig
from leafe.actors.fakes import ByteChatTokenizer
from leafe.protocol.events import EpisodeFinished
from leafe.services.actor.service import ActorService
from leafe.services.bus import connect, ensure_streams
from tests.integration.test_actor_service import corridor_factory, corridor_tasks
from tests.support.actor_service import read_events, submit, tasks_left, until

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@dataclass
class LateEngine:
    """503 on every route until ``load_after_s`` has passed; ``outage_on`` = the n-th /generate
    (1-based) starts an outage of ``outage_s`` (503 everywhere, ``/ready`` included)."""

    load_after_s: float
    outage_on: int = 0
    outage_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    down_until: float = 0.0
    generates: int = 0
    refused: int = 0
    url: str = ""

    def up(self) -> bool:
        now = time.monotonic()
        return now - self.started >= self.load_after_s and now >= self.down_until

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.up() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        if not self.up():
            return web.json_response({"detail": "loading"}, status=503)
        return web.json_response({"model_path": "stub", "weight_version": "default"})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.up():
            self.refused += 1
            return web.json_response({"detail": "loading"}, status=503)
        self.generates += 1
        if self.generates == self.outage_on:
            self.down_until = time.monotonic() + self.outage_s
            return web.json_response({"detail": "reloading"}, status=503)
        ids = list(b"right")
        meta = {
            "id": f"r{self.generates}",
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": "default",
        }
        return web.json_response({"text": "right", "output_ids": ids, "meta_info": meta})


@asynccontextmanager
async def serve(engine: LateEngine) -> AsyncIterator[LateEngine]:
    app = web.Application()
    app.router.add_get("/ready", engine.ready)
    app.router.add_get("/model_info", engine.model_info)
    app.router.add_post("/generate", engine.generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield engine
    finally:
        await runner.cleanup()


def fast_config(max_attempts: int) -> ActorServiceConfig:
    engine = SGLangClientConfig(
        backoff_s=0.01, max_backoff_s=0.02, cooldown_s=0.05, ready_poll_s=0.1
    )
    return ActorServiceConfig(
        concurrency=2, max_attempts=max_attempts, retry_delay_s=0.2, engine=engine
    )


async def run_against(
    nats_url: str, run_id: str, stub: LateEngine, n: int, max_attempts: int
) -> tuple:
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    tasks = corridor_tasks(run_id, n, "rollout")
    await submit(
        js, run_id, tasks
    )  # the documented order's hazard: tasks before the engine is ready
    config = fast_config(max_attempts)
    async with SGLangClient.from_config([stub.url], config.engine) as client:
        service = ActorService(
            nc=nc,
            run_id=run_id,
            engine=client,
            tokenizer=ByteChatTokenizer(),
            config=config,
            actor_id="a",
            env_factory=corridor_factory,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(service.run(stop))
        try:
            await until(
                lambda: service.stats.done + service.stats.failed >= n, f"{n} tasks settled"
            )
        finally:
            stop.set()
        stats = await asyncio.wait_for(runner, 30)
    episodes = await read_events(js, run_id)
    left = await tasks_left(js, run_id)
    await nc.close()
    return stats, episodes, left


async def test_a_cold_start_burns_no_delivery(nats_url: str, run_id: str) -> None:
    """Tasks submitted while the engine loads (3 s of 503s) wait for it: none is terminated or even
    retried, every one completes on its first delivery, and no /generate reached the loading
    engine."""
    async with serve(LateEngine(load_after_s=3.0)) as stub:
        stats, episodes, left = await run_against(nats_url, run_id, stub, n=4, max_attempts=2)
    assert (stats.done, stats.failed, stats.retried, stats.engine_outages) == (4, 0, 0, 0)
    assert stub.refused == 0
    assert all(key.rpartition("@")[0].endswith(".a1") for key in episodes), sorted(episodes)
    assert all(isinstance(events[-1], EpisodeFinished) for events in episodes.values())
    assert left == 0


async def test_an_outage_mid_run_is_not_counted_against_the_task(
    nats_url: str, run_id: str
) -> None:
    """The engine goes away mid-episode (a reload, a restart) with ``max_attempts = 1``: the task it
    hit is nak'ed, not terminated, and completes on a later delivery once the engine is back."""
    async with serve(LateEngine(load_after_s=0.0, outage_on=2, outage_s=1.5)) as stub:
        stats, episodes, left = await run_against(nats_url, run_id, stub, n=3, max_attempts=1)
    assert stats.failed == 0 and stats.done == 3
    assert stats.engine_outages >= 1
    finished = [k for k, events in episodes.items() if isinstance(events[-1], EpisodeFinished)]
    assert len(finished) == 3
    assert left == 0
