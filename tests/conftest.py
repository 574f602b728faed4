"""Shared fixtures: a real nats-server per test session, fresh JetStream streams per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bus.nats_server import EmbeddedNats


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """nats-py is asyncio-only."""
    return "asyncio"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """One real nats-server with JetStream for the whole test run, on a free port and a temp store."""
    store = tmp_path_factory.mktemp("jetstream")
    server = EmbeddedNats(store, log_file=store / "nats.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    """URL of the session's nats-server."""
    return nats_server.url


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id unique to the test, so tests sharing the server never see each other's messages."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40].strip("-")
    return f"t{os.getpid() % 10000}-{name}"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LEAFE cache (models, generated games): the user's cache if set, else a session temp dir."""
    env = os.environ.get("LEAFE_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("leafe-cache")
