"""``services/probes.py``: the /healthz verdicts and the metrics server that answers them (no NATS
here; tests/integration/test_probes.py drops a real connection)."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from leafe.services.bus.nats_server import free_port
from leafe.services.metrics import MetricsServer, serve_metrics
from leafe.services.probes import MAX_CONNECTIONS, REQUEST_DEADLINE_S, Probe, attach


class _Conn:
    """The three flags a probe reads off a nats-py client."""

    def __init__(self) -> None:
        self.is_connected, self.is_reconnecting, self.is_closed = True, False, False


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_healthy_only_when_connected_bound_and_recent() -> None:
    """Each condition in turn: no connection, no consumer, stale progress, a dropped connection."""
    clock, conn = _Clock(), _Conn()
    probe = Probe("replayer", stale_after_s=30.0, clock=clock)
    assert probe.check() == (False, "replayer: not connected to NATS yet")
    probe.connected(conn)
    assert probe.check() == (False, "replayer: consumer not bound")
    clock.now += 100  # startup took long: binding counts as progress
    probe.bound("replayer-r1-leafe")
    ok, reason = probe.check()
    assert ok and "consumer replayer-r1-leafe" in reason
    clock.now += 31
    assert probe.check() == (False, "replayer: no progress for 31 s (limit 30 s)")
    probe.progress()
    assert probe.check()[0]
    conn.is_connected, conn.is_reconnecting = False, True
    assert probe.check() == (False, "replayer: NATS connection reconnecting")
    conn.is_reconnecting, conn.is_closed = False, True
    assert probe.check() == (False, "replayer: NATS connection closed")
    conn.is_connected = True
    probe.unbound()
    assert probe.check() == (False, "replayer: consumer not bound")


def test_stale_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stale_after_s = 0"):
        Probe("actor", stale_after_s=0)


@pytest.fixture
def served() -> Iterator[tuple[str, CollectorRegistry]]:
    registry = CollectorRegistry()
    Counter("leafe_probe_test", "a counter", registry=registry).inc()
    server = serve_metrics(free_port(), registry, "127.0.0.1")
    assert isinstance(server, MetricsServer)
    try:
        yield f"http://127.0.0.1:{server.port}", registry
    finally:
        server.close()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_server_answers_healthz_from_the_attached_probe(
    served: tuple[str, CollectorRegistry],
) -> None:
    """/metrics is served as before; /healthz is 200 with no probe, then the probe's verdict as
    200/503 with its one-line reason."""
    url, registry = served
    status, text = _get(url + "/metrics")
    assert status == 200 and "leafe_probe_test_total 1.0" in text
    assert _get(url + "/healthz") == (200, "no probe attached: nothing to check\n")
    clock, conn = _Clock(), _Conn()
    probe = Probe("actor", stale_after_s=10.0, clock=clock)
    attach(registry, probe)
    probe.connected(conn)
    assert _get(url + "/healthz") == (503, "actor: consumer not bound\n")
    probe.bound("actors-r1")
    status, text = _get(url + "/healthz")
    assert status == 200 and text.startswith("actor: ok") and text.count("\n") == 1
    clock.now += 11
    assert _get(url + "/healthz") == (503, "actor: no progress for 11 s (limit 10 s)\n")


def test_idle_connections_are_bounded_and_time_out(served: tuple[str, CollectorRegistry]) -> None:
    """100 connections that never send a request hold no thread each, at most
    ``MAX_CONNECTIONS`` of them stay open (the oldest is closed for a newer one), every one is
    closed by the deadline for the whole request, and then /healthz answers. Once, 164 idle
    connections held 170 threads for as long as they stayed open."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    before = threading.active_count()
    socks = [
        socket.create_connection(("127.0.0.1", port), timeout=REQUEST_DEADLINE_S + 5)
        for _ in range(100)
    ]
    try:
        time.sleep(0.5)
        assert threading.active_count() == before
        closed_at_once = select.select(socks, [], [], 0)[0]
        assert len(closed_at_once) >= len(socks) - MAX_CONNECTIONS
        assert [s.recv(1) for s in socks] == [b""] * 100  # every one closed by the server
    finally:
        for s in socks:
            s.close()
    assert _get(url + "/healthz")[0] == 200


HEAD = b"GET /metrics HTTP/1.1\r\nX-Slow: "


def _slow_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` connections, each opened in turn and sending the start of a request head that never
    ends (:data:`HEAD`)."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(HEAD)
        socks.append(s)
        time.sleep(0.02)  # one at a time, as a client would open them: each is accepted
    return socks


def _trickle(socks: list[socket.socket], every_s: float, rounds: int) -> list[int]:
    """Send one more byte of the endless request head on every open socket each ``every_s`` (a
    slowloris: each read arrives well inside any per-read timeout); returns the sends each got in
    (:data:`HEAD` counts one) before the server closed it (-1: still open after ``rounds``)."""
    sent = [1] * len(socks)
    open_ = set(range(len(socks)))
    for s in socks:
        s.setblocking(False)
    for _ in range(rounds):
        for i in sorted(open_):
            try:
                socks[i].send(b"a")
                sent[i] += 1
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # reset or broken pipe: the server closed it
                open_.discard(i)
        deadline = time.monotonic() + every_s
        while open_ and (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([socks[i] for i in open_], [], [], left)
            for s in readable:
                i = socks.index(s)
                try:
                    if s.recv(4096) == b"":
                        open_.discard(i)
                except OSError:
                    open_.discard(i)
        if not open_:
            break
    return [-1 if i in open_ else n for i, n in enumerate(sent)]


def test_trickling_connections_cannot_keep_healthz_from_answering(
    served: tuple[str, CollectorRegistry],
) -> None:
    """70 connections each sending one byte of a request every 2 s (inside any per-read timeout):
    /healthz still answers 200 while they trickle, and each of them is closed by the server's
    deadline for the whole request. Before: a 3 s timeout per read only, so 64 of them held every
    connection slot for as long as they kept trickling and /healthz was closed unanswered."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    socks = _slow_connections(port, 70)
    result: list[int] = []
    trickler = threading.Thread(target=lambda: result.extend(_trickle(socks, 2.0, rounds=15)))
    trickler.start()
    try:
        time.sleep(3.0)  # every connection has sent again: each is a live, slow request
        assert trickler.is_alive()
        assert _get(url + "/healthz") == (200, "no probe attached: nothing to check\n")
        trickler.join()
    finally:
        for s in socks:
            s.close()
    assert -1 not in result, f"{result.count(-1)} trickling connections were never closed"
    assert max(result) <= 2 + int(REQUEST_DEADLINE_S / 2), result
