"""Fixtures of the cluster tests: a fresh 3-node nats-server cluster per test, and helpers to find a
stream's leader and to time how long the log takes to accept writes again after a failure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.bus.nats_cluster import NatsCluster


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three clustered nats-server nodes with JetStream on loopback, each with its own store."""
    with NatsCluster(tmp_path / "nats", size=3) as cluster:
        yield cluster


@pytest.fixture
def replicated(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every LEAFE stream created in the test gets 3 replicas (``LEAFE_STREAM_REPLICAS``, as deploy/)."""
    monkeypatch.setenv("LEAFE_STREAM_REPLICAS", "3")
    return 3


async def stream_leader(js: Any, stream: str, timeout_s: float = 30.0) -> str:
    """The server name leading ``stream`` (waits while an election is under way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return str(info.cluster.leader)
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"stream {stream} has no leader after {timeout_s}s")
        await asyncio.sleep(0.1)


async def replicas_current(js: Any, stream: str) -> bool:
    """``stream`` has a leader and all its ``num_replicas - 1`` followers online and current."""
    info = await js.stream_info(stream)
    cluster = info.cluster
    if cluster is None or not cluster.leader:
        return False
    peers = [p for p in cluster.replicas or [] if p.name != cluster.leader]
    want = (info.config.num_replicas or 1) - 1
    return len(peers) == want and all(p.current and not p.offline for p in peers)
