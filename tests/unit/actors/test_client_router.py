"""The client behind sglang-router 0.3.2: the router's HTTP 500 for a worker it could not reach
(header ``x-smg-error-code: call_upstream_request_error``, body as the router writes it) is an
outage, retried and never counted against the task; any other 500 is the engine's own error.
Loopback only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from leafe.actors.client import EngineUnavailable, SGLangClient
from leafe.actors.engine import EngineError, SamplingParams

pytestmark = pytest.mark.anyio

UNREACHED = (
    b'{"error":{"type":"Internal Server Error","code":"call_upstream_request_error","message":'
    b'"error sending request for url (http://10.0.0.7:30000/generate). URL: '
    b'http://10.0.0.7:30000/generate"}}'
)


@asynccontextmanager
async def answering_500(headers: dict[str, str]) -> AsyncIterator[tuple[str, list[str]]]:
    """A server answering every request with HTTP 500 and ``headers``; yields its URL and the paths
    asked."""
    asked: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(
            status=500, body=UNREACHED, content_type="application/json", headers=headers
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


async def test_the_routers_unreached_worker_is_an_outage_not_an_error() -> None:
    """The router's 500 with ``call_upstream_request_error`` is retried, then raised as
    :class:`EngineUnavailable` (the actor does not count it); a plain 500 is raised at once,
    counted."""
    async with answering_500({"x-smg-error-code": "call_upstream_request_error"}) as (url, asked):
        async with SGLangClient(url, retries=1, backoff_s=0.01) as client:
            with pytest.raises(EngineUnavailable, match="error sending request"):
                await client.generate([1, 2], SamplingParams())
    assert asked == ["/generate", "/generate"]
    async with answering_500({}) as (url, asked):
        async with SGLangClient(url, retries=1, backoff_s=0.01) as client:
            with pytest.raises(EngineError) as caught:
                await client.generate([1, 2], SamplingParams())
    assert not isinstance(caught.value, EngineUnavailable) and asked == ["/generate"]
