"""Shared fixtures: a real nats-server per test session, fresh JetStream streams per test, and a cache
that never touches the user's home (``$LEAFE_CACHE`` when set, as ``make test`` does, else a temp dir)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bus.nats_server import EmbeddedNats
from tests.support.naming import run_id_for


@pytest.hookimpl(trylast=True)  # after pytest's own tmpdir plugin has set up its factory
def pytest_configure(config: pytest.Config) -> None:
    """Point ``$LEAFE_CACHE`` at a per-session temp dir when it is unset, before any test or subprocess
    reads it (models and generated games then never land in ``~/.cache/leafe``)."""
    if not os.environ.get("LEAFE_CACHE"):
        os.environ["LEAFE_CACHE"] = str(config._tmp_path_factory.mktemp("leafe-cache"))  # type: ignore[attr-defined]


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
    """A run id unique to the test (see :func:`run_id_for`)."""
    return run_id_for(request.node.nodeid, os.getpid())


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The LEAFE cache (models, generated games): ``$LEAFE_CACHE``, set for the session above."""
    return Path(os.environ["LEAFE_CACHE"])


@pytest.fixture(scope="session")
def tiny_dir(cache_dir: Path) -> Path:
    """The tiny random Llama (2 layers, hidden 64, SmolLM2 tokenizer)."""
    from learner.model_io import tiny_model_dir

    return tiny_model_dir(cache_dir)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test (on a shared 2-core CPU, 2 threads spin-wait: ~2x slower)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def dist_env() -> Iterator[object]:
    """A one-rank gloo process group for the whole session (the plain-python path of the trainer)."""
    from learner.distributed import init_distributed, shutdown

    env = init_distributed("gloo")
    yield env
    shutdown(env)
