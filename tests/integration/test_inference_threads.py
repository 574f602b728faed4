"""The CPU server's thread control: ``leafe run`` resizes the engine's pool between stages."""

from __future__ import annotations

import aiohttp
import pytest

from actors.client import SGLangClient
from actors.engine import SamplingParams
from services.inference.config import InferenceConfig
from services.inference.local import start_in_thread

pytestmark = [pytest.mark.anyio, pytest.mark.integration]
GREEDY = SamplingParams(max_new_tokens=2, temperature=0.0)


async def _threads(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(f"{url}/get_server_info") as r:
        return int((await r.json())["internal_states"][0]["threads"])


async def test_set_threads_reaches_the_engine_worker_and_bad_values_are_400() -> None:
    """The count is applied by the engine's own worker thread (OpenMP's count is per thread) from its next
    step on and shows in /get_server_info; anything but an int in 1..1024 is a 400 that changes nothing."""
    handle = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1))
    try:
        async with SGLangClient(handle.url) as client, aiohttp.ClientSession() as s:
            await client.generate([1, 2, 3], GREEDY)
            assert await _threads(s, handle.url) == 1
            async with s.post(f"{handle.url}/set_threads", json={"threads": 2}) as r:
                assert r.status == 200 and (await r.json())["success"]
            await client.generate([1, 2, 3], GREEDY)
            assert await _threads(s, handle.url) == 2
            for bad in (0, -1, "2", 2.0, None, 5000):
                async with s.post(f"{handle.url}/set_threads", json={"threads": bad}) as r:
                    assert r.status == 400, bad
            await client.generate([1, 2, 3], GREEDY)
            assert await _threads(s, handle.url) == 2
    finally:
        handle.stop()
