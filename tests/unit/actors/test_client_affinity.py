"""Prefix affinity of the SGLang client: an episode's requests go to one server (whose prefix cache
holds the episode's prompts) unless that server is much busier than the others."""

from __future__ import annotations

import asyncio

from leafe.actors.client import SGLangClient
from leafe.actors.engine import ENGINE_AFFINITY
from leafe.actors.server_pool import AFFINITY_SLACK


def _picks(client: SGLangClient, key: str | None, n: int = 20) -> set[str]:
    async def run() -> set[str]:
        ENGINE_AFFINITY.set(key)
        return {client._pick().url for _ in range(n)}

    return asyncio.run(run())


def test_a_key_sticks_to_one_server_and_keys_spread() -> None:
    """Every request with one key picks the same server; without a key requests rotate; many keys
    use every server."""
    client = SGLangClient(["http://a:1", "http://b:1", "http://c:1"])
    assert all(len(_picks(client, f"group-{i}")) == 1 for i in range(10))
    assert len(_picks(client, None)) == 3
    assert {next(iter(_picks(client, f"group-{i}"))) for i in range(30)} == {
        s.url for s in client.servers
    }


def test_a_busy_preferred_server_gives_way_to_the_least_loaded() -> None:
    """Beyond AFFINITY_SLACK more requests in flight than the least loaded, the key's server is
    skipped; a server cooling down after a failure is never preferred."""
    client = SGLangClient(["http://a:1", "http://b:1"])
    [preferred] = _picks(client, "g")
    other = next(s for s in client.servers if s.url != preferred)
    busy = next(s for s in client.servers if s.url == preferred)
    busy.in_flight = AFFINITY_SLACK
    assert _picks(client, "g") == {preferred}
    busy.in_flight = AFFINITY_SLACK + 1
    assert _picks(client, "g") == {other.url}
    busy.in_flight, busy.down_until = 0, float("inf")
    assert _picks(client, "g") == {other.url}
