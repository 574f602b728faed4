"""Fixtures of the cluster tests: a fresh 3-node nats-server cluster per test (helpers in
``tests/support/cluster.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from leafe.services.bus.nats_cluster import NatsCluster


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three clustered nats-server nodes with JetStream on loopback, each with its own store."""
    with NatsCluster(tmp_path / "nats", size=3) as cluster:
        yield cluster


@pytest.fixture
def replicated() -> int:
    """Replicas of every LEAFE stream the test creates (``--stream-replicas 3``, as deploy/
    does)."""
    return 3
