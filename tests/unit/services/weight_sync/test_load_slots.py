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
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from leafe.learner.weight_store import in_use_versions, mark_in_use
from leafe.protocol import WeightsPublished
from leafe.services.weight_sync.lease import LoadSlots, ReloadLease, engine_lock
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

pytestmark = pytest.mark.anyio

LIVENESS = Path(__file__).resolve().parents[4] / "deploy" / "components" / "sglang" / "liveness.py"


def test_one_weight_sync_holds_the_lease_at_a_time(tmp_path: Path) -> None:
    """A second weight sync cannot take the lease while the first holds it, and takes it once
    released; the learner's pruning still reads only the in-use markers beside it."""
    a, b = (ReloadLease(tmp_path / ".in_use" / "reload", name, ttl_s=60) for name in ("a", "b"))
    assert a.try_acquire() and not b.try_acquire() and b.owner().startswith("sha256:")
    mark_in_use(tmp_path, "host|url", "v000003")
    assert in_use_versions(tmp_path) == {"v000003"}
    a.release()
    assert b.try_acquire() and not a.try_acquire()


async def test_a_lease_whose_holder_died_is_free_at_once(tmp_path: Path) -> None:
    """The lease is a lock held by a process: when the holder dies mid-load (SIGKILL), the kernel
    frees it and the next weight sync takes it at its next try, with no ttl to wait out."""
    code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o664); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, str(tmp_path / "lease"), stdout=asyncio.subprocess.PIPE
    )
    assert holder.stdout is not None
    assert await asyncio.wait_for(holder.stdout.readline(), 10) == b"held\n"
    b = ReloadLease(tmp_path, "b", ttl_s=600)
    assert not b.try_acquire()
    holder.kill()
    await holder.wait()
    assert b.try_acquire() and b.held and not b.overdue


@dataclass
class LoadingEngine:
    """An SGLang-shaped engine whose weight load takes ``load_s`` and whose ``/health`` calls are
    counted."""

    load_s: float
    url: str = ""
    loading: asyncio.Event = field(default_factory=asyncio.Event)
    health_calls: int = 0
    health_status: int = 200
    loads: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/model_info":
            return web.json_response({"weight_version": "default"})
        if request.path == "/health":
            self.health_calls += 1
            return web.Response(status=self.health_status)
        self.loads += 1
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


# ---- what a writer of the volume (every weight-sync sidecar can write .in_use/) can no longer do


def _hold(path: Path) -> int:
    """A volume writer's own process holding ``path`` locked (here: a descriptor of this one)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_planted_fresh_lease_file_blocks_nothing(tmp_path: Path) -> None:
    """A lease file written and kept fresh by someone who holds no lock on it is no lease: a weight
    sync takes it at once. Before, a file refreshed every few seconds blocked every reload
    forever."""
    planted = tmp_path / "lease"
    planted.write_text("evil-sidecar 0123\n")
    os.utime(planted)
    b = ReloadLease(tmp_path, "b", ttl_s=60)
    assert b.try_acquire() and b.held
    b.release()


def test_a_lease_held_by_a_stranger_delays_a_load_at_most_its_ttl(tmp_path: Path) -> None:
    """A volume writer's process that holds the lock (and keeps the file fresh) delays a load by at
    most the lease's ttl (the load deadline: no load of ours holds it longer); then the waiter goes
    ahead without it, marked overdue. Before, it blocked reloads for as long as it kept going."""
    stranger = _hold(tmp_path / "lease")
    try:
        b = ReloadLease(tmp_path, "b", ttl_s=1.0)
        tries, deadline = 0, time.monotonic() + 5
        while not b.try_acquire():
            os.utime(tmp_path / "lease")  # kept fresh, as a refreshing holder would
            tries += 1
            assert time.monotonic() < deadline, "still waiting for a lease held by a stranger"
            time.sleep(0.1)
        assert tries > 0 and b.overdue and not b.held
    finally:
        os.close(stranger)


async def test_an_overdue_load_goes_ahead_and_says_so(tmp_path: Path) -> None:
    """Through LoadSlots: a load waits while a stranger holds the lease, then goes ahead after the
    load deadline with ``weight_sync.lease.overdue`` naming the holder by a digest."""
    store = tmp_path / "store"
    (store / ".in_use" / "reload").mkdir(parents=True)
    stranger = _hold(store / ".in_use" / "reload" / "lease")
    now = [0.0]
    slots = LoadSlots(
        holder="b", lease=True, engine_lock="", load_deadline_s=60.0, clock=lambda: now[0]
    )
    try:
        grants = []
        with capture_logs() as logs:
            for _ in range(62):  # polled every second, as weight sync polls a held lease
                async with slots.take("http://e", "v000002", store) as granted:
                    grants.append(granted)
                now[0] += 1.0
        assert grants.index(True) == 60 and not any(grants[:60])
        [overdue] = [e for e in logs if e["event"] == "weight_sync.lease.overdue"]
        assert overdue["holder"].startswith("sha256:") and overdue["log_level"] == "error"
    finally:
        os.close(stranger)


def test_a_back_dated_lease_is_not_taken_from_its_holder(tmp_path: Path) -> None:
    """A holder's lease whose mtime a writer set an hour back stays its holder's: nobody else
    takes it while the holder lives. Before, it was moved aside as stale and taken at the next try,
    and two servers loaded at once."""
    a, b = (ReloadLease(tmp_path, name, ttl_s=60) for name in ("a", "b"))
    assert a.try_acquire()
    old = time.time() - 3600
    os.utime(a.path, (old, old))
    assert not any(b.try_acquire() for _ in range(3))
    a.release()
    assert b.try_acquire()


def test_a_deleted_lease_does_not_let_a_second_load_start(tmp_path: Path) -> None:
    """A writer deletes the lease file while its holder loads: a weight sync that saw the old file
    trusts the new one only after the ttl (when a load holding the old one has ended), and the
    holder says its lease was lost. Before, the next try created a new file and two servers loaded
    at once."""
    a = ReloadLease(tmp_path, "a", ttl_s=60)
    b = ReloadLease(tmp_path, "b", ttl_s=60)
    assert a.try_acquire() and not b.try_acquire()
    a.path.unlink()
    with capture_logs() as logs:
        assert not any(b.try_acquire() for _ in range(3))
        a.refresh()
    events = {e["event"]: e["log_level"] for e in logs}
    assert events["weight_sync.lease.replaced"] == "error"
    assert events["weight_sync.lease.lost"] == "error"
    a.release()
    late = [0.0]
    c = ReloadLease(tmp_path, "c", ttl_s=60, clock=lambda: late[0])
    c._known = (0, 0)  # it saw the deleted file too
    assert not c.try_acquire()
    late[0] += 61  # the old holder's load is over by now
    assert c.try_acquire() and c.held and not c.overdue


def test_a_huge_lease_is_read_in_a_few_hundred_bytes_and_logged_as_a_digest(
    tmp_path: Path,
) -> None:
    """A held 256 MiB lease file: waiting for it reads at most a few hundred bytes and logs its
    digest, never its content. Before, it was read and logged whole (27 s, +768 MiB)."""
    lease = tmp_path / "lease"
    with lease.open("wb") as f:
        f.write(b"EVIL" * 64)
        f.truncate(256 << 20)
    stranger = _hold(lease)
    try:
        b = ReloadLease(tmp_path, "b", ttl_s=60)
        tracemalloc.start()
        try:
            assert not b.try_acquire()
            owner = b.owner()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{peak} bytes allocated to wait for a lease"
        assert "EVIL" not in owner and len(owner) < 100, owner[:200]
    finally:
        os.close(stranger)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lease_path_that_is_no_regular_file_is_moved_aside(tmp_path: Path, kind: str) -> None:
    """A FIFO or a symlink planted as the lease is refused (said, moved aside), never opened
    through; the next weight sync starts a lease of its own."""
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    if kind == "fifo":
        os.mkfifo(tmp_path / "lease")
    else:
        (tmp_path / "lease").symlink_to(target)
    b = ReloadLease(tmp_path, "b", ttl_s=60)
    with capture_logs() as logs:
        assert not b.try_acquire()
    assert [e["event"] for e in logs] == ["weight_sync.lease.refused"]
    assert target.read_text() == "keep me\n"
    assert ReloadLease(tmp_path, "c", ttl_s=60).try_acquire()


async def _probe_run(lock: Path, url: str, *extra: str) -> tuple[int, str]:
    """The liveness probe's exit status and stderr; it must return well inside the kubelet's 30 s
    timeout."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(LIVENESS), str(lock), url, *extra,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("the liveness probe hung") from None
    return int(proc.returncode or 0), err.decode()


@pytest.mark.parametrize(
    "written",
    ["4102444800.000\n", "inf\n", "1e309\n", "nan\n", "9" * 300 + "\n"],
    ids=["year-2100", "inf", "overflow", "nan", "long"],
)
async def test_a_dead_engine_is_dead_whatever_deadline_the_lock_holds(
    tmp_path: Path, written: str
) -> None:
    """A held engine lock whose deadline is no load's (year 2100, inf, nan, 300 digits) does not
    keep a dead engine alive: the probe says so and asks ``/health``, which fails. Before, a year
    2100 or inf deadline reported the dead engine alive for as long as the lock was held."""
    lock = tmp_path / "reload.lock"
    lock.write_text(written)
    holder = _hold(lock)
    try:
        async with loading_engine(load_s=0) as engine:
            engine.health_status = 503  # dead
            status, err = await _probe_run(lock, f"{engine.url}/health")
        assert status == 1 and "no usable deadline" in err and engine.health_calls == 1
    finally:
        os.close(holder)


async def test_a_lock_written_long_ago_counts_for_one_load_only(tmp_path: Path) -> None:
    """A plausible deadline in a file written more than a load deadline ago does not keep a dead
    engine alive (the lock's age caps it); a fresh one still spares a loading engine its
    ``/health``."""
    lock = tmp_path / "reload.lock"
    lock.write_text(f"{time.time() + 600:.3f}\n")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    holder = _hold(lock)
    try:
        async with loading_engine(load_s=0) as engine:
            engine.health_status = 503
            assert (await _probe_run(lock, f"{engine.url}/health", "660"))[0] == 1
            lock.write_text(f"{time.time() + 60:.3f}\n")  # a load that began now
            assert (await _probe_run(lock, f"{engine.url}/health", "660"))[0] == 0
            assert engine.health_calls == 0
    finally:
        os.close(holder)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
async def test_a_fifo_or_symlink_at_the_lock_path_fails_the_probe_at_once(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO at the lock path once hung the probe (opening it waits for a writer) until the
    kubelet's timeout; now the probe returns at once, not alive, saying why. A symlink is refused
    the same way."""
    lock = tmp_path / "reload.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        (tmp_path / "elsewhere").write_text(f"{time.time() + 600:.3f}\n")
        lock.symlink_to(tmp_path / "elsewhere")
    async with loading_engine(load_s=0) as engine:
        status, err = await _probe_run(lock, f"{engine.url}/health")
    assert status == 1 and engine.health_calls == 0
    assert ("not a regular file" if kind == "fifo" else "is a symlink") in err


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
async def test_weight_sync_never_writes_through_a_planted_engine_lock(
    tmp_path: Path, kind: str
) -> None:
    """Weight sync refuses an engine lock path that is a symlink or a FIFO (said; no load, since the
    probe could not see it) instead of truncating whatever the symlink names."""
    lock, store, precious = tmp_path / "reload.lock", tmp_path / "store", tmp_path / "precious"
    store.mkdir()
    precious.write_text("keep me\n")
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(precious)
    async with loading_engine(load_s=0) as engine:
        cfg = WeightSyncConfig(servers=[engine.url], verify="off", engine_lock=str(lock))
        sync = WeightSync(cfg, run_id="r")
        sync.offer(_announcement(store / "v000001"))
        with capture_logs() as logs:
            done = await asyncio.wait_for(sync.sync(), 10)
        await sync.close()
    assert done == {} and engine.loads == 0
    assert precious.read_text() == "keep me\n"
    assert "weight_sync.engine_lock.refused" in [e["event"] for e in logs]
