"""``GET /healthz`` of the NATS-driven services (actor, replayer, learner), on their metrics port.

A probe that means something: 200 only while the service is connected to NATS, its durable consumer
is bound, and its loop made progress within ``stale_after_s``; otherwise 503 with a one-line reason
(the first failing condition). The service feeds its :class:`Probe`:

```python
probe = Probe("replayer", stale_after_s=300)
attach(metrics.registry, probe)          # the metrics server answers /healthz from it
probe.connected(nc); probe.bound(consumer.durable)
probe.progress()                         # every fetch returned, every event published, every step
probe.unbound()                          # consumer closed: 503 from here on
```

The metrics server (``leafe.services.metrics.serve_metrics``) is started by :func:`start_server`,
which serves the registry's ``/metrics`` as before plus ``/healthz`` of the probe :func:`attach`-ed
to that registry; 200 while none is: the process has no NATS loop to check (learner ranks other than
global rank 0, whose local rank 0 serves metrics too; the learner's rank 0 before it built its loop;
weight-sync sidecars). The probe is read from the server's thread: it only reads attributes the
service's event loop sets (no I/O, no lock), so a probe costs microseconds and answers even while
the loop is busy. Each connection gets a thread for at most :data:`IDLE_TIMEOUT_S` between reads,
and at most :data:`MAX_CONNECTIONS` at once (idle connections once held a thread each for as long as
they stayed open). deploy/base wires it as the pods' liveness and readiness probes.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = [
    "HEALTH_PATH",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "Probe",
    "attach",
    "probe_of",
    "start_server",
]

HEALTH_PATH = "/healthz"
IDLE_TIMEOUT_S = 3.0
"""A connection that sends nothing for this long is closed (kubelet and Prometheus send at once)."""
MAX_CONNECTIONS = 64
"""Connections served at once (a thread each); one past it is closed at once instead of queued."""
_PROBES: weakref.WeakKeyDictionary[CollectorRegistry, Probe] = weakref.WeakKeyDictionary()


class Probe:
    """Health of one service: NATS connection, consumer binding and the age of its last progress."""

    def __init__(
        self, service: str, *, stale_after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s = {stale_after_s!r}: must be > 0")
        self.service = service
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._nc: Any = None
        self._consumer: str | None = None
        self._last = clock()

    def connected(self, nc: Any) -> None:
        """The service's NATS connection (its ``is_connected`` is read on every check)."""
        self._nc = nc

    def bound(self, consumer: str) -> None:
        """The durable consumer ``consumer`` started (counts as progress)."""
        self._consumer = consumer
        self.progress()

    def unbound(self) -> None:
        """The consumer was closed (shutdown, or the service's loop ended)."""
        self._consumer = None

    def progress(self) -> None:
        """The service's loop made progress (a fetch returned, an event went out, a step ran)."""
        self._last = self.clock()

    def check(self) -> tuple[bool, str]:
        """``(healthy, one-line reason)``; the reason names the first failing condition."""
        nc = self._nc
        if nc is None:
            return False, f"{self.service}: not connected to NATS yet"
        if not nc.is_connected:
            state = (
                "reconnecting"
                if nc.is_reconnecting
                else "closed"
                if nc.is_closed
                else "disconnected"
            )
            return False, f"{self.service}: NATS connection {state}"
        if self._consumer is None:
            return False, f"{self.service}: consumer not bound"
        age = self.clock() - self._last
        if age > self.stale_after_s:
            return (
                False,
                f"{self.service}: no progress for {age:.0f} s (limit {self.stale_after_s:.0f} s)",
            )
        return True, f"{self.service}: ok, consumer {self._consumer}, last progress {age:.0f} s ago"


def attach(registry: CollectorRegistry, probe: Probe) -> None:
    """Answer ``/healthz`` of the metrics server serving ``registry`` from ``probe`` (replaces
    any)."""
    _PROBES[registry] = probe


def probe_of(registry: CollectorRegistry) -> Probe | None:
    """The probe attached to ``registry``, if any."""
    return _PROBES.get(registry)


def _app(registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        probe = probe_of(registry)
        ok, reason = (
            (True, "no probe attached: nothing to check") if probe is None else probe.check()
        )
        status = "200 OK" if ok else "503 Service Unavailable"
        body = (reason + "\n").encode()
        start_response(
            status,
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(
                request
            )  # at the cap: closed now, never a thread waiting for bytes
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """An idle connection timing out or a client hanging up is no error worth a traceback."""
        if not isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            super().handle_error(request, client_address)


class _Quiet(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S
    """Socket timeout of each read: an idle or trickling connection is closed, its thread freed."""

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds are not worth a log line."""


def start_server(
    port: int, host: str, registry: CollectorRegistry
) -> tuple[WSGIServer, threading.Thread]:
    """``/metrics`` of ``registry`` and ``/healthz`` of its probe on ``host:port``, in a daemon
    thread (what ``prometheus_client.start_http_server`` does, plus the probe)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_Server", (_Server,), {"address_family": family})
    httpd: WSGIServer = make_server(host, port, _app(registry), server_class, handler_class=_Quiet)
    thread = threading.Thread(
        target=httpd.serve_forever, name=f"metrics:{httpd.server_port}", daemon=True
    )
    thread.start()
    return httpd, thread
