"""Weight pushes that keep serving: the store's reload lease lets one weight sync load at a time and
is taken over from a holder that died; the engine lock makes the SGLang liveness probe
(deploy/components/sglang/liveness.py, run here as the kubelet would) answer alive during a load
without asking the engine for a generation, and a load waits for a check in progress. Loopback
only."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from leafe.learner.weight_store import in_use_versions, mark_in_use
from leafe.protocol import WeightsPublished
from leafe.services.weight_sync.lease import ReloadLease, engine_lock
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

pytestmark = pytest.mark.anyio

LIVENESS = Path(__file__).resolve().parents[4] / "deploy" / "components" / "sglang" / "liveness.py"


def test_one_weight_sync_holds_the_lease_at_a_time(tmp_path: Path) -> None:
    """A second weight sync cannot take the lease while the first holds it, and takes it once
    released; the learner's pruning still reads only the in-use markers beside it."""
    a, b = (ReloadLease(tmp_path / ".in_use" / "reload", name, ttl_s=60) for name in ("a", "b"))
    assert a.try_acquire() and not b.try_acquire() and b.owner() == "a"
    mark_in_use(tmp_path, "host|url", "v000003")
    assert in_use_versions(tmp_path) == {"v000003"}
    a.release()
    assert b.try_acquire() and not a.try_acquire()


def test_a_stale_lease_is_taken_over_and_a_refreshed_one_is_not(tmp_path: Path) -> None:
    """A lease not refreshed within its ttl (holder died mid-load) is moved aside and taken at the
    next try; one its holder keeps refreshing stays its holder's, and the dead holder's release
    leaves the new lease alone."""
    dead, alive, other = (
        ReloadLease(tmp_path, name, ttl_s=5) for name in ("dead", "alive", "other")
    )
    assert dead.try_acquire()
    os.utime(dead.path, (time.time() - 60, time.time() - 60))
    assert not alive.try_acquire()  # moved aside
    assert alive.try_acquire() and alive.owner() == "alive"
    alive.refresh()
    assert not other.try_acquire() and not other.try_acquire() and alive.owner() == "alive"
    dead.release()
    assert alive.owner() == "alive"


@dataclass
class LoadingEngine:
    """An SGLang-shaped engine whose weight load takes ``load_s`` and whose ``/health`` calls are
    counted."""

    load_s: float
    url: str = ""
    loading: asyncio.Event = field(default_factory=asyncio.Event)
    health_calls: int = 0
    health_status: int = 200

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/model_info":
            return web.json_response({"weight_version": "default"})
        if request.path == "/health":
            self.health_calls += 1
            return web.Response(status=self.health_status)
        self.loading.set()
        await asyncio.sleep(self.load_s)
        self.loading.clear()
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})


@asynccontextmanager
async def loading_engine(load_s: float) -> AsyncIterator[LoadingEngine]:
    engine = LoadingEngine(load_s)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield engine
    finally:
        await runner.cleanup()


async def _probe(lock: Path, engine: LoadingEngine) -> int:
    """The liveness probe's exit status, run as the kubelet runs it (a process of its own)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(LIVENESS), str(lock), f"{engine.url}/health"
    )
    return await asyncio.wait_for(proc.wait(), 30)


async def test_the_liveness_probe_never_asks_a_loading_engine(tmp_path: Path) -> None:
    """While weight sync loads its engine (holding the engine lock), the probe answers alive without
    a ``/health`` call; outside a load it is the engine's ``/health`` (503 -> not alive)."""
    lock, store = tmp_path / "reload.lock", tmp_path / "store"
    store.mkdir()
    async with loading_engine(load_s=1.5) as engine:
        assert (
            await _probe(lock, engine) == 0 and engine.health_calls == 1
        )  # no lock file yet: /health
        cfg = WeightSyncConfig(servers=[engine.url], verify="off", engine_lock=str(lock))
        sync = WeightSync(cfg, run_id="r")
        sync.offer(_announcement(store / "v000001"))
        pushing = asyncio.create_task(sync.sync())
        await asyncio.wait_for(engine.loading.wait(), 10)
        assert await _probe(lock, engine) == 0 and engine.health_calls == 1
        assert (await pushing)[engine.url].success
        engine.health_status = 503
        assert await _probe(lock, engine) == 1 and engine.health_calls == 2
        await sync.close()


async def test_a_load_waits_for_a_liveness_check_in_progress(tmp_path: Path) -> None:
    """The engine lock is not taken while a probe holds the file shared (its ``/health`` is
    running), so no load starts under a generating health check; it is taken as soon as the check
    ends."""
    lock = tmp_path / "reload.lock"
    lock.touch()
    probe_fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(probe_fd, fcntl.LOCK_SH)
    entered = asyncio.Event()

    async def load() -> None:
        async with engine_lock(str(lock), deadline_s=60):
            entered.set()

    task = asyncio.create_task(load())
    await asyncio.sleep(0.3)
    assert not entered.is_set()
    os.close(probe_fd)
    await asyncio.wait_for(task, 5)
    assert entered.is_set()


def _announcement(uri: Path) -> WeightsPublished:
    return WeightsPublished(
        event_id="weights.r.v000001",
        run_id="r",
        version="v000001",
        uri=str(uri),
        manifest_sha256="",
        learner_step=1,
        base_model="tiny",
        ts=time.time(),
    )
