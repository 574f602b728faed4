"""The gpu topology on CPU: the actors' client -> sglang-router 0.3.2 (the real one, as deploy/ runs it) ->
two ``leafe inference`` servers, each with a weight sync of its own as the SGLang pods' sidecars have.
Requests, seeds, readiness, weight versions and a push under load all go through the router (issue 38,
items 1 and 2). Needs ``sglang-router==0.3.2`` (the dev extra)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from actors.client import SGLangClient
from actors.engine import SamplingParams
from learner.model_io import export_weights, load_model
from protocol import WeightsPublished, weights_subject
from services.bus import NatsOptions, Publisher, connect
from services.inference.auth import write_api_key
from services.inference.server import InferenceConfig, InferenceServer
from services.run.router import RouterProcess, open_router, router_available
from services.weight_sync.service import WeightSync, WeightSyncConfig

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not router_available(), reason="pip install sglang-router==0.3.2 (the dev extra)"),
]

PROMPT = [1, 504, 3180, 288, 260, 1542]


@dataclass
class Topology:
    """The router in front of two engines, and the API key file every client needs."""

    router: RouterProcess
    servers: list[InferenceServer]
    engines: list[str]
    key_file: str
    store: Path
    model: Path

    def client(self, **kw: float) -> SGLangClient:
        """The actors' client through the router (deploy's actor.toml: one retry)."""
        return SGLangClient(self.router.url, retries=1, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def topology(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Topology]:
    """Two CPU engines (one API key, exports loadable from ``tmp_path/store``) behind the router; every
    client finds the key through ``$LEAFE_ENGINE_API_KEY_FILE``, as deploy/'s actors and sidecars do."""
    key_file = str(write_api_key(tmp_path / "api-key"))
    monkeypatch.setenv("LEAFE_ENGINE_API_KEY_FILE", key_file)
    store = tmp_path / "store"
    store.mkdir()
    async with AsyncExitStack() as stack:
        servers = []
        for _ in range(2):
            config = InferenceConfig(
                model=str(tiny_dir), port=0, threads=1, max_batch=4, api_key_file=key_file,
                weights_root=str(store),
            )  # fmt: skip
            servers.append(await stack.enter_async_context(InferenceServer(config)))
        engines = [server.url for server in servers]
        router = await open_router(engines, tmp_path / "router.log", health_interval_s=1)
        stack.push_async_callback(router.stop, 10.0)
        yield Topology(
            router=router, servers=servers, engines=engines, key_file=key_file, store=store, model=tiny_dir
        )


async def test_seeded_samples_go_through_the_router(topology: Topology) -> None:
    """``n`` seeded samples of one prompt (Early Experience's alternatives) are accepted by the router,
    come back as ``n`` completions with distinct seeds, and the same seed gives the same samples again
    (the router passes ``sampling_seed`` on); unseeded ``n`` works too."""
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=1234)
    async with topology.client() as client:
        first = await client.generate(PROMPT, seeded, n=3)
        again = await client.generate(PROMPT, seeded, n=3)
        unseeded = await client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0), n=3)
    assert len(first) == len(unseeded) == 3
    assert [c.output_ids for c in first] == [c.output_ids for c in again]
    assert len({tuple(c.output_ids) for c in first}) > 1, "every sample had the same seed"


async def test_readiness_and_versions_through_the_router(topology: Topology) -> None:
    """The client finds the router ready (its ``/readiness``, as ``/ready`` is 404 there), and a completion
    carries the version of the engine that generated it (``meta_info.weight_version``, passed through)."""
    async with topology.client() as client:
        assert await client.ready()
        [c] = await client.generate(PROMPT, SamplingParams(max_new_tokens=2))
        assert c.weight_version == "default"
    async with SGLangClient(topology.engines) as direct:
        export = topology.store / "v000001"
        await asyncio.to_thread(_export, topology.model, export, "v000001")
        results = await direct.update_weights_from_disk(str(export), "v000001")
        assert all(r.success for r in results), results
    async with topology.client() as client:
        versions = {c.weight_version for c in await client.generate(PROMPT, _short(), n=4)}
    assert versions == {"v000001"}


async def test_an_engine_that_dies_costs_no_request(topology: Topology) -> None:
    """An engine that goes away under load (a pod evicted, a node lost) fails no request: until the
    router's checks drop it, the router answers 500 ``call_upstream_request_error`` for the requests it
    sends there (the prompts cached on it), which the client retries like a refused connection."""
    failures: list[str] = []
    async with topology.client() as client:
        prompts = [[*PROMPT, i] for i in range(8)]
        for prompt in prompts:  # cached on one engine or the other: cache-aware routing sticks to it
            await client.generate(prompt, _short())
        await topology.servers[1].stop()
        for prompt in prompts:
            try:
                await client.generate(prompt, _short())
            except Exception as e:  # what the test counts
                failures.append(f"{type(e).__name__}: {e}")
    assert not failures, failures[:3]


async def test_a_push_under_load_keeps_serving(
    topology: Topology, nats_roles: dict[str, NatsOptions], run_id: str
) -> None:
    """Both engines' weight syncs get the same WeightsPublished while generations go through the router:
    the engines load one after the other (never both at once), the router has a healthy worker at every
    probe, no generation fails, and the completions after the push carry the new version."""
    syncs = [
        WeightSync(WeightSyncConfig(servers=[url], reconcile_interval_s=1.0), run_id=run_id)
        for url in topology.engines
    ]
    stop = asyncio.Event()
    followers = [asyncio.create_task(s.run(nats_roles["weight-sync"], stop)) for s in syncs]
    probes: list[int | None] = []
    failures: list[str] = []
    generated = 0
    async with topology.client() as client:

        async def generate() -> None:
            nonlocal generated
            while not stop.is_set():
                try:
                    await client.generate(PROMPT, _short())
                    generated += 1
                except Exception as e:  # the count of failures is what this test is about
                    failures.append(f"{type(e).__name__}: {e}")

        async def probe() -> None:
            while not stop.is_set():
                probes.append(await topology.router.healthy_workers())
                await asyncio.sleep(0.1)

        loops = [asyncio.create_task(generate()) for _ in range(4)] + [asyncio.create_task(probe())]
        await asyncio.sleep(1.0)
        event = await asyncio.to_thread(
            _export, topology.model, topology.store / "v000001", "v000001", run_id
        )
        await _publish(nats_roles["learner"], event)
        await _until(lambda: all(s.converged() for s in syncs), 30.0)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*loops, *followers)
        after = await client.generate(PROMPT, _short(), n=4)
    assert not failures, failures[:3]
    assert generated > 0 and probes and all(p is not None and p >= 1 for p in probes), probes
    spans = sorted((r.started_at, r.started_at + r.seconds) for s in syncs for r in s.results.values())
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], f"both engines loaded at once: {spans}"
    assert {c.weight_version for c in after} == {"v000001"}


def _short() -> SamplingParams:
    return SamplingParams(max_new_tokens=4, temperature=1.0)


def _export(model: Path, out: Path, version: str, run_id: str = "r") -> WeightsPublished:
    """New weights (the model's, scaled) exported to ``out`` as ``version``, and their announcement."""
    state = {k: v * 1.01 for k, v in load_model(model).state_dict().items()}
    digest = export_weights(state, out, config_dir=model, version=version)
    return WeightsPublished(
        event_id=f"weights.{run_id}.{version}",
        run_id=run_id,
        version=version,
        uri=str(out),
        manifest_sha256=digest,
        learner_step=1,
        base_model="tiny",
        ts=time.time(),
    )


async def _publish(learner: NatsOptions, event: WeightsPublished) -> None:
    nc = await connect(learner)
    try:
        async with Publisher(nc.jetstream()) as pub:
            await pub.publish(weights_subject(event.run_id), event)
    finally:
        await nc.close()


async def _until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done within {timeout_s} s")
        await asyncio.sleep(0.1)
