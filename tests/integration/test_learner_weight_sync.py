"""``leafe weight-sync`` (services/weight_sync/main.py) against a real nats-server and a real CPU
inference server: the latest announcement is applied on start, and an export whose manifest does not
match the announced sha256 is never sent to a server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from leafe.actors.client import SGLangClient
from leafe.learner.model_io import export_weights, load_model
from leafe.protocol import WeightsPublished, weights_subject
from leafe.services.bus import Publisher, connect, ensure_streams
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


@pytest.fixture
async def server(tiny_dir: Path, tmp_path: Path) -> AsyncIterator[str]:
    """One CPU inference server on the tiny model, loading exports under the test's tmp_path."""
    async with InferenceServer(
        InferenceConfig(model=str(tiny_dir), port=0, threads=1, weights_root=str(tmp_path))
    ) as s:
        yield s.url


async def _announce(
    nats_url: str, run_id: str, tiny_dir: Path, out: Path, version: str, sha: str | None
) -> None:
    state = {k: v * 1.01 for k, v in load_model(tiny_dir).state_dict().items()}
    digest = export_weights(state, out, config_dir=tiny_dir, version=version)
    event = WeightsPublished(
        event_id=f"weights.{run_id}.{version}",
        run_id=run_id,
        version=version,
        uri=str(out),
        manifest_sha256=sha or digest,
        learner_step=1,
        base_model="tiny",
        ts=time.time(),
    )
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    async with Publisher(js) as pub:
        await pub.publish(weights_subject(run_id), event)
    await nc.close()


async def _version(url: str) -> str:
    async with SGLangClient(url) as client:
        return await client.weight_version()


async def test_once_applies_the_latest_announcement(
    nats_url: str, run_id: str, tiny_dir: Path, tmp_path: Path, server: str
) -> None:
    """Announced before weight-sync starts: `--once` still finds it (last message of the subject),
    loads it into the server, reports success and records the server's version in the store's in-use
    marks."""
    await _announce(nats_url, run_id, tiny_dir, tmp_path / "store" / "v000001", "v000001", None)
    await _announce(nats_url, run_id, tiny_dir, tmp_path / "store" / "v000002", "v000002", None)
    sync = WeightSync(WeightSyncConfig(servers=[server]), run_id=run_id)
    assert await asyncio.wait_for(sync.run(nats_url, asyncio.Event(), once=True), 60)
    assert sync.results[server].success and sync.results[server].version == "v000002"
    assert await _version(server) == "v000002"
    from leafe.learner.weight_store import in_use_versions

    assert in_use_versions(tmp_path / "store") == {"v000002"}


async def test_an_export_not_matching_its_announcement_is_not_loaded(
    nats_url: str, run_id: str, tiny_dir: Path, tmp_path: Path, server: str
) -> None:
    """A manifest whose sha256 differs from the announced one (half-written, tampered) is refused
    before any server is asked to load it: the server keeps its weights and weight-sync does not
    converge."""
    await _announce(nats_url, run_id, tiny_dir, tmp_path / "v000001", "v000001", "0" * 64)
    sync = WeightSync(WeightSyncConfig(servers=[server]), run_id=run_id)
    assert not await asyncio.wait_for(sync.run(nats_url, asyncio.Event(), once=True), 60)
    assert sync.results == {}
    assert await _version(server) == "default"


async def test_an_announcement_without_a_manifest_hash_is_refused(
    nats_url: str, run_id: str, tiny_dir: Path, tmp_path: Path, server: str
) -> None:
    """An announcement with an empty sha256 cannot be checked against anything: never loaded."""
    await _announce(nats_url, run_id, tiny_dir, tmp_path / "v000001", "v000001", "")
    sync = WeightSync(WeightSyncConfig(servers=[server]), run_id=run_id)
    sync.offer(
        WeightsPublished(
            event_id="w",
            run_id=run_id,
            version="v000009",
            uri=str(tmp_path / "v000001"),
            manifest_sha256="",
            learner_step=1,
            base_model="tiny",
        )
    )
    assert sync.desired is None
    assert await _version(server) == "default"


async def test_markers_are_named_by_host_and_url(
    nats_url: str, run_id: str, tiny_dir: Path, tmp_path: Path, server: str
) -> None:
    """The marker is written under ``.in_use/`` and named by weight-sync's host as well as the URL,
    so the sidecars of one Deployment (each calling its own engine at 127.0.0.1) do not overwrite
    each other."""
    import re

    from leafe.learner.weight_store import IN_USE_DIR, in_use_versions

    store = tmp_path / "store"
    await _announce(nats_url, run_id, tiny_dir, store / "v000001", "v000001", None)
    sync = WeightSync(WeightSyncConfig(servers=[server]), run_id=run_id)
    assert await asyncio.wait_for(sync.run(nats_url, asyncio.Event(), once=True), 60)
    markers = [p for p in (store / IN_USE_DIR).iterdir() if p.is_file()]  # reload/ holds the lease
    assert in_use_versions(store) == {"v000001"} and len(markers) == 1
    assert markers[0].name.startswith(re.sub(r"[^A-Za-z0-9_.-]+", "_", sync.host))
