"""What the key every actor holds can do to a real ``leafe inference`` server: generate, and nothing
that steers the server. With it, ``/update_weight_version`` once aborted other clients' generations
(3 of 3 victims cut after 2-4 tokens in a 0.2 s loop) and relabelled the served version, and
``/update_weights_from_disk`` loaded any checked export past the store's reload lease; now the
weight routes need the admin key, which only weight sync holds (issue 59, "The API key's
powers")."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rich.console import Console

from leafe.actors.client import SGLangClient
from leafe.actors.engine import SamplingParams
from leafe.services.inference.auth import write_api_key
from leafe.services.inference.config import InferenceConfig
from leafe.services.inference.local import ServerThread, start_in_thread
from leafe.services.inference.server import InferenceServer
from leafe.services.run.context import RunContext
from leafe.services.run.launch import _start_router
from leafe.services.run.presets import resolve_run_config
from leafe.services.run.router import router_available
from tests.support.weights import scaled_export

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

PROMPT = [1, 504, 3180, 288, 260, 1542]
LONG = {"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}


@dataclass
class Keyed:
    """A server with an API key (the actors') and an admin key (weight sync's)."""

    server: ServerThread
    api: Path
    admin: Path
    root: Path

    def bearer(self, which: str) -> dict[str, str]:
        path = self.api if which == "api" else self.admin
        return {"Authorization": f"Bearer {path.read_text().strip()}"}


@pytest.fixture
def keyed(tmp_path: Path, tiny_dir: Path) -> Iterator[Keyed]:
    root = tmp_path / "store"
    root.mkdir()
    api, admin = write_api_key(tmp_path / "api-key"), write_api_key(tmp_path / "admin-key")
    config = InferenceConfig(
        model=str(tiny_dir), port=0, threads=1, max_batch=8, weights_root=str(root),
        api_key_file=str(api), admin_key_file=str(admin),
    )  # fmt: skip
    server = start_in_thread(config)
    try:
        yield Keyed(server, api, admin, root)
    finally:
        server.stop()


async def _generate(s: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict[str, Any]:
    async with s.post(
        f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": LONG}, headers=headers
    ) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def test_the_actors_key_can_neither_abort_nor_relabel_nor_reload(
    keyed: Keyed, tiny_dir: Path
) -> None:
    """Three victims generate while an actor's key loops ``/update_weight_version`` (abort all) and
    ``/update_weights_from_disk`` (a valid export under the root) every 50 ms: every attempt is
    401, no victim is cut (each gets all its tokens), the served version and weights stay. Then the
    admin key does both."""
    url = keyed.server.url
    export = keyed.root / "v000001"
    await asyncio.to_thread(scaled_export, tiny_dir, export, "v000001")
    attempts: list[int] = []
    async with aiohttp.ClientSession() as s:
        before = await _generate(s, url, keyed.bearer("api"))
        victims = [asyncio.create_task(_generate(s, url, keyed.bearer("api"))) for _ in range(3)]

        async def attack() -> None:
            i = 0
            while not all(v.done() for v in victims):
                i += 1
                steps: list[tuple[str, dict[str, Any]]] = [
                    ("/update_weight_version", {"new_version": f"evil-{i}"}),
                    ("/update_weights_from_disk", {"model_path": str(export)}),
                ]
                for path, body in steps:
                    body["abort_all_requests"] = True
                    async with s.post(url + path, json=body, headers=keyed.bearer("api")) as r:
                        attempts.append(r.status)
                await asyncio.sleep(0.05)

        attacker = asyncio.create_task(attack())
        outs = await asyncio.gather(*victims)
        await attacker
        cut = [
            o["meta_info"]["completion_tokens"]
            for o in outs
            if o["meta_info"]["finish_reason"]["type"] != "length"
            or o["meta_info"]["completion_tokens"] != LONG["max_new_tokens"]
        ]
        assert cut == [], f"{len(cut)} of 3 victims cut after {cut} tokens"
        assert attempts and set(attempts) == {401}, attempts
        assert {o["meta_info"]["weight_version"] for o in outs} == {"default"}
        after = await _generate(s, url, keyed.bearer("api"))
        assert after["output_ids"] == before["output_ids"]  # the same weights

        # the admin key (weight sync's) does both
        async with s.post(
            url + "/update_weight_version",
            json={"new_version": "relabelled"},
            headers=keyed.bearer("admin"),
        ) as r:
            assert r.status == 200 and (await r.json())["success"]
    async with SGLangClient(url, api_key_file=str(keyed.api), admin_key_file=str(keyed.admin)) as c:
        [loaded] = await c.update_weights_from_disk(str(export), "v000001")
        assert loaded.success, loaded.message
        assert await c.weight_version() == "v000001"
    async with SGLangClient(url, api_key_file=str(keyed.api)) as actor:  # no admin key: refused
        [refused] = await actor.update_weights_from_disk(str(export), "v000002")
        assert not refused.success and "HTTP 401" in refused.message
        assert await actor.weight_version() == "v000001"


async def test_flush_cache_and_future_weight_routes_need_the_admin_key(keyed: Keyed) -> None:
    """``/flush_cache`` (every client's prefix cache) and any other weight route are admin routes:
    401 with the actors' key; the admin key flushes (a route the server lacks is then its 404).
    The admin key is no API key: it does not generate."""
    url = keyed.server.url
    async with aiohttp.ClientSession() as s:
        for path in (
            "/flush_cache",
            "/update_weights_from_tensor",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
            "/get_weights_by_name",
        ):
            async with s.post(url + path, json={}, headers=keyed.bearer("api")) as r:
                assert r.status == 401, path
        async with s.post(url + "/flush_cache", headers=keyed.bearer("admin")) as r:
            assert r.status == 200
        async with s.post(url + "/update_weights_from_tensor", headers=keyed.bearer("admin")) as r:
            assert r.status == 404
        async with s.post(
            url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
            headers=keyed.bearer("admin"),
        ) as r:
            assert r.status == 401


async def test_a_server_with_only_an_api_key_reloads_for_nobody(tmp_path: Path) -> None:
    """A server given an API key but no admin key refuses the weight routes (403, naming the missing
    admin key) whatever is sent: the API key never reloads weights. (A server with no key at all
    still serves them to whoever reaches it, as SGLang does: local tests only.)"""
    api = write_api_key(tmp_path / "api-key")
    server = start_in_thread(
        InferenceConfig(model="tiny", port=0, threads=1, api_key_file=str(api))
    )
    headers = {"Authorization": f"Bearer {api.read_text().strip()}"}
    try:
        async with aiohttp.ClientSession(headers=headers) as s:
            for path in ("/update_weight_version", "/update_weights_from_disk"):
                async with s.post(server.url + path, json={"new_version": "x"}) as r:
                    assert r.status == 403 and "admin key" in await r.text(), path
    finally:
        server.stop()


# ---- the router `leafe run` starts (services.router = true), the real sglang-router 0.3.2


@pytest.fixture
async def run_router(tmp_path: Path, tiny_dir: Path) -> AsyncIterator[RunContext]:
    """``leafe run``'s router (``launch._start_router``, as ``start_infra`` calls it) in front of
    two keyed CPU engines."""
    ctx = RunContext(
        config=resolve_run_config("tiny", overrides={"runs_dir": str(tmp_path), "run_id": "r"}),
        console=Console(file=io.StringIO()),
        stop=asyncio.Event(),
    )
    (ctx.run_dir / "logs").mkdir(parents=True)
    secrets = ctx.run_dir / "secrets"
    ctx.engine_key_file = str(write_api_key(secrets / "engine-api-key"))
    admin = str(write_api_key(secrets / "engine-admin-key"))
    async with AsyncExitStack() as stack:
        for _ in range(2):
            config = InferenceConfig(
                model=str(tiny_dir), port=0, threads=1, max_batch=4,
                api_key_file=ctx.engine_key_file, admin_key_file=admin,
            )  # fmt: skip
            server = await stack.enter_async_context(InferenceServer(config))
            ctx.engine_urls.append(server.url)
        await _start_router(ctx, stack)
        yield ctx


def _bearer(key_file: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {Path(key_file).read_text().strip()}"}


@dataclass
class Stranger:
    """A server an attacker would register as a worker: what it was sent."""

    url: str = ""
    seen: list[tuple[str, str]] = field(default_factory=list)


@asynccontextmanager
async def stranger_server() -> AsyncIterator[Stranger]:
    stranger = Stranger()

    async def handle(request: web.Request) -> web.Response:
        stranger.seen.append((request.path, request.headers.get("Authorization", "")))
        return web.json_response({}, status=200)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    stranger.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield stranger
    finally:
        await runner.cleanup()


@pytest.mark.skipif(not router_available(), reason="pip install sglang-router==0.3.2 (dev extra)")
async def test_the_run_router_takes_worker_changes_only_from_the_supervisor(
    run_router: RunContext,
) -> None:
    """Without a key, or with the engines' key that every actor holds: ``POST /workers`` (an
    attacker's URL) and ``DELETE /workers/<id>`` are refused and the worker list stays the two
    engines, the stranger is sent nothing; ``/workers`` and ``/get_loads`` answer only the
    supervisor's control key; ``/get_server_info`` gives counts, no worker URL. Actors' requests
    still go through with the engines' key, and not without it. Before: no key at all, the
    stranger was added (and was sent the actors' requests with their key), an engine could be
    removed, and every info route answered anyone."""
    ctx = run_router
    url = ctx.router_url
    actor = _bearer(ctx.engine_key_file)
    async with stranger_server() as stranger, aiohttp.ClientSession() as s:
        refused: list[int] = []
        for headers in ({}, actor):
            async with s.post(f"{url}/workers", json={"url": stranger.url}, headers=headers) as r:
                refused.append(r.status)
            async with s.delete(f"{url}/workers/any-worker-id", headers=headers) as r:
                refused.append(r.status)
            for path in ("/workers", "/get_loads"):
                async with s.get(url + path, headers=headers) as r:
                    refused.append(r.status)
        assert refused == [401] * 8, refused
        control = _bearer(ctx.router_key_file)
        async with s.get(f"{url}/workers", headers=control) as r:
            assert r.status == 200
            workers = (await r.json())["workers"]
        assert sorted(w["url"] for w in workers) == sorted(ctx.engine_urls)
        for w in workers:
            for headers in ({}, actor):
                async with s.delete(f"{url}/workers/{w['id']}", headers=headers) as r:
                    assert r.status == 401
        async with s.get(f"{url}/get_server_info") as r:
            info = await r.text()
        assert "127.0.0.1" not in info, info
        async with s.get(f"{url}/get_loads", headers=control) as r:
            assert r.status == 200
        async with s.get(f"{url}/workers", headers=control) as r:
            assert sorted(w["url"] for w in (await r.json())["workers"]) == sorted(ctx.engine_urls)
        async with s.post(
            f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        ) as r:
            assert r.status == 401
        await asyncio.sleep(1.0)
        assert stranger.seen == []
    async with SGLangClient(url, api_key_file=ctx.engine_key_file) as client:
        assert await client.ready()
        assert await client.generate(PROMPT, SamplingParams(max_new_tokens=2))
