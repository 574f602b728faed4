"""Weights over the wire (services/weight_sync/broadcast.py, services/inference/weight_group.py) on
real processes: ``leafe inference`` children on the tiny model in a gloo group with this process as
rank 0. A broadcast leaves every engine with the export's exact bytes; an engine killed in the
middle of one costs the others nothing and comes back at the latest version from disk; an
announcement that does not match the version's export is refused and the old weights keep
serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leafe.actors.client import SGLangClient
from leafe.learner.model_io import export_weights, load_model
from leafe.protocol import WeightsPublished
from leafe.services.weight_sync.broadcast import WeightSender
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig
from tests.support.engines import EngineSet, served_weights

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _export(model: Path, store: Path, index: int, scale: float) -> WeightsPublished:
    """The model's weights times ``scale`` exported as version ``index``, and its
    announcement."""
    version = f"v{index:06d}"
    state = {k: v * scale for k, v in load_model(model).state_dict().items()}
    digest = export_weights(state, store / version, config_dir=model, version=version)
    return WeightsPublished(
        event_id=f"weights.r1.{version}",
        run_id="r1",
        version=version,
        uri=str(store / version),
        manifest_sha256=digest,
        learner_step=index,
        base_model="tiny",
        ts=time.time(),
    )


def _file_tensors(event: WeightsPublished) -> dict[str, torch.Tensor]:
    return load_file(str(Path(event.uri) / "model.safetensors"))


@pytest.fixture
def admin_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight sync reads the engines' admin key from the environment, as in a run."""
    monkeypatch.setenv("LEAFE_ENGINE_ADMIN_KEY_FILE", str(tmp_path / "engines" / "admin-key"))


def _sync(urls: list[str]) -> WeightSync:
    cfg = WeightSyncConfig(
        servers=urls,
        transport="distributed",
        reconcile_interval_s=0.5,
        retry_backoff_s=0.1,
        broadcast_timeout_s=60.0,
        reload_lease=False,
    )
    return WeightSync(cfg, run_id="r1")


async def _until(sync: WeightSync, done, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not converged: {sync.results}"
        await sync.sync(refresh=True)
        await asyncio.sleep(0.2)


@pytest.mark.usefixtures("admin_env")
async def test_two_engines_hold_the_exports_exact_bytes_after_a_broadcast(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """v1 reaches two fresh engines by disk (the record first), v2 over their gloo group: both then
    serve v2, and every parameter they serve equals the export's tensors bit for bit."""
    store = tmp_path / "store"
    async with EngineSet(model=tiny_dir, root=store, workdir=tmp_path / "engines", n=2) as engines:
        sync = _sync(engines.urls)
        try:
            sync.offer(_export(tiny_dir, store, 1, 1.01))
            first = await sync.sync()
            assert {r.transport for r in first.values()} == {"disk"}
            assert all(r.success for r in first.values()), first
            v2 = _export(tiny_dir, store, 2, 0.97)
            sync.offer(v2)
            second = await sync.sync()
        finally:
            await sync.close()
        assert sorted(second) == sorted(engines.urls)
        assert all(r.success and r.transport == "distributed" for r in second.values()), second
        expected = _file_tensors(v2)
        for e in engines.engines:
            assert await engines.version(e) == "v000002"
            served = await served_weights(engines, e, sorted(expected))
            for name, t in expected.items():
                got = torch.tensor(served[name], dtype=torch.float32)
                assert torch.equal(got.view(torch.int32), t.view(torch.int32)), name


@pytest.mark.usefixtures("admin_env")
async def test_an_engine_killed_mid_broadcast_costs_the_others_nothing(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Engine B is frozen while v3 is broadcast, then killed: the broadcast fails, is retried
    without B, and A serves v3; B, restarted at ``default``, loads v3 from disk and joins the
    group again, so v4 reaches both over the wire."""
    store = tmp_path / "store"
    async with EngineSet(model=tiny_dir, root=store, workdir=tmp_path / "engines", n=2) as engines:
        a, b = engines.engines
        sync = _sync(engines.urls)
        try:
            for i, scale in ((1, 1.01), (2, 0.98)):
                sync.offer(_export(tiny_dir, store, i, scale))
                assert all(r.success for r in (await sync.sync()).values())
            assert sync.sender is not None and sync.sender.members == (a.url, b.url)
            assert b.proc is not None
            os.kill(b.proc.pid, signal.SIGSTOP)  # B stops reading: the broadcast blocks on it
            sync.offer(_export(tiny_dir, store, 3, 1.03))
            push = asyncio.create_task(sync.sync())
            await asyncio.sleep(2.0)
            assert not push.done(), "the broadcast waits for the frozen engine"
            engines.kill(b)
            failed = await asyncio.wait_for(push, 60)
            assert not all(r.success for r in failed.values())
            await _until(sync, lambda: sync.served.get(a.url) == "v000003")
            assert await engines.version(a) == "v000003"
            assert sync.sender.members == (a.url,), "the group re-formed without B"
            await engines.restart(b)
            await _until(sync, lambda: sync.served.get(b.url) == "v000003")
            assert sync.results[b.url].transport == "disk", "a restarted engine loads the record"
            v4 = _export(tiny_dir, store, 4, 0.99)
            sync.offer(v4)
            last = await sync.sync()
        finally:
            await sync.close()
        assert all(r.success and r.transport == "distributed" for r in last.values()), last
        assert [await engines.version(e) for e in (a, b)] == ["v000004", "v000004"]


@pytest.mark.usefixtures("admin_env")
async def test_a_wrong_shape_or_dtype_is_refused_and_the_old_weights_serve(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A push announcing a tensor with another shape, or another dtype, than the version's export
    is refused by every engine with a message naming the tensor and both values; the engines keep
    serving ``default`` with its weights; the right push then succeeds."""
    store = tmp_path / "store"
    v1 = _export(tiny_dir, store, 1, 1.02)
    right = _file_tensors(v1)
    name = "model.layers.0.mlp.down_proj.weight"
    async with EngineSet(model=tiny_dir, root=store, workdir=tmp_path / "engines", n=2) as engines:
        before = await served_weights(engines, engines.engines[0], [name])
        clients = {
            u: SGLangClient([u], retries=1, admin_key_file=engines.admin_key_file)
            for u in engines.urls
        }
        sender = WeightSender(
            clients,
            master_address="127.0.0.1",
            port=0,
            backend="gloo",
            timeout_s=60.0,
            bucket_bytes=1 << 20,
            run_id="r1",
        )
        try:
            cases = [
                ({**right, name: right[name][:-1]}, "shape"),
                ({**right, name: right[name].to(torch.bfloat16)}, "bfloat16"),
            ]
            for state, word in cases:
                await sender.form(engines.urls)
                results = await sender.push(state, "v000001")
                assert not any(r.success for r in results)
                for r in results:
                    assert name in r.message and word in r.message, r.message
                assert [await engines.version(e) for e in engines.engines] == ["default"] * 2
                assert await served_weights(engines, engines.engines[0], [name]) == before
            await sender.form(engines.urls)
            results = await sender.push(right, "v000001")
        finally:
            await sender.disband()
            for c in clients.values():
                await c.close()
        assert all(r.success for r in results), results
        assert [await engines.version(e) for e in engines.engines] == ["v000001"] * 2
        after = await served_weights(engines, engines.engines[1], [name])
        assert torch.equal(torch.tensor(after[name]), right[name])


async def test_an_announcement_unlike_the_export_is_refused_before_any_byte(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """An engine compares the announced names, dtypes and shapes with the version's export before
    it receives anything: a wrong dtype is answered at once, naming the tensor, with no tensor
    ever sent (before, it waited for the whole broadcast and judged after; with two engines the
    first refusal killed the sender while the other was still receiving, so that one answered
    "broadcast failed" instead of naming the tensor)."""
    store = tmp_path / "store"
    v1 = _export(tiny_dir, store, 1, 1.02)
    right = _file_tensors(v1)
    name = "model.layers.0.mlp.down_proj.weight"
    async with EngineSet(model=tiny_dir, root=store, workdir=tmp_path / "engines", n=1) as engines:
        client = SGLangClient(engines.urls, retries=1, admin_key_file=engines.admin_key_file)
        sender = WeightSender(
            {engines.urls[0]: client},
            master_address="127.0.0.1",
            port=0,
            backend="gloo",
            timeout_s=60.0,
            bucket_bytes=1 << 20,
            run_id="r1",
        )
        try:
            await sender.form(engines.urls)
            formed = sender._formed
            assert formed is not None
            names = list(right)
            payload = {
                "names": names,
                "dtypes": ["bfloat16" if n == name else "float32" for n in names],
                "shapes": [list(right[n].shape) for n in names],
                "group_name": formed.name,
                "weight_version": "v000001",
            }
            # no tensor is sent: an engine that waits for the broadcast does not answer in time
            [result] = await asyncio.wait_for(
                client.weight_route("/update_weights_from_distributed", payload), 20.0
            )
        finally:
            await sender.disband()
            await client.close()
        assert not result.success
        assert name in result.message and "bfloat16" in result.message, result.message
        assert await engines.version(engines.engines[0]) == "default"
