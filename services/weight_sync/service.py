"""Weight sync: make every inference server serve the latest published weight version.

A reconciler, not a relay: the desired state is the newest ``WeightsPublished`` on
``leafe.<run>.weights`` (read with ``get_last_msg`` on start, then pushed by a subscription); each
server's actual state is its ``/model_info`` ``weight_version``. Whenever they differ the server
gets ``POST /update_weights_from_disk {"model_path": uri, "weight_version": version}``
(actors/client.py's ``SGLangClient``), with backoff on failure. Servers are re-checked every
``reconcile_interval_s``, so a restarted server (back at ``default``) is brought up to date without
a new push. Versions arriving faster than servers load are coalesced: only the newest is applied.
Per-server results are logged (``weight_sync.server.updated`` / ``weight_sync.server.failed``) and
returned by :meth:`WeightSync.sync`. When the export directory is visible here, its manifest is
verified against the announced sha256 first and each server's version is recorded in
``<store>/.in_use/`` so the learner never prunes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import structlog
from nats.js.errors import NotFoundError

from leafe.actors.client import SGLangClient, UpdateResult
from leafe.actors.engine import EngineError
from leafe.learner.model_io import ManifestError, manifest_files, verify_manifest
from leafe.learner.weight_store import IN_USE_DIR, mark_in_use, version_index
from leafe.protocol import WeightsPublished, decode_weights, weights_subject
from leafe.protocol.codec import CODEC_HEADER, ProtocolError
from leafe.protocol.subjects import WEIGHTS
from leafe.services.bus import NatsOptions, connect, wait_for_streams
from leafe.services.metrics import WeightSyncMetrics
from leafe.services.weight_sync.broadcast import GroupError, WeightSender
from leafe.services.weight_sync.lease import LoadSlots

if TYPE_CHECKING:
    import torch

__all__ = ["SyncResult", "WeightSync", "WeightSyncConfig", "resolve_addresses"]

log = structlog.get_logger(__name__)
STREAMS_USED = (WEIGHTS.name,)
"""The streams weight sync waits for on start (made by `leafe streams ensure`)."""


class WeightSyncConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the weight-sync loop."""

    servers: list[str] = msgspec.field(default_factory=list)
    """Base URLs of the inference servers (SGLang or ``leafe inference``)."""
    engines_dns: str = ""
    """``NAME:PORT``: find servers by resolving ``NAME``'s addresses (A/AAAA records) before every
    round, each address a server ``http://ADDR:PORT`` besides ``servers``. For Kubernetes: a
    headless Service of the engine pods (one record per Ready pod). A server that appears is
    brought to the desired version like a restarted one; one that disappears is dropped, and the
    weight group forms anew without it. A failed lookup keeps the servers found last."""
    reconcile_interval_s: float = 10.0
    """Re-read every server's ``weight_version`` this often (catches restarted servers)."""
    update_timeout_s: float = 600.0
    """Timeout of one ``/update_weights_from_disk`` call."""
    retry_backoff_s: float = 2.0
    """First wait before retrying a failed server (doubles up to ``reconcile_interval_s``)."""
    verify: Literal["manifest", "files", "off"] = "files"
    """Before any server loads an export visible here: check its manifest's sha256 against the
    announcement and every file against the manifest (``files``, the default: SGLang's rollback
    after a failed load re-reads the *new* path, so a bad file must never reach it), only the
    manifest (``manifest``), or nothing (``off``). Each version is hashed once, not at every
    reconcile."""
    reload_lease: bool = True
    """Load one server at a time among every weight sync sharing the store (an ``flock`` on
    ``<store>/.in_use/reload/lease``, when the store is visible here;
    services/weight_sync/lease.py): SGLang pods' sidecars all react to the same announcement, and
    servers that reload together all stop serving together. This weight sync's own servers load one
    at a time regardless. A lease held elsewhere is waited for at most the load deadline
    (``update_timeout_s`` + 60 s)."""
    lease_poll_s: float = 1.0
    """How often a weight sync waiting for the lease tries again."""
    transport: Literal["disk", "distributed"] = "disk"
    """How a new version reaches the servers. ``disk``: each server loads the export with
    ``/update_weights_from_disk``. ``distributed``: this process reads the export once and
    broadcasts it to a group of the servers (``/init_weights_update_group``,
    ``/update_weights_from_distributed``; services/weight_sync/broadcast.py). The exports stay on
    disk as the record either way: a server new to the group (started late, restarted) first loads
    the latest version from disk, then joins; a broadcast that fails is retried
    (``broadcast_attempts``), then that version goes by disk."""
    master_address: str = "127.0.0.1"
    """``distributed``: the address the servers reach this process's rendezvous store on."""
    rendezvous_port: int = 0
    """``distributed``: the store's TCP port (0: a free port per group, for one machine; a
    Deployment fixes one its NetworkPolicy opens)."""
    group_backend: Literal["gloo", "nccl"] = "gloo"
    """``distributed``: ``gloo`` (CPU, TCP) or ``nccl`` (this process and the servers on GPUs)."""
    broadcast_timeout_s: float = 300.0
    """``distributed``: a rendezvous or broadcast waits this long for the other members."""
    broadcast_attempts: int = 3
    """``distributed``: broadcasts of one version that may fail before it goes by disk."""
    bucket_mb: int = 512
    """``distributed``: tensors in flight at once (MiB)."""
    engine_lock: str = ""
    """A file held locked (``flock``) while the server loads, with the load's deadline in it: the
    engine's liveness probe (deploy/components/sglang/liveness.py) then answers alive instead of
    asking SGLang for a generation. Empty: none (``leafe inference`` never generates for
    ``/health``)."""

    def __post_init__(self) -> None:
        for name in (
            "reconcile_interval_s",
            "update_timeout_s",
            "lease_poll_s",
            "broadcast_timeout_s",
        ):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)!r}")
        if not 0 <= self.rendezvous_port < 65536:
            raise ValueError(f"rendezvous_port must be in 0..65535, got {self.rendezvous_port!r}")
        if self.broadcast_attempts < 1:
            raise ValueError(f"broadcast_attempts must be >= 1, got {self.broadcast_attempts!r}")
        if self.bucket_mb < 1:
            raise ValueError(f"bucket_mb must be >= 1, got {self.bucket_mb!r}")
        if self.transport == "distributed" and not self.master_address:
            raise ValueError("transport = 'distributed' needs master_address (empty)")
        if self.engines_dns:
            _split_name(self.engines_dns)  # raises naming the bad value


def _split_name(value: str) -> tuple[str, int]:
    """``NAME:PORT`` of ``engines_dns`` as ``(name, port)``; a clear error otherwise."""
    name, _, port = value.rpartition(":")
    if not name or not port.isdigit() or not 0 < int(port) < 65536 or "/" in name:
        raise ValueError(f"engines_dns must be NAME:PORT (a port in 1..65535), got {value!r}")
    return name, int(port)


def resolve_addresses(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to (IPv4 and IPv6, as strings); ``OSError`` when none."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _server_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class SyncResult(msgspec.Struct, frozen=True, kw_only=True):
    """One server's outcome for one version."""

    url: str
    version: str
    success: bool
    message: str
    seconds: float
    """Duration of the update call."""
    started_at: float = 0.0
    """When the update call began (``time.time()``): with ``seconds``, when the server was
    loading."""
    transport: str = "disk"
    """How the version was sent: ``disk`` (``/update_weights_from_disk``) or ``distributed``."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _newer(a: WeightsPublished, b: WeightsPublished | None) -> bool:
    if b is None:
        return True
    ia, ib = version_index(a.version), version_index(b.version)
    if ia is None or ib is None:
        return a.ts > b.ts
    return ia > ib


class WeightSync:
    """Reconciles servers to the newest announced version (see the module docstring)."""

    def __init__(
        self,
        cfg: WeightSyncConfig,
        *,
        run_id: str,
        metrics: WeightSyncMetrics | None = None,
        resolve: Callable[[str, int], list[str]] = resolve_addresses,
    ) -> None:
        if not cfg.servers and not cfg.engines_dns:
            raise ValueError("weight-sync needs at least one --server URL or --engines-dns")
        self.cfg = cfg
        self.run_id = run_id
        self.clients = {u.rstrip("/"): SGLangClient([u], retries=1) for u in cfg.servers}
        """The servers, by base URL: ``servers``, then those ``engines_dns`` finds (the sender
        shares this dict)."""
        self._static = frozenset(self.clients)
        self._resolve = resolve
        self.desired: WeightsPublished | None = None
        self.served: dict[str, str] = {}
        self.retry_at: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self.results: dict[str, SyncResult] = {}
        self.host = socket.gethostname()
        self._marker_warned = False
        self.metrics = metrics or WeightSyncMetrics()
        """Prometheus metrics (``services/metrics.py``); served by ``leafe weight-sync
        --metrics-port``."""
        self._wake = asyncio.Event()
        self._checked: dict[tuple[str, str, str], bool] = {}
        """The verdict of ``_verified`` on the desired export (version, uri, manifest sha256)."""
        self.slots = LoadSlots(
            holder=f"{self.host}|{','.join(self.clients) or cfg.engines_dns}",
            lease=cfg.reload_lease,
            engine_lock=cfg.engine_lock,
            load_deadline_s=cfg.update_timeout_s + 60.0,
        )
        """Who may load now (services/weight_sync/lease.py)."""
        self.sender: WeightSender | None = None
        """``transport = "distributed"``: rank 0 of the servers' weight group."""
        if cfg.transport == "distributed":
            self.sender = WeightSender(
                self.clients,
                master_address=cfg.master_address,
                port=cfg.rendezvous_port,
                backend=cfg.group_backend,
                timeout_s=cfg.broadcast_timeout_s,
                bucket_bytes=cfg.bucket_mb << 20,
                run_id=run_id,
            )
        self._group_stale = False
        """A member's version changed behind the group's back: form it anew before a push."""
        self.broadcast_failures: dict[str, int] = {}
        """Failed broadcasts per version (``broadcast_attempts`` of them send it by disk)."""
        self._record: tuple[str, dict[str, torch.Tensor]] | None = None
        """The desired version's tensors, read once from its export."""

    def offer(self, event: WeightsPublished) -> None:
        """A new announcement: becomes the desired state if it is newer. One without the manifest's
        sha256 is refused (nothing could tell its weights from any other files at that path)."""
        if not event.manifest_sha256 and self.cfg.verify != "off":
            reason = "announcement carries no manifest sha256"
            log.error(
                "weight_sync.version.unverifiable",
                version=event.version,
                uri=event.uri,
                reason=reason,
            )
            return
        if _newer(event, self.desired):
            self.desired = event
            self._wake.set()
            log.info(
                "weight_sync.version.announced",
                version=event.version,
                uri=event.uri,
                step=event.learner_step,
            )

    async def close(self) -> None:
        """Leave the weight group, close the HTTP sessions."""
        if self.sender is not None:
            await self.sender.disband()
        for c in self.clients.values():
            await c.close()

    async def _actual(self, url: str) -> str | None:
        try:
            return await self.clients[url].weight_version()
        except EngineError as e:
            log.warning("weight_sync.server.unreachable", url=url, error=str(e))
            return None

    async def _verified(self, event: WeightsPublished) -> bool:
        """The export is the announced one: its ``manifest.json`` has the announced sha256 (cheap;
        the export appears atomically, so a matching manifest means a complete directory). With
        ``verify = "files"`` every file is hashed too (our CPU server does that itself on load)."""
        path = Path(event.uri)
        if self.cfg.verify == "off" or not await asyncio.to_thread(path.is_dir):
            return True
        key = (event.version, event.uri, event.manifest_sha256 or "")
        if key not in self._checked:  # exports appear atomically and never change: hash once
            self._checked = {key: await self._check(event, path)}  # only the newest is kept
        return self._checked[key]

    async def _check(self, event: WeightsPublished, path: Path) -> bool:
        try:
            if self.cfg.verify == "files":
                await asyncio.to_thread(verify_manifest, path, event.manifest_sha256 or None)
            elif event.manifest_sha256:
                digest = await asyncio.to_thread(_sha256, path / "manifest.json")
                if digest != event.manifest_sha256:
                    raise ManifestError(
                        f"{path}/manifest.json: sha256 {digest} != announced "
                        f"{event.manifest_sha256}"
                    )
        except (ManifestError, FileNotFoundError) as e:
            log.error(
                "weight_sync.version.corrupt", version=event.version, uri=event.uri, error=str(e)
            )
            return False
        return True

    async def _update(self, url: str, event: WeightsPublished) -> SyncResult:
        started_at, t0 = time.time(), time.perf_counter()
        [r] = await self.clients[url].update_weights_from_disk(
            event.uri, event.version, timeout_s=self.cfg.update_timeout_s
        )
        res = SyncResult(
            url=url,
            version=event.version,
            success=r.success,
            message=r.message,
            seconds=time.perf_counter() - t0,
            started_at=started_at,
        )
        return self._record_result(res, event)

    def _record_result(self, res: SyncResult, event: WeightsPublished) -> SyncResult:
        """Book one server's outcome: served version, metrics, in-use marker, retry backoff."""
        url = res.url
        self.results[url] = res
        self.metrics.push_seconds.observe(res.seconds)
        if res.success:
            self.metrics.served(url, event.version)
            self.served[url] = event.version
            self.retry_at.pop(url, None)
            self.failures.pop(url, None)
            self._mark_in_use(url, event)
            since = round(time.time() - event.ts, 3) if event.ts else None
            log.info(
                "weight_sync.server.updated",
                url=url,
                version=event.version,
                transport=res.transport,
                seconds=round(res.seconds, 3),
                since_publish_s=since,
            )
        else:
            self.metrics.failures.labels(engine=url).inc()
            n = self.failures[url] = self.failures.get(url, 0) + 1
            backoff = min(
                self.cfg.reconcile_interval_s, self.cfg.retry_backoff_s * 2 ** min(n - 1, 10)
            )
            self.retry_at[url] = time.monotonic() + backoff
            log.warning(
                "weight_sync.server.failed",
                url=url,
                version=event.version,
                transport=res.transport,
                message=res.message,
                retry_in_s=backoff,
            )
        return res

    def _mark_in_use(self, url: str, event: WeightsPublished) -> None:
        """Tell the learner's pruning that ``url`` serves ``event.version`` (refreshed every
        reconcile). Skipped when the store is not visible here (remote engines); said once when it
        cannot be written."""
        store = Path(event.uri).parent
        if not store.is_dir():
            return
        try:
            mark_in_use(store, f"{self.host}|{url}", event.version)
        except OSError as e:
            if not self._marker_warned:
                self._marker_warned = True
                log.warning(
                    "weight_sync.in_use.unwritable",
                    path=str(store / IN_USE_DIR),
                    error=f"{type(e).__name__}: {e}",
                    effect="the learner's pruning cannot see which versions the engines serve",
                )

    async def sync(self, *, refresh: bool = False) -> dict[str, SyncResult]:
        """Bring every server to the desired version now, one load at a time; returns this round's
        per-server results (a server waiting for the store's reload lease has none yet)."""
        await self._discover()
        event = self.desired
        if event is None or not await self._verified(event):
            return {}
        done: dict[str, SyncResult] = {}
        behind = await self._behind(event, refresh=refresh)
        if self.sender is not None:
            wire = self._by_wire(event, behind)
            if wire:
                done.update(await self._broadcast(event, wire))
            behind = [u for u in behind if u not in wire]
        for url in behind:
            async with self.slots.take(url, event.version, Path(event.uri).parent) as granted:
                if not granted:  # another weight sync's server loads: ask again soon
                    self.retry_at[url] = time.monotonic() + self.cfg.lease_poll_s
                    break
                done[url] = await self._update(url, event)  # the others keep serving meanwhile
        return done

    async def _discover(self) -> None:
        """With ``engines_dns``: make the servers the addresses it resolves to now (plus the static
        ``servers``). A server that left is dropped; if it was in the weight group, the group is
        disbanded first (the next push forms it with the servers there are)."""
        if not self.cfg.engines_dns:
            return
        name, port = _split_name(self.cfg.engines_dns)
        try:
            addresses = await asyncio.to_thread(self._resolve, name, port)
        except OSError as e:
            log.warning(
                "weight_sync.discovery.failed",
                name=self.cfg.engines_dns,
                error=f"{type(e).__name__}: {e}",
                keeping=sorted(self.clients),
            )
            return
        found = {_server_url(a, port) for a in addresses}
        added = sorted(found - set(self.clients))
        gone = sorted(set(self.clients) - found - self._static)
        if not added and not gone:
            return
        if self.sender is not None and set(gone) & set(self.sender.members):
            await self.sender.disband()
        for url in gone:
            client = self.clients.pop(url)
            await client.close()
            self.served.pop(url, None)
            self.retry_at.pop(url, None)
            self.failures.pop(url, None)
            self.results.pop(url, None)
            with contextlib.suppress(KeyError):  # never served a version we could show
                self.metrics.version.remove(url)
        for url in added:
            self.clients[url] = SGLangClient([url], retries=1)
        log.info(
            "weight_sync.discovery.changed",
            name=self.cfg.engines_dns,
            added=added,
            gone=gone,
            servers=len(self.clients),
        )

    def _by_wire(self, event: WeightsPublished, behind: list[str]) -> list[str]:
        """The servers ``event`` goes to by broadcast: those behind that already serve a version of
        this store (a fresh or restarted server, at ``default``, loads the record from disk first),
        while the version has failed fewer than ``broadcast_attempts`` broadcasts."""
        if self.broadcast_failures.get(event.version, 0) >= self.cfg.broadcast_attempts:
            return []
        return [u for u in behind if (version_index(self.served.get(u, "")) or 0) > 0]

    async def _broadcast(self, event: WeightsPublished, urls: list[str]) -> dict[str, SyncResult]:
        """Push ``event``'s export to ``urls`` over their weight group (formed anew when its members
        differ); a failure leaves the old weights serving, is counted against the version and
        retried after the backoff."""
        assert self.sender is not None
        started_at, t0 = time.time(), time.perf_counter()
        try:
            state = await self._record_state(event)
            if tuple(urls) != self.sender.members or self._group_stale:
                self._group_stale = False
                await self.sender.form(urls)
            answers = await self.sender.push(state, event.version)
        except (GroupError, OSError, ManifestError) as e:
            answers = [UpdateResult(url=u, success=False, message=str(e)) for u in urls]
        results = {}
        for r in answers:
            res = SyncResult(
                url=r.url,
                version=event.version,
                success=r.success,
                message=r.message,
                seconds=time.perf_counter() - t0,
                started_at=started_at,
                transport="distributed",
            )
            results[r.url] = self._record_result(res, event)
        if not all(r.success for r in answers):
            n = self.broadcast_failures[event.version] = (
                self.broadcast_failures.get(event.version, 0) + 1
            )
            for r in answers:  # ask them again: a dead one drops out of the next group
                self.served.pop(r.url, None)
            log.warning(
                "weight_sync.broadcast.failed",
                version=event.version,
                attempt=n,
                of=self.cfg.broadcast_attempts,
                then="disk" if n >= self.cfg.broadcast_attempts else "retry",
            )
        return results

    async def _record_state(self, event: WeightsPublished) -> dict[str, torch.Tensor]:
        """The tensors of ``event``'s export (its safetensors files as the manifest lists them),
        read once per version: this is what every server checks its broadcast against."""
        if self._record is None or self._record[0] != event.version:
            self._record = None  # the old version's tensors go before the new ones are read
            self._record = (event.version, await asyncio.to_thread(_read_record, Path(event.uri)))
        return self._record[1]

    async def _behind(self, event: WeightsPublished, *, refresh: bool) -> list[str]:
        """The servers not known to serve ``event``'s version (asked again with ``refresh``), unless
        they wait for a retry."""

        async def one(url: str) -> bool:
            if time.monotonic() < self.retry_at.get(url, 0.0):
                return False
            if refresh or url not in self.served:
                actual = await self._actual(url)
                if actual is None:
                    return False
                if self.sender and url in self.sender.members and actual != self.served.get(url):
                    self._group_stale = True  # restarted (or reloaded by someone else)
                self.served[url] = actual
                self.metrics.served(url, actual)
            if self.served[url] == event.version:
                if refresh:
                    self._mark_in_use(url, event)  # confirmed again: keep the marker fresh
                return False
            return True

        flags = await asyncio.gather(*(one(u) for u in self.clients))
        return [url for url, behind in zip(self.clients, flags, strict=True) if behind]

    def report(self) -> dict[str, str]:
        """Each server's known version (``unknown``: never answered), logged as
        ``weight_sync.report``."""
        state = {u: self.served.get(u, "unknown") for u in self.clients}
        desired = self.desired.version if self.desired else None
        log.info("weight_sync.report", desired=desired, servers=state, converged=self.converged())
        return state

    def converged(self) -> bool:
        """Every server is known to serve the desired version."""
        d = self.desired
        return (
            d is not None
            and bool(self.clients)
            and all(self.served.get(u) == d.version for u in self.clients)
        )

    async def run(
        self, nats: NatsOptions | str, stop: asyncio.Event, *, once: bool = False
    ) -> bool:
        """Follow announcements until ``stop``; with ``once``, one round for the latest version.

        Returns True when every server serves the desired version at exit.
        """
        opts = NatsOptions(url=nats) if isinstance(nats, str) else nats
        async with AsyncExitStack() as stack:
            nc = await connect(opts, name=f"weight-sync-{self.run_id}")
            stack.push_async_callback(nc.close)
            stack.push_async_callback(self.close)
            js = nc.jetstream()
            await wait_for_streams(js, STREAMS_USED, timeout_s=opts.streams_timeout_s)
            latest = await _latest(js, self.run_id)
            if latest is not None:
                self.offer(latest)
            if once:
                await self.sync(refresh=True)
                self.report()
                return self.converged()
            sub = await nc.subscribe(weights_subject(self.run_id), cb=self._on_msg)
            stack.push_async_callback(sub.unsubscribe)
            last_refresh = time.monotonic()
            while not stop.is_set():
                refresh = time.monotonic() - last_refresh >= self.cfg.reconcile_interval_s
                if refresh:
                    last_refresh = time.monotonic()
                await self.sync(refresh=refresh)
                self._wake.clear()
                waits = [
                    asyncio.ensure_future(self._wake.wait()),
                    asyncio.ensure_future(stop.wait()),
                ]
                await asyncio.wait(
                    waits, timeout=self._next_wait(), return_when=asyncio.FIRST_COMPLETED
                )
                for w in waits:
                    w.cancel()
        return self.converged()

    def _next_wait(self) -> float:
        now = time.monotonic()
        pending = [t - now for t in self.retry_at.values()]
        return max(0.05, min([self.cfg.reconcile_interval_s, *pending]))

    async def _on_msg(self, msg: object) -> None:
        data = getattr(msg, "data", b"")
        headers = getattr(msg, "headers", None) or {}
        try:
            self.offer(decode_weights(data, headers.get(CODEC_HEADER)))
        except ProtocolError as e:
            log.warning("weight_sync.announcement.undecodable", error=str(e))


def _read_record(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the export at ``path``, from the safetensors files its manifest lists."""
    from safetensors.torch import load_file

    files = sorted(n for n in manifest_files(path / "manifest.json") if n.endswith(".safetensors"))
    if not files:
        raise ManifestError(f"{path}: the manifest lists no safetensors file")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(path / name)))
        except Exception as e:  # safetensors' own error types for a truncated or damaged file
            raise ManifestError(f"{path / name}: unreadable ({type(e).__name__}: {e})") from e
    return state


async def _latest(js: object, run_id: str) -> WeightsPublished | None:
    try:
        raw = await js.get_last_msg(WEIGHTS.name, weights_subject(run_id))  # type: ignore[attr-defined]
    except NotFoundError:
        return None
    headers = raw.headers or {}
    try:
        return decode_weights(raw.data, headers.get(CODEC_HEADER))
    except ProtocolError as e:
        log.warning("weight_sync.announcement.undecodable", error=str(e))
        return None
