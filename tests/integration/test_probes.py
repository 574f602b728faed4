"""/healthz of a running actor against a real nats-server of its own: 200 while connected with its
consumer bound and its loop turning, 503 naming the reason once the server dies, 200 again after the
restarted server took the reconnection, and 503 once the service stopped."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.services.actor.service import ActorService
from leafe.services.bus import connect, ensure_streams
from leafe.services.bus.nats_server import EmbeddedNats, free_port
from leafe.services.metrics import MetricsServer, serve_metrics

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def _healthz(url: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s,
        s.get(url) as resp,
    ):
        return resp.status, (await resp.text()).strip()


async def _until_status(url: str, status: int, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        got, text = await _healthz(url)
        if got == status:
            return text
        assert time.monotonic() < deadline, f"/healthz still {got} ({text!r}), wanted {status}"
        await asyncio.sleep(0.1)


async def test_actor_healthz_follows_its_nats_connection(tmp_path: Path) -> None:
    store = tmp_path / "js"
    server = EmbeddedNats(store, log_file=tmp_path / "nats.log").start()
    nc = await connect(server.url)
    try:
        await ensure_streams(nc.jetstream())
        actor = ActorService(
            nc=nc,
            run_id="probe",
            engine=ScriptedEngine(),
            tokenizer=ByteChatTokenizer(),
            config=ActorServiceConfig(fetch_timeout_s=0.2),
            actor_id="actor-p",
            env_factory=lambda name, **options: CorridorEnv(),
        )
        metrics = serve_metrics(free_port(), actor.metrics.registry, "127.0.0.1")
        assert isinstance(metrics, MetricsServer)
        url = f"http://127.0.0.1:{metrics.port}/healthz"
        try:
            assert await _healthz(url) == (503, "actor: consumer not bound")
            stop = asyncio.Event()
            running = asyncio.create_task(actor.run(stop))
            assert (await _until_status(url, 200)).startswith("actor: ok, consumer actors-probe")
            server.kill()
            assert await _until_status(url, 503) == "actor: NATS connection reconnecting"
            server = EmbeddedNats(store, port=server.port, log_file=tmp_path / "nats.log").start()
            await _until_status(url, 200)
            stop.set()
            await asyncio.wait_for(running, 30)
            assert await _healthz(url) == (503, "actor: consumer not bound")
        finally:
            metrics.close()
    finally:
        await nc.close()
        server.stop()
