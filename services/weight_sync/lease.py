"""What keeps a weight push from stopping every engine at once: one load at a time among the weight
syncs that share a weight store, and a lock the engine's liveness probe reads so it never asks a
loading engine for a generation.

- :class:`ReloadLease` is an exclusive ``flock`` on ``<store>/.in_use/reload/lease``, held by the
  weight sync whose server loads. Every SGLang pod's sidecar reacts to the same
  ``WeightsPublished``; the one that gets the lock loads, the others retry every ``lease_poll_s``,
  so the router always has servers that are not loading. The holder is a process holding a
  descriptor: the kernel (or the NFS server's lock manager) frees the lock when it dies, so nothing
  on the volume says who holds it, and nothing a writer of ``.in_use/`` plants there counts (a fresh
  or back-dated file, 256 MiB of content: an earlier lease trusted the file's mtime and read it
  whole). What a writer can still do is bounded and logged: a process of its own that *holds* the
  lock delays a load by at most the lease's ``ttl_s`` (the load deadline: no load of ours holds it
  longer), after which the waiter loads anyway (``weight_sync.lease.overdue``); a lease file deleted
  or replaced under a holder (seen as a new inode by any weight sync that saw the old one) is
  trusted only ``ttl_s`` later, so the holder of the old one has finished. The file is opened
  ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file (anything else is moved aside); its content
  (the holder's name) is read at most :data:`LEASE_READ_BYTES` at a time and logged as a digest.
- :func:`engine_lock`: an exclusive ``flock`` on a file shared with the engine's container (an
  ``emptyDir``), held while the server loads, with the load's deadline written in it.
  ``deploy/components/sglang/liveness.py`` (the SGLang container's liveness probe) takes the shared
  lock before calling SGLang's generating ``/health``: while a load holds the file it answers alive
  until the deadline instead (a finite one, at most the load deadline after the file was written),
  and a load waits for a check in progress. SGLang's ``/health`` that lands in a load longer than
  20 s marks the server unhealthy, and its ``/ready`` then answers 503 until a later ``/health``
  succeeds; the router drops such a worker.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import os
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path

import structlog

from leafe.learner.weight_store import IN_USE_DIR

__all__ = [
    "LEASE_DIR",
    "LEASE_READ_BYTES",
    "EngineLockError",
    "LoadSlots",
    "ReloadLease",
    "engine_lock",
    "lock_open",
]

log = structlog.get_logger(__name__)

LEASE_DIR = "reload"
"""The lease's directory under the store's ``.in_use/`` (a directory: the learner's pruning reads
only the files there, as in-use markers)."""
LEASE_READ_BYTES = 256
"""At most this much of a lease file is read (a holder's name is under 200 bytes)."""
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})
"""``flock`` errors that say the filesystem cannot lock at all (not what a writer can cause)."""


class EngineLockError(OSError):
    """The engine lock's path is not a regular file this process can lock (a FIFO, a symlink, a
    directory): no load is started, since the liveness probe could not see it."""


def lock_open(path: str | Path, *, create: bool) -> int:
    """``path`` opened read-write without following a symlink and without blocking (a FIFO opens at
    once), checked to be a regular file; :class:`EngineLockError` names what is there instead."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o664)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EngineLockError(errno.ELOOP, f"{path} is a symlink, not a lock file") from None
        if e.errno == errno.EISDIR:
            raise EngineLockError(errno.EISDIR, f"{path} is a directory, not a lock file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket or device"
        raise EngineLockError(errno.EINVAL, f"{path} is {kind}, not a regular lock file")
    os.set_blocking(fd, True)
    return fd


def digest(data: bytes) -> str:
    """How a lease's content is logged: its sha256 (a prefix) and length, never the bytes."""
    return f"sha256:{hashlib.sha256(data).hexdigest()[:16]} ({len(data)} bytes)"


class ReloadLease:
    """The right to load weights now, among every weight sync whose store is ``directory``'s (see
    the module docstring). ``ttl_s``: the longest a load of ours holds it (the load deadline), so
    the longest a lease held elsewhere, or replaced under its holder, is waited for. Not
    thread-safe; one per weight sync."""

    def __init__(
        self,
        directory: Path,
        holder: str,
        *,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_s > 0 or ttl_s == float("inf"):
            raise ValueError(f"lease ttl_s must be finite and > 0, got {ttl_s!r}")
        self.path = Path(directory) / "lease"
        self.holder = holder
        self.ttl_s = ttl_s
        self.clock = clock
        self._fd = -1
        self._known: tuple[int, int] | None = None
        """(device, inode) of the lease file as last seen: a different one means it was replaced."""
        self._replaced_at: float | None = None
        """When a replaced lease file was first seen (trusted ``ttl_s`` later)."""
        self._waiting_since: float | None = None
        """When a try first found the lease unavailable (since then, none succeeded)."""
        self._last_miss = 0.0
        """When a try last found it unavailable (a longer gap than ``ttl_s / 4`` starts a new
        wait)."""
        self.overdue = False
        """The last :meth:`try_acquire` went ahead without the lease: unavailable for ``ttl_s``."""

    @property
    def held(self) -> bool:
        """Whether this weight sync holds the lease."""
        return self._fd >= 0

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; ``True`` also when it has been unavailable for
        ``ttl_s`` (then :attr:`overdue` is set and nothing is held)."""
        if self.held:
            return True
        self.overdue = False
        try:
            taken = self._take()
        except OSError as e:
            if e.errno in _NO_LOCKS:
                raise  # the filesystem cannot lock: LoadSlots says so and loads
            taken = False  # anything else a writer of the directory may have caused: wait
            log.error(
                "weight_sync.lease.unusable", path=str(self.path), error=f"{type(e).__name__}: {e}"
            )
        if taken:
            self._waiting_since = None
            return True
        now = self.clock()
        if self._waiting_since is None or now - self._last_miss > self.ttl_s / 4:
            self._waiting_since = now
        self._last_miss = now
        if now - self._waiting_since >= self.ttl_s:
            self.overdue = True
            self._waiting_since = None
            return True
        return False

    def _take(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = lock_open(self.path, create=True)
        except EngineLockError as e:  # planted: moved aside, so the next try starts a new file
            self._set_aside(str(e))
            return False
        except PermissionError as e:
            self._set_aside(f"{self.path}: {e.strerror}")
            return False
        try:
            if not self._trusted(fd):
                os.close(fd)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its holder's server loads
                os.close(fd)
                return False
            if not self._same_file(fd):  # replaced between our open and our lock
                os.close(fd)
                return False
            token = f"{self.holder} {uuid.uuid4().hex}\n".encode()[:LEASE_READ_BYTES]
            os.ftruncate(fd, 0)
            os.pwrite(fd, token, 0)
        except BaseException:
            with suppress(OSError):
                os.close(fd)
            raise
        self._fd = fd
        log.info("weight_sync.lease.taken", path=str(self.path), holder=digest(token))
        return True

    def _trusted(self, fd: int) -> bool:
        """Whether the lease file is the one this weight sync saw before, or a new one old enough
        that whoever held a replaced one has finished."""
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if self._known is None or ident == self._known:
            self._known, self._replaced_at = ident, None
            return True
        now = self.clock()
        if self._replaced_at is None:
            self._replaced_at = now
            log.error(
                "weight_sync.lease.replaced",
                path=str(self.path),
                effect=f"someone deleted or replaced the lease file; it is trusted again in "
                f"{self.ttl_s:.0f} s, when a load holding the old one has ended",
            )
        if now - self._replaced_at < self.ttl_s:
            return False
        self._known, self._replaced_at = ident, None
        return True

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def _set_aside(self, what: str) -> None:
        aside = self.path.with_name(f"bad.{uuid.uuid4().hex}")
        with suppress(OSError):
            os.rename(self.path, aside)
        log.error("weight_sync.lease.refused", path=str(self.path), found=what, moved_to=aside.name)

    def refresh(self) -> None:
        """While held: check that the lease file is still the one locked (said if it was deleted
        or replaced: another weight sync may load at the same time)."""
        if self.held and not self._same_file(self._fd):
            log.error(
                "weight_sync.lease.lost",
                path=str(self.path),
                effect="the lease file was deleted or replaced during this load; weight syncs "
                "that never saw it may load their servers at the same time",
            )

    def release(self) -> None:
        """Give the lease up (the file stays: a new one would be a replacement)."""
        if self.held:
            fd, self._fd = self._fd, -1
            with suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def owner(self) -> str:
        """Who holds the lease, as logged: the digest of at most :data:`LEASE_READ_BYTES` of the
        file (``""``: no file)."""
        try:
            fd = lock_open(self.path, create=False)
        except FileNotFoundError:
            return ""
        except OSError as e:
            return f"unreadable: {e.strerror}"
        try:
            return digest(os.pread(fd, LEASE_READ_BYTES, 0))
        finally:
            os.close(fd)


@asynccontextmanager
async def engine_lock(path: str, *, deadline_s: float) -> AsyncIterator[None]:
    """Hold ``path`` exclusively while the server loads, with the load's deadline (epoch seconds,
    ``now + deadline_s``) written in it for the liveness probe; waits for a liveness check in
    progress. A no-op for an empty ``path``; :class:`EngineLockError` when ``path`` is no regular
    file."""
    if not path:
        yield
        return
    if not 0 < deadline_s < float("inf"):
        raise ValueError(f"deadline_s must be finite and > 0, got {deadline_s!r}")
    fd = lock_open(path, create=True)
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
    own (held for the load), and the engine lock is held for the liveness probe."""

    def __init__(
        self,
        *,
        holder: str,
        lease: bool,
        engine_lock: str,
        load_deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``lease`` False: no lease (this weight sync's own servers still load one at a time).
        ``load_deadline_s``: the longest one load holds the lease, and the engine lock's
        deadline."""
        self.holder = holder
        self.lease = lease
        self.engine_lock = engine_lock
        self.load_deadline_s = load_deadline_s
        self.clock = clock
        self._leases: dict[Path, ReloadLease] = {}
        self._warned = False
        self._waiting: set[tuple[str, str]] = set()
        """(server, version) pairs already logged as waiting for the lease."""
        self._lock_refused: set[tuple[str, str]] = set()

    @asynccontextmanager
    async def take(self, url: str, version: str, store: Path) -> AsyncIterator[bool]:
        """``True`` for the block when ``url`` may load ``version`` (an export under ``store``) now,
        ``False`` while another weight sync's server loads (or the engine lock is unusable)."""
        lease = self._lease(store)
        if lease is not None and not self._try(lease):
            if (url, version) not in self._waiting:
                self._waiting.add((url, version))
                log.info(
                    "weight_sync.server.waiting", url=url, version=version, holder=lease.owner()
                )
            yield False
            return
        if lease is not None and lease.overdue:
            log.error(
                "weight_sync.lease.overdue",
                url=url,
                version=version,
                holder=lease.owner(),
                waited_s=round(lease.ttl_s),
                effect="the reload lease was unavailable for longer than any load of ours "
                "holds it: loading without it (another server may load at the same time)",
            )
        keeper = asyncio.create_task(_keep(lease)) if lease is not None else None
        try:
            async with AsyncExitStack() as stack:
                try:
                    await stack.enter_async_context(
                        engine_lock(self.engine_lock, deadline_s=self.load_deadline_s)
                    )
                except EngineLockError as e:
                    if (url, version) not in self._lock_refused:
                        self._lock_refused.add((url, version))
                        log.error(
                            "weight_sync.engine_lock.refused",
                            url=url,
                            version=version,
                            error=str(e),
                            effect="no load: the liveness probe could not see it",
                        )
                    yield False
                    return
                yield True
        finally:
            if keeper is not None:
                keeper.cancel()
            if lease is not None:
                lease.release()

    def _lease(self, store: Path) -> ReloadLease | None:
        """The reload lease of ``store`` (``None``: no lease, or the store is not visible here)."""
        if not self.lease or not store.is_dir():
            return None
        if store not in self._leases:
            directory = store / IN_USE_DIR / LEASE_DIR
            self._leases[store] = ReloadLease(
                directory, self.holder, ttl_s=self.load_deadline_s, clock=self.clock
            )
        return self._leases[store]

    def _try(self, lease: ReloadLease) -> bool:
        """``lease.try_acquire()``; on a filesystem that cannot lock at all the load goes ahead
        (said once)."""
        try:
            return lease.try_acquire()
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning(
                    "weight_sync.lease.unlockable",
                    path=str(lease.path),
                    error=f"{type(e).__name__}: {e}",
                    effect="weight syncs sharing this store may load their servers "
                    "at the same time",
                )
            return True


async def _keep(lease: ReloadLease) -> None:
    """Check ``lease`` every quarter of its ttl (at most every 30 s) until cancelled."""
    while True:
        await asyncio.sleep(min(30.0, lease.ttl_s / 4))
        try:
            lease.refresh()
        except OSError as e:
            log.warning("weight_sync.lease.refresh_failed", path=str(lease.path), error=str(e))
