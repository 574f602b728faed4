"""Shared fixtures: a real nats-server per test session, with authorization on (every role of
deploy's permissions.json as a user) and the LEAFE streams created once by the admin; and a cache
that never touches the user's home (``$LEAFE_CACHE`` when set, as ``make test`` does, else a temp
dir).

NATS identities: ``nats_roles`` (each role's ``NatsOptions``, its own nkey seed: what a service runs
with), ``nats_admin`` (the admin's), and ``nats_url``, a URL carrying an admin password user's
credentials, for the tests that are not about permissions (tests/integration/test_nats_auth.py is).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from leafe.services.bus import NatsOptions, connect, ensure_streams
from leafe.services.bus.nats_server import EmbeddedNats
from tests.support.naming import run_id_for
from tests.support.nats_auth import NatsIdentities, RoleClient, make_identities


@pytest.hookimpl(trylast=True)  # after pytest's own tmpdir plugin has set up its factory
def pytest_configure(config: pytest.Config) -> None:
    """Point ``$LEAFE_CACHE`` at a per-session temp dir when it is unset, before any test or
    subprocess reads it (models and generated games then never land in ``~/.cache/leafe``)."""
    if not os.environ.get("LEAFE_CACHE"):
        os.environ["LEAFE_CACHE"] = str(config._tmp_path_factory.mktemp("leafe-cache"))  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """structlog's defaults after every test: a CLI called in-process (``replay.main`` configures
    level ``error``) must not leave its configuration to later tests, whose ``capture_logs`` would
    then miss warnings (an order-dependent failure of test_fileformat after test_replayer)."""
    yield
    import structlog

    structlog.reset_defaults()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """nats-py is asyncio-only."""
    return "asyncio"


@pytest.fixture(scope="session")
def nats_identities(tmp_path_factory: pytest.TempPathFactory) -> NatsIdentities:
    """The session server's users: a fresh nkey per role (seed files 0600) and an admin password."""
    return make_identities(tmp_path_factory.mktemp("nats-keys"))


async def _create_streams(admin: NatsOptions) -> None:
    nc = await connect(admin, name="tests-streams")
    try:
        await ensure_streams(nc.jetstream())
    finally:
        await nc.close()


@pytest.fixture(scope="session")
def nats_server(
    tmp_path_factory: pytest.TempPathFactory, nats_identities: NatsIdentities
) -> Iterator[EmbeddedNats]:
    """One real nats-server with JetStream for the whole test run, on a free port and a temp store,
    that admits only the users of ``nats_identities``; the streams exist before any test (services
    only wait for them, as in a deployment where `leafe streams ensure` makes them)."""
    store = tmp_path_factory.mktemp("jetstream")
    server = EmbeddedNats(store, log_file=store / "nats.log", users=nats_identities.users()).start()
    try:
        asyncio.run(_create_streams(nats_identities.options(server.url)["admin"]))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_roles(
    nats_server: EmbeddedNats, nats_identities: NatsIdentities
) -> dict[str, NatsOptions]:
    """Each role's client options on the session server (``actor``, ``replayer``, ``learner``,
    ``weight-sync``, ``admin``): the URL and that role's own nkey seed file."""
    return nats_identities.options(nats_server.url)


@pytest.fixture
def nats_admin(nats_roles: dict[str, NatsOptions]) -> NatsOptions:
    """The admin's options: may do anything on the LEAFE subjects and the JetStream API."""
    return nats_roles["admin"]


@pytest.fixture
async def admin_client(nats_admin: NatsOptions) -> AsyncIterator[RoleClient]:
    """A connection as the admin that records permission violations (to set a scene and check
    outcomes)."""
    async with RoleClient(nats_admin) as client:
        yield client


@pytest.fixture
def nats_url(nats_server: EmbeddedNats, nats_identities: NatsIdentities) -> str:
    """URL of the session's nats-server carrying the admin password user's credentials
    (``nats://admin:<password>@host:port``; logged redacted), for tests not about permissions."""
    return nats_identities.admin_url(nats_server.url)


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
    from leafe.learner.model_io import tiny_model_dir

    return tiny_model_dir(cache_dir)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test (on a shared 2-core CPU, 2 threads spin-wait: ~2x
    slower)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def dist_env() -> Iterator[object]:
    """A one-rank gloo process group for the whole session (the plain-python path of the
    trainer)."""
    from leafe.learner.distributed import init_distributed, shutdown

    env = init_distributed("gloo")
    yield env
    shutdown(env)
