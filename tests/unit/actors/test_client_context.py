"""The client refuses a prompt of the engines' context length or more before sending it: the engine
would answer 400, and the sglang router counts such answers against the engine (five in a row take
it out). The actor service learns the length from its model. Loopback only."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from leafe.actors.client import SGLangClient, SGLangClientConfig
from leafe.actors.config import ActorServiceConfig
from leafe.actors.engine import PromptTooLong, SamplingParams
from leafe.services.actor.main import model_context_length

pytestmark = pytest.mark.anyio


async def test_an_over_long_prompt_is_refused_unsent() -> None:
    """With ``context_length`` 8, a 7-token prompt is sent and an 8-token one raises
    ``PromptTooLong`` naming both lengths, without a request reaching the server."""
    asked: list[int] = []

    async def generate(request: web.Request) -> web.Response:
        asked.append(len((await request.json())["input_ids"]))
        body = {"text": "", "output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", context_length=8, retries=0) as c:
            await c.generate(list(range(1, 8)), SamplingParams(max_new_tokens=1))
            with pytest.raises(PromptTooLong, match=r"8 tokens.*context length is 8"):
                await c.generate(list(range(1, 9)), SamplingParams(max_new_tokens=1))
    finally:
        await runner.cleanup()
    assert asked == [7]


def test_the_context_length_is_configured_or_read_from_the_model(tiny_dir: Path) -> None:
    """``[engine] context_length`` is a config field (negative refused); the actor service's default
    is its model's ``max_position_embeddings``."""
    config = msgspec.convert({"engine": {"context_length": 4096}}, ActorServiceConfig)
    assert config.engine.context_length == 4096
    with pytest.raises(ValueError, match="context_length"):
        SGLangClientConfig(context_length=-1)
    assert model_context_length(tiny_dir) == 2048
