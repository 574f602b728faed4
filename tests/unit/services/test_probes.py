"""``services/probes.py``: the /healthz verdicts and the metrics server that answers them (no NATS
here; tests/integration/test_probes.py drops a real connection)."""

from __future__ import annotations

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
from leafe.services.probes import IDLE_TIMEOUT_S, MAX_CONNECTIONS, Probe, attach


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
    """100 connections that never send a request: at most ``MAX_CONNECTIONS`` threads serve them at
    once (the rest are closed at once), each is closed after ``IDLE_TIMEOUT_S``, and then /healthz
    answers. Without either, 164 idle connections held 170 threads for as long as they stayed
    open."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    before = threading.active_count()
    socks = [
        socket.create_connection(("127.0.0.1", port), timeout=IDLE_TIMEOUT_S + 5)
        for _ in range(100)
    ]
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_CONNECTIONS
        assert [s.recv(1) for s in socks] == [b""] * 100  # every one closed by the server
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() == before
    finally:
        for s in socks:
            s.close()
    assert _get(url + "/healthz")[0] == 200
