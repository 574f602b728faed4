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
the loop is busy. Every request has :data:`REQUEST_DEADLINE_S` from accept to its answer, reads and
writes together (:class:`ProbeServer`): connections trickling a byte every 2 s once held every
thread, each read being inside a per-read timeout. deploy/base wires it as the pods' liveness and
readiness probes.
"""

from __future__ import annotations

import io
import selectors
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = [
    "HEALTH_PATH",
    "MAX_CONNECTIONS",
    "REQUEST_DEADLINE_S",
    "Probe",
    "ProbeServer",
    "attach",
    "probe_of",
    "start_server",
]

HEALTH_PATH = "/healthz"
REQUEST_DEADLINE_S = 5.0
"""From accept to the last byte of the answer: a connection still reading its request head, or
still being answered, at this age is closed (kubelet and Prometheus send their request at once and
read the answer in milliseconds)."""
MAX_CONNECTIONS = 64
"""Connections waiting for their request head at once (no thread each); a newer one closes the
oldest. As many complete requests may wait for a worker; one past that is closed unanswered."""
MAX_HEAD_BYTES = 8192
"""A request head longer than this is answered 431 (a probe's is about 100 bytes)."""
WORKERS = 2
"""Threads that build and write answers (a /metrics answer is built in milliseconds)."""
_TICK_S = 0.25
"""How often the deadlines are checked when no connection has anything to read."""
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


class ProbeServer:
    """``/metrics`` and ``/healthz`` over HTTP/1.0: one selector thread reads every request head
    without a thread per connection, a few worker threads answer complete ones.

    A connection has :data:`REQUEST_DEADLINE_S` from its accept to the last byte of its answer,
    reads and writes together, so one that trickles a byte at a time is closed at the deadline
    whatever the gap between its bytes (a per-read timeout alone let 64 of them, a byte every 2 s,
    hold every thread). At most :data:`MAX_CONNECTIONS` wait for their request head at once: a newer
    one closes the oldest, so a flood of slow connections can delay a probe's answer, not refuse it
    for long."""

    def __init__(self, host: str, port: int, app: Callable[..., Iterable[bytes]]) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.socket = socket.socket(family, kind, proto)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        self.server_port = int(self.socket.getsockname()[1])
        self._app = app
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._selector.register(self._waker_r, selectors.EVENT_READ)
        self._heads: dict[socket.socket, _Head] = {}
        """Connections still reading their request head, oldest first."""
        self._answering = 0
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix=f"probe:{self.server_port}")
        self._stop = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Accept, read request heads and expire deadlines until :meth:`shutdown`."""
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=_TICK_S):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._waker_r:
                        with suppress(OSError):
                            self._waker_r.recv(64)
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it returned."""
        self._stop.set()
        with suppress(OSError):
            self._waker_w.send(b"x")
        self._stopped.wait(5.0)

    def server_close(self) -> None:
        """Close the listening socket and every open connection."""
        for sock in list(self._heads):
            self._drop(sock)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._selector.close()
        for sock in (self.socket, self._waker_r, self._waker_w):
            sock.close()

    def _accept(self) -> None:
        for _ in range(64):  # what is queued now; the selector says when more arrive
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a reset before accept: try at the next event
                return
            if len(self._heads) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._heads)))  # the oldest waits longest for nothing
            sock.setblocking(False)
            self._heads[sock] = _Head(time.monotonic() + REQUEST_DEADLINE_S)
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        head = self._heads.get(sock)
        if head is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        head.data += data
        if b"\r\n\r\n" not in head.data and len(head.data) <= MAX_HEAD_BYTES:
            return
        self._selector.unregister(sock)
        del self._heads[sock]
        with self._lock:
            busy = self._answering >= MAX_CONNECTIONS
            if not busy:
                self._answering += 1
        if busy:
            sock.close()
            return
        try:
            self._workers.submit(self._answer, sock, head)
        except RuntimeError:  # shut down meanwhile
            sock.close()

    def _expire(self, now: float) -> None:
        for sock, head in list(self._heads.items()):
            if head.deadline > now:
                break  # oldest first: the rest have later deadlines
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._heads.pop(sock, None)
        with suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)
        sock.close()

    def _answer(self, sock: socket.socket, head: _Head) -> None:
        """Answer one complete request head (in a worker thread), then close the connection."""
        try:
            status, headers, body = _respond(self._app, head.data)
            left = head.deadline - time.monotonic()
            if left > 0:
                sock.setblocking(True)
                sock.settimeout(left)  # the rest of the deadline, for the whole answer
                lines = [f"HTTP/1.0 {status}", *(f"{k}: {v}" for k, v in headers)]
                lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
                sock.sendall("\r\n".join(lines).encode("latin-1") + body)
        except OSError:  # the client left or the deadline passed while it read slowly
            pass
        finally:
            sock.close()
            with self._lock:
                self._answering -= 1


class _Head:
    """A connection's request head so far, and its deadline."""

    __slots__ = ("data", "deadline")

    def __init__(self, deadline: float) -> None:
        self.data = b""
        self.deadline = deadline


def _respond(
    app: Callable[..., Iterable[bytes]], raw: bytes
) -> tuple[str, list[tuple[str, str]], bytes]:
    """Run the WSGI ``app`` on the request head ``raw``: status, headers and body (400 for a head
    that does not parse, 431 for one over :data:`MAX_HEAD_BYTES`)."""
    if b"\r\n\r\n" not in raw:
        return "431 Request Header Fields Too Large", [], b""
    lines = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "400 Bad Request", [], b""
    method, target, protocol = parts
    path, _, query = target.partition("?")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": unquote(path),
        "QUERY_STRING": query,
        "SERVER_PROTOCOL": protocol,
        "wsgi.input": io.BytesIO(),
        "wsgi.errors": sys.stderr,
        "wsgi.url_scheme": "http",
    }
    for name in ("accept", "accept-encoding"):
        if name in fields:
            environ["HTTP_" + name.upper().replace("-", "_")] = fields[name]
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        started[:] = [status, headers]

    body = b"".join(app(environ, start_response))
    status, headers = started
    return status, [(k, v) for k, v in headers if k.lower() != "content-length"], body


def start_server(
    port: int, host: str, registry: CollectorRegistry
) -> tuple[ProbeServer, threading.Thread]:
    """``/metrics`` of ``registry`` and ``/healthz`` of its probe on ``host:port``, in a daemon
    thread (what ``prometheus_client.start_http_server`` does, plus the probe and a deadline per
    request)."""
    server = ProbeServer(host, port, _app(registry))
    thread = threading.Thread(
        target=server.serve_forever, name=f"metrics:{server.server_port}", daemon=True
    )
    thread.start()
    return server, thread
