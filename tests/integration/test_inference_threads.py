"""The CPU server's thread control: ``leafe run`` resizes the engine's pool between stages, with the
server's admin key. The API key (every actor holds it) once set up to 1024 threads: on 2 cores a
24-token generate went from 4 s to over 30 s."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

from leafe.actors.client import SGLangClient
from leafe.actors.engine import SamplingParams
from leafe.services.inference.auth import write_api_key
from leafe.services.inference.config import InferenceConfig
from leafe.services.inference.local import start_in_thread

pytestmark = [pytest.mark.anyio, pytest.mark.integration]
GREEDY = SamplingParams(max_new_tokens=2, temperature=0.0)


async def _threads(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(f"{url}/get_server_info") as r:
        return int((await r.json())["internal_states"][0]["threads"])


def _bearer(path: Path) -> dict[str, str]:
    return {"Authorization": f"Bearer {path.read_text().strip()}"}


async def test_set_threads_reaches_the_engine_worker_and_bad_values_are_400(tmp_path: Path) -> None:
    """The count is applied by the engine's own worker thread (OpenMP's count is per thread) from
    its next step on and shows in /get_server_info; anything but an int from 1 to the cores the
    process may use is a 400 that changes nothing."""
    admin = write_api_key(tmp_path / "admin-key")
    handle = start_in_thread(
        InferenceConfig(model="tiny", port=0, threads=1, admin_key_file=str(admin))
    )
    usable = len(os.sched_getaffinity(0))
    try:
        async with (
            SGLangClient(handle.url) as client,
            aiohttp.ClientSession(headers=_bearer(admin)) as s,
        ):
            await client.generate([1, 2, 3], GREEDY)
            assert await _threads(s, handle.url) == 1
            async with s.post(f"{handle.url}/set_threads", json={"threads": usable}) as r:
                assert r.status == 200 and (await r.json())["success"]
            await client.generate([1, 2, 3], GREEDY)
            assert await _threads(s, handle.url) == usable
            for bad in (0, -1, "2", 2.0, None, usable + 1, 1024):
                async with s.post(f"{handle.url}/set_threads", json={"threads": bad}) as r:
                    assert r.status == 400, bad
            await client.generate([1, 2, 3], GREEDY)
            assert await _threads(s, handle.url) == usable
    finally:
        handle.stop()


async def test_the_api_key_cannot_set_threads(tmp_path: Path) -> None:
    """With an API key and an admin key: the API key (an actor's) gets 401 on /set_threads and still
    generates; the admin key sets threads. Without an admin key, /set_threads is 403 whatever is
    sent."""
    api, admin = write_api_key(tmp_path / "api-key"), write_api_key(tmp_path / "admin-key")
    keys = {"api_key_file": str(api), "admin_key_file": str(admin)}
    handle = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1, **keys))
    try:
        async with (
            SGLangClient(handle.url, api_key_file=str(api)) as client,
            aiohttp.ClientSession() as s,
        ):
            for headers, status in ((_bearer(api), 401), ({}, 401), (_bearer(admin), 200)):
                async with s.post(
                    f"{handle.url}/set_threads", json={"threads": 1}, headers=headers
                ) as r:
                    assert r.status == status, (headers, await r.text())
            assert await client.generate([1, 2, 3], GREEDY)
    finally:
        handle.stop()
    handle = start_in_thread(
        InferenceConfig(model="tiny", port=0, threads=1, api_key_file=str(api))
    )
    try:
        async with aiohttp.ClientSession(headers=_bearer(api)) as s:
            async with s.post(f"{handle.url}/set_threads", json={"threads": 1}) as r:
                assert r.status == 403 and "admin key" in (await r.json())["error"]["message"]
    finally:
        handle.stop()
