"""The gpu topology on CPU: the actors' client -> sglang-router 0.3.2 (the real one, as deploy/ runs
it) -> two ``leafe inference`` servers, each with a weight sync of its own as the SGLang pods'
sidecars have. Requests, seeds, readiness, weight versions and a push under load all go through the
router. Needs ``sglang-router==0.3.2`` (the dev extra)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from leafe.actors.client import SGLangClient
from leafe.actors.engine import EngineError, SamplingParams
from leafe.protocol import WeightsPublished, weights_subject
from leafe.services.bus import NatsOptions, Publisher, connect
from leafe.services.inference.auth import write_api_key
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.run.router import RouterProcess, open_router, router_available
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig
from tests.support.manifests import DEPLOY
from tests.support.weights import scaled_export

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not router_available(), reason="pip install sglang-router==0.3.2 (the dev extra)"
    ),
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
        """The actors' client through the router (deploy's actor.toml: two retries)."""
        return SGLangClient(self.router.url, retries=2, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def topology(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Topology]:
    """Two CPU engines (one API key, one admin key, exports loadable from ``tmp_path/store``)
    behind the router, keyed as ``leafe run`` keys it; every client finds the API key through
    ``$LEAFE_ENGINE_API_KEY_FILE`` and the weight syncs the admin key through
    ``$LEAFE_ENGINE_ADMIN_KEY_FILE``, as deploy/'s actors and sidecars do."""
    key_file = str(write_api_key(tmp_path / "api-key"))
    admin_key_file = str(write_api_key(tmp_path / "admin-key"))
    control_key_file = str(write_api_key(tmp_path / "router-control-key"))
    monkeypatch.setenv("LEAFE_ENGINE_API_KEY_FILE", key_file)
    monkeypatch.setenv("LEAFE_ENGINE_ADMIN_KEY_FILE", admin_key_file)
    store = tmp_path / "store"
    store.mkdir()
    async with AsyncExitStack() as stack:
        servers = []
        for _ in range(2):
            config = InferenceConfig(
                model=str(tiny_dir), port=0, threads=1, max_batch=4, api_key_file=key_file,
                admin_key_file=admin_key_file, weights_root=str(store),
            )  # fmt: skip
            servers.append(await stack.enter_async_context(InferenceServer(config)))
        engines = [server.url for server in servers]
        router = await open_router(
            engines,
            tmp_path / "router.log",
            health_interval_s=1,
            api_key_file=key_file,
            control_key_file=control_key_file,
        )
        stack.push_async_callback(router.stop, 10.0)
        yield Topology(
            router=router,
            servers=servers,
            engines=engines,
            key_file=key_file,
            store=store,
            model=tiny_dir,
        )


async def test_seeded_samples_go_through_the_router(topology: Topology) -> None:
    """``n`` seeded samples of one prompt (Early Experience's alternatives) are accepted by the
    router, come back as ``n`` completions with distinct seeds, and the same seed gives the same
    samples again (the router passes ``sampling_seed`` on); unseeded ``n`` works too."""
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=1234)
    async with topology.client() as client:
        first = await client.generate(PROMPT, seeded, n=3)
        again = await client.generate(PROMPT, seeded, n=3)
        unseeded = await client.generate(
            PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0), n=3
        )
    assert len(first) == len(unseeded) == 3
    assert [c.output_ids for c in first] == [c.output_ids for c in again]
    assert len({tuple(c.output_ids) for c in first}) > 1, "every sample had the same seed"


async def test_readiness_and_versions_through_the_router(topology: Topology) -> None:
    """The client finds the router ready (its ``/readiness``, as ``/ready`` is 404 there), and a
    completion carries the version of the engine that generated it (``meta_info.weight_version``,
    passed through)."""
    async with topology.client() as client:
        assert await client.ready()
        [c] = await client.generate(PROMPT, SamplingParams(max_new_tokens=2))
        assert c.weight_version == "default"
    async with SGLangClient(topology.engines) as direct:
        export = topology.store / "v000001"
        await asyncio.to_thread(scaled_export, topology.model, export, "v000001")
        results = await direct.update_weights_from_disk(str(export), "v000001")
        assert all(r.success for r in results), results
    async with topology.client() as client:
        versions = {c.weight_version for c in await client.generate(PROMPT, _short(), n=4)}
    assert versions == {"v000001"}


@dataclass
class Traffic:
    """What the actors would see while something happens to the engines: generations and their
    failures, and the router's healthy workers probed every 0.1 s."""

    generated: int = 0
    failures: list[str] = field(default_factory=list)
    probes: list[int | None] = field(default_factory=list)


@asynccontextmanager
async def traffic(topology: Topology, loops: int = 4) -> AsyncIterator[Traffic]:
    """``loops`` generation loops through the router and a probe of its healthy workers, for the
    block; one second of it before the block starts. Each loop's prompts start with a token of their
    own: cache-aware routing sends a prefix it has not seen to the engine with the smaller tree, so
    both engines get loops."""
    seen, stop = Traffic(), asyncio.Event()
    async with topology.client() as client:

        async def generate(loop: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    await client.generate([100 + loop, *PROMPT, i % 3], _short())
                    seen.generated += 1
                except Exception as e:  # the count of failures is what these tests are about
                    seen.failures.append(f"{type(e).__name__}: {e}")

        async def probe() -> None:
            while not stop.is_set():
                seen.probes.append(await topology.router.healthy_workers())
                await asyncio.sleep(0.1)

        tasks = [asyncio.create_task(generate(i)) for i in range(loops)] + [
            asyncio.create_task(probe())
        ]
        try:
            await asyncio.sleep(1.0)
            yield seen
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    assert seen.generated > 0 and seen.probes


async def test_an_engine_that_dies_costs_no_request(topology: Topology) -> None:
    """An engine that goes away under load (a pod evicted, a node lost) fails no request and leaves
    the router a healthy worker throughout: until the router's checks drop it, the router retries
    elsewhere or answers 500 ``call_upstream_request_error``, which the client retries like a
    refused connection. The router's /metrics then has every series the dashboard's router panels
    read (retries and errors included: a request an engine refuses makes an error; one with a
    wrong API key the router refuses itself)."""
    async with traffic(topology) as seen:
        await topology.servers[1].stop()
        await asyncio.sleep(4.0)  # the router's checks (every 1 s here, 3 misses) drop it meanwhile
    assert not seen.failures, seen.failures[:3]
    assert all(p is not None and p >= 1 for p in seen.probes) and seen.probes[-1] == 1, seen.probes
    wrong_key = topology.store.parent / "wrong-key"
    wrong_key.write_text("not-the-key\n")
    async with SGLangClient(
        topology.router.url, api_key_file=str(wrong_key), retries=0
    ) as stranger:
        with pytest.raises(EngineError, match="401"):  # the router's own key check
            await stranger.generate(PROMPT, _short())
    async with SGLangClient(topology.router.url, retries=0) as client:
        with pytest.raises(EngineError, match="400"):  # an engine's refusal: a routed error
            await client.generate([1 << 30], _short())
    async with aiohttp.ClientSession() as http, http.get(topology.router.metrics_url) as resp:
        exported = {line.split("{")[0].split(" ")[0] for line in (await resp.text()).splitlines()}
    dashboard = (DEPLOY / "components" / "monitoring" / "dashboard.json").read_text(
        encoding="utf-8"
    )
    used = set(re.findall(r"\bsmg_\w+", dashboard))
    missing = used - exported
    assert used and not missing, f"the dashboard reads series the router does not export: {missing}"


async def test_requests_an_engine_refuses_take_no_worker_out(topology: Topology) -> None:
    """Requests the engines refuse with 400 (the request's fault, not the engine's) leave both
    workers in the rotation: after four of them every request still gets an answer, and the
    router reports both workers healthy throughout."""
    async with SGLangClient(topology.router.url, retries=0) as client:
        for _ in range(4):
            with pytest.raises(EngineError, match="400"):
                await client.generate([1 << 30], _short())
        answers = await asyncio.gather(
            *(client.generate([200 + i, *PROMPT], _short()) for i in range(8)),
            return_exceptions=True,
        )
    failures = [f"{type(a).__name__}: {a}" for a in answers if isinstance(a, BaseException)]
    assert not failures, failures[:3]
    assert await topology.router.healthy_workers() == 2


async def test_a_push_under_load_keeps_serving(
    topology: Topology, nats_roles: dict[str, NatsOptions], run_id: str
) -> None:
    """Both engines' weight syncs get the same WeightsPublished while generations go through the
    router: the engines load one after the other (never both at once), the router has a healthy
    worker at every probe, no generation fails, and the completions after the push carry the new
    version."""
    syncs = [
        WeightSync(WeightSyncConfig(servers=[url], reconcile_interval_s=1.0), run_id=run_id)
        for url in topology.engines
    ]
    stop = asyncio.Event()
    followers = [asyncio.create_task(s.run(nats_roles["weight-sync"], stop)) for s in syncs]
    async with traffic(topology) as seen:
        event = await asyncio.to_thread(
            scaled_export, topology.model, topology.store / "v000001", "v000001", run_id
        )
        await _publish(nats_roles["learner"], event)
        await _until(lambda: all(s.converged() for s in syncs), 30.0)
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*followers)
    assert not seen.failures, seen.failures[:3]
    assert all(p is not None and p >= 1 for p in seen.probes), seen.probes
    spans = sorted(
        (r.started_at, r.started_at + r.seconds) for s in syncs for r in s.results.values()
    )
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], f"both engines loaded at once: {spans}"
    async with topology.client() as client:
        after = await client.generate(PROMPT, _short(), n=4)
    assert {c.weight_version for c in after} == {"v000001"}


def _short() -> SamplingParams:
    return SamplingParams(max_new_tokens=4, temperature=1.0)


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
