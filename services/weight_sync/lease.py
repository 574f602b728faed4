"""What keeps a weight push from stopping every engine at once: one load at a time among the weight
syncs that share a weight store, and a lock the engine's liveness probe reads so it never asks a
loading engine for a generation.

- :class:`ReloadLease` is a file, ``<store>/.in_use/reload/lease``, created exclusively (``O_EXCL``,
  atomic on local disks and NFS alike) by the weight sync about to load its server and removed when
  the load is done. Every SGLang pod's sidecar reacts to the same ``WeightsPublished``; the one that
  creates the file loads, the others retry every ``lease_poll_s``, so the router always has servers
  that are not loading. A holder refreshes the file's mtime while its server loads; a lease older
  than ``ttl_s`` (its holder died mid-load) is moved aside and the next try takes it. Two breakers
  of one stale lease can, in a window of a few system calls, leave two holders: then two servers
  load at once, which the liveness lock below keeps from costing more than the time of the load.
- :func:`engine_lock`: an exclusive ``flock`` on a file shared with the engine's container (an
  ``emptyDir``), held while the server loads, with the load's deadline written in it.
  ``deploy/components/sglang/ liveness.py`` (the SGLang container's liveness probe) takes the shared
  lock before calling SGLang's generating ``/health``: while a load holds the file it answers alive
  until the deadline instead, and a load waits for a check in progress. SGLang's ``/health`` that
  lands in a load longer than 20 s marks the server unhealthy, and its ``/ready`` then answers 503
  until a later ``/health`` succeeds; the router drops such a worker.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import structlog

from leafe.learner.weight_store import IN_USE_DIR

__all__ = ["LEASE_DIR", "LoadSlots", "ReloadLease", "engine_lock"]

log = structlog.get_logger(__name__)

LEASE_DIR = "reload"
"""The lease's directory under the store's ``.in_use/`` (a directory: the learner's pruning reads
only the files there, as in-use markers)."""


class ReloadLease:
    """The right to load weights now, among every weight sync whose store is ``directory``'s (see
    the module docstring). Not thread-safe; one per weight sync."""

    def __init__(self, directory: Path, holder: str, *, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s!r}")
        self.path = Path(directory) / "lease"
        self.holder = holder
        self.ttl_s = ttl_s
        self._token = ""
        """The content of the lease while this weight sync holds it (unique to one acquisition)."""

    @property
    def held(self) -> bool:
        """Whether this weight sync holds the lease."""
        return bool(self._token)

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it (a stale one is moved aside, taken at the next try)."""
        if self.held:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        token = f"{self.holder} {uuid.uuid4().hex}\n"
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o664)
        except FileExistsError:
            if self._age() > self.ttl_s:
                self._break_stale()
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token)
        self._token = token
        return True

    def refresh(self) -> None:
        """Tell the others the holder is alive (its server is still loading)."""
        if self.held and self._ours():
            os.utime(self.path)

    def release(self) -> None:
        """Give the lease up (a lease that is no longer ours is left alone)."""
        if self.held and self._ours():
            self.path.unlink(missing_ok=True)
        self._token = ""

    def owner(self) -> str:
        """Who holds the lease now (``""``: nobody)."""
        with suppress(FileNotFoundError):
            return self.path.read_text(encoding="utf-8").rsplit(" ", 1)[0]
        return ""

    def _ours(self) -> bool:
        with suppress(FileNotFoundError):
            return self.path.read_text(encoding="utf-8") == self._token
        return False

    def _age(self) -> float:
        with suppress(FileNotFoundError):
            return time.time() - self.path.stat().st_mtime
        return 0.0

    def _break_stale(self) -> None:
        """Move the stale lease aside under a name of our own (one rename wins); a lease refreshed
        or taken anew between our look and the rename is put back unless a newer one exists
        already."""
        aside = self.path.with_name(f"stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if time.time() - aside.stat().st_mtime <= self.ttl_s:
                with suppress(FileExistsError):
                    os.link(aside, self.path)
            else:
                log.warning(
                    "weight_sync.lease.broken", holder=aside.read_text(encoding="utf-8").strip()
                )
        finally:
            aside.unlink(missing_ok=True)


@asynccontextmanager
async def engine_lock(path: str, *, deadline_s: float) -> AsyncIterator[None]:
    """Hold ``path`` exclusively while the server loads, with the load's deadline (epoch seconds,
    ``now + deadline_s``) written in it for the liveness probe; waits for a liveness check in
    progress. A no-op for an empty ``path``."""
    if not path:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        # written before the lock is taken: the probe reads the deadline only when it finds the lock
        # held
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{time.time() + deadline_s:.3f}\n".encode(), 0)
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class LoadSlots:
    """Whether a weight sync's server may load now: the reload lease of the export's store is its
    own (held and refreshed for the load), and the engine lock is held for the liveness probe."""

    def __init__(
        self, *, holder: str, lease_ttl_s: float | None, engine_lock: str, load_deadline_s: float
    ) -> None:
        """``lease_ttl_s`` ``None``: no lease (this weight sync's own servers still load one at a
        time)."""
        self.holder = holder
        self.lease_ttl_s = lease_ttl_s
        self.engine_lock = engine_lock
        self.load_deadline_s = load_deadline_s
        self._leases: dict[Path, ReloadLease] = {}
        self._warned = False
        self._waiting: set[tuple[str, str]] = set()
        """(server, version) pairs already logged as waiting for the lease."""

    @asynccontextmanager
    async def take(self, url: str, version: str, store: Path) -> AsyncIterator[bool]:
        """``True`` for the block when ``url`` may load ``version`` (an export under ``store``) now,
        ``False`` while another weight sync's server loads."""
        lease = self._lease(store)
        if lease is not None and not self._try(lease):
            if (url, version) not in self._waiting:
                self._waiting.add((url, version))
                log.info(
                    "weight_sync.server.waiting", url=url, version=version, holder=lease.owner()
                )
            yield False
            return
        keeper = asyncio.create_task(_keep(lease)) if lease is not None else None
        try:
            async with engine_lock(self.engine_lock, deadline_s=self.load_deadline_s):
                yield True
        finally:
            if keeper is not None:
                keeper.cancel()
            if lease is not None:
                lease.release()

    def _lease(self, store: Path) -> ReloadLease | None:
        """The reload lease of ``store`` (``None``: no lease, or the store is not visible here)."""
        if self.lease_ttl_s is None or not store.is_dir():
            return None
        if store not in self._leases:
            directory = store / IN_USE_DIR / LEASE_DIR
            self._leases[store] = ReloadLease(directory, self.holder, ttl_s=self.lease_ttl_s)
        return self._leases[store]

    def _try(self, lease: ReloadLease) -> bool:
        """``lease.try_acquire()``; a lease that cannot be written at all does not stop the load
        (said once)."""
        try:
            return lease.try_acquire()
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning(
                    "weight_sync.lease.unwritable",
                    path=str(lease.path),
                    error=f"{type(e).__name__}: {e}",
                    effect="weight syncs sharing this store may load their servers "
                    "at the same time",
                )
            return True


async def _keep(lease: ReloadLease) -> None:
    """Refresh ``lease`` every quarter of its ttl until cancelled."""
    while True:
        await asyncio.sleep(lease.ttl_s / 4)
        try:
            lease.refresh()
        except OSError as e:
            log.warning("weight_sync.lease.refresh_failed", path=str(lease.path), error=str(e))
