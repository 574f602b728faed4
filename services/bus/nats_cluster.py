"""A local NATS JetStream cluster: N real nats-server processes on loopback, routed to each other.

Each node is an :class:`~leafe.services.bus.nats_server.EmbeddedNats` with its own client, route and
monitoring port and its own JetStream store, so streams created with ``num_replicas=3`` are
replicated with Raft exactly as on the 3-node StatefulSet in deploy/. The cluster tests use it to
kill and restart single nodes; ``leafe nats --store DIR --cluster 3`` runs one by hand.

    with NatsCluster(tmp / "nats", size=3) as cluster:   # start() waits until every node is healthy
        nc = await connect(cluster.url)                  # "nats://127.0.0.1:p0,nats://...:p1,..."
        cluster.kill(0); cluster.restart(0)              # SIGKILL, then the same ports and store
        cluster.wait_healthy(0)                          # JetStream caught up on that node
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import structlog

from leafe.services.bus.nats_server import ClusterRoutes, EmbeddedNats, NatsServerError, free_port

__all__ = ["NatsCluster"]

log = structlog.get_logger(__name__)


class NatsCluster:
    """``size`` clustered nats-server nodes with JetStream, named ``n0``, ``n1``, ... (see module
    doc)."""

    def __init__(
        self, root: Path, *, size: int = 3, host: str = "127.0.0.1", name: str = "leafe"
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got size={size}")
        self.root = Path(root)
        self._size, self._host, self._name = size, host, name
        self.nodes = self._plan()

    def _plan(self) -> list[EmbeddedNats]:
        """Nodes on freshly picked free ports (a port free when picked can be taken before its node
        binds)."""
        host, size = self._host, self._size
        route_ports = [free_port(host) for _ in range(size)]
        routes = tuple(f"nats-route://{host}:{p}" for p in route_ports)
        return [
            EmbeddedNats(
                self.root / f"n{i}",
                host=host,
                log_file=self.root / f"n{i}.log",
                server_name=f"n{i}",
                cluster=ClusterRoutes(
                    name=self._name, port=route_ports[i], routes=routes[:i] + routes[i + 1 :]
                ),
                monitor_port=free_port(host),
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``leafe.services.bus.connect`` takes)."""
        return ",".join(node.url for node in self.nodes)

    def index_of(self, server_name: str) -> int:
        """The index of the node called ``server_name`` (e.g. a stream's leader from
        ``stream_info``)."""
        for i, node in enumerate(self.nodes):
            if node.server_name == server_name:
                return i
        raise KeyError(f"no node named {server_name!r} in {[n.server_name for n in self.nodes]}")

    def start(self, timeout_s: float = 60.0, attempts: int = 3) -> NatsCluster:
        """Start every node, then wait until each reports JetStream healthy (a meta leader elected).
        A node that cannot bind a port another process took since it was picked makes the whole
        cluster start again on new ports (up to ``attempts`` times; the stores are empty at first
        start)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, attempts + 1):
            try:
                for node in self.nodes:
                    node.start(timeout_s)
                break
            except NatsServerError as e:
                self.stop()
                if attempt == attempts or "in use" not in self._log_tails():
                    raise
                log.warning("nats.cluster.port_taken", attempt=attempt, error=str(e)[:200])
                shutil.rmtree(self.root, ignore_errors=True)  # the first start's stores and logs
                self.root.mkdir(parents=True, exist_ok=True)
                self.nodes = self._plan()
        try:
            deadline = time.monotonic() + timeout_s
            for i in range(len(self.nodes)):
                self.wait_healthy(i, max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def health(self, i: int) -> tuple[bool, str]:
        """``(healthy, detail)`` of node ``i`` from its ``/healthz`` (JetStream current with the
        cluster)."""
        node = self.nodes[i]
        url = f"http://{node.host}:{node.monitor_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return resp.status == 200, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:  # 503 while JetStream is not current
            return False, e.read().decode("utf-8", "replace")
        except OSError as e:  # not listening (yet): down or starting
            return False, f"{type(e).__name__}: {e}"

    def wait_healthy(self, i: int, timeout_s: float = 60.0) -> float:
        """Wait until node ``i`` is healthy; returns the seconds waited (raises after
        ``timeout_s``)."""
        t0 = time.monotonic()
        detail = ""
        while time.monotonic() - t0 < timeout_s:
            ok, detail = self.health(i)
            if ok:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise NatsServerError(
            f"nats node n{i} ({self.nodes[i].url}) not healthy after {timeout_s:.0f}s: "
            f"{detail.strip()}"
        )

    def jsz(self, i: int) -> dict[str, object]:
        """Node ``i``'s ``/jsz`` (JetStream state: meta leader, stream counts) as a dict."""
        node = self.nodes[i]
        with urllib.request.urlopen(
            f"http://{node.host}:{node.monitor_port}/jsz", timeout=2.0
        ) as resp:
            data = json.loads(resp.read())
        if not isinstance(data, dict):
            raise NatsServerError(f"unexpected /jsz answer from n{i}: {data!r}")
        return data

    def _log_tails(self) -> str:
        tails = []
        for node in self.nodes:
            path = node.log_file
            if path is not None and path.is_file():
                tails.append(path.read_text(encoding="utf-8", errors="replace")[-2000:])
        return "\n".join(tails)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its store keeps what it had written)."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout_s: float = 20.0) -> None:
        """Start node ``i`` again on the same ports and store (it rejoins and catches up)."""
        self.nodes[i].start(timeout_s)

    def stop(self) -> None:
        """Stop every node (SIGTERM, SIGKILL after a grace period)."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
