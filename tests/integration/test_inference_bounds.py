"""Request bounds of the CPU inference server's ``/generate``: a request cannot ask for unbounded work.

``n``, the prompts per batch and the sequences per request (prompts x n) have upper bounds, and a text
prompt is bounded by its bytes before it is tokenized (a 6 MB prompt cost 5.7 s of tokenizer CPU before
the context-length check refused it). Each refusal is an SGLang-shaped 400 naming the value, and fast.
A request's texts together are bounded too, before any of them is tokenized (96 prompts of 650 KB, each
under the per-prompt bound, were tokenized on the event loop for 97 s before their 400), tokenizing runs
off the event loop (``/health`` answers meanwhile), and a body nested too deep to decode is a 400, not a
500.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from actors.client import SGLangClient
from actors.engine import EngineError, SamplingParams
from services.inference.api import MAX_N, MAX_PROMPTS, MAX_SEQUENCES, MAX_TEXT_CONTEXTS
from services.inference.local import start_in_thread
from services.inference.server import InferenceConfig

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

NOTHING = {"max_new_tokens": 0}  # finished at once: before the bounds, these requests were answered 200


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    handle = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1))
    try:
        yield handle.url
    finally:
        handle.stop()


async def test_n_prompts_and_sequences_are_bounded(url: str) -> None:
    async with SGLangClient(url) as client:
        with pytest.raises(EngineError, match=rf"HTTP 400.*n must be at most {MAX_N}, got 100000"):
            await client.generate_raw({"input_ids": [1, 2], "sampling_params": {**NOTHING, "n": 100_000}})
        many = [[1, 2]] * (MAX_PROMPTS + 1)
        with pytest.raises(EngineError, match=rf"HTTP 400.*{MAX_PROMPTS + 1} prompts.*at most {MAX_PROMPTS}"):
            await client.generate_raw({"input_ids": many, "sampling_params": NOTHING})
        n = MAX_SEQUENCES // MAX_PROMPTS + 1
        body = {"input_ids": [[1, 2]] * MAX_PROMPTS, "sampling_params": {**NOTHING, "n": n}}
        with pytest.raises(
            EngineError, match=rf"HTTP 400.*{MAX_PROMPTS * n} sequences.*at most {MAX_SEQUENCES}"
        ):
            await client.generate_raw(body)
        # the largest request allowed still works
        await client.generate_raw({"input_ids": [[1, 2]] * MAX_PROMPTS, "sampling_params": NOTHING})
        assert len(await client.generate([1, 2], SamplingParams(max_new_tokens=2), n=MAX_N)) == MAX_N


async def test_a_huge_text_prompt_is_refused_before_it_is_tokenized(url: str) -> None:
    """6 MB of text: refused by its size in well under a second (not after seconds of tokenizing)."""
    async with SGLangClient(url) as client:
        for text in ("word " * 1_200_000, ["short", "word " * 1_200_000]):
            start = time.monotonic()
            with pytest.raises(EngineError, match=r"HTTP 400.*text of 6000000 bytes.*at most"):
                await client.generate_raw({"text": text, "sampling_params": NOTHING})
            assert time.monotonic() - start < 1.0
        ok = await client.generate_raw({"text": "a short prompt", "sampling_params": {"max_new_tokens": 2}})
    assert b"output_ids" in ok


TINY_MAX_TEXT = 2048 * 81
"""The tiny model's per-prompt text bound: its context (2048 tokens) x its longest token's bytes (81)."""


async def test_a_requests_texts_together_are_bounded_before_any_is_tokenized(url: str) -> None:
    """96 texts of 160 KB, each under the per-prompt bound (15 MB together): refused by their total in well
    under a second, naming it; texts just under the total are still tokenized (then refused for the
    context, as before)."""
    per = 160_000
    async with SGLangClient(url) as client:
        start = time.monotonic()
        with pytest.raises(EngineError, match=rf"HTTP 400.*texts of {96 * per} bytes together.*at most"):
            await client.generate_raw({"text": ["word " * (per // 5)] * 96, "sampling_params": NOTHING})
        assert time.monotonic() - start < 1.0
        fits = MAX_TEXT_CONTEXTS * TINY_MAX_TEXT // per
        with pytest.raises(EngineError, match=r"HTTP 400.*longer than the model's context length"):
            await client.generate_raw({"text": ["word " * (per // 5)] * fits, "sampling_params": NOTHING})


async def test_health_answers_while_a_large_request_is_tokenized(url: str) -> None:
    """While the largest allowed text request (about a second of tokenizing) is parsed, ``/health`` answers
    in well under its duration: tokenizing runs off the event loop."""
    fits = MAX_TEXT_CONTEXTS * TINY_MAX_TEXT // 160_000
    body = {"text": ["word " * 32_000] * fits, "sampling_params": NOTHING}
    async with SGLangClient(url) as client, aiohttp.ClientSession() as s:
        started = time.monotonic()
        tokenizing = asyncio.create_task(client.generate_raw(body))
        await asyncio.sleep(0.05)
        probe = time.monotonic()
        async with s.get(f"{url}/health") as r:
            assert r.status == 200
        answered = time.monotonic() - probe
        with pytest.raises(EngineError, match="HTTP 400"):
            await tokenizing
        took = time.monotonic() - started
    assert answered < 0.25 < took / 2, (answered, took)


async def test_a_body_nested_too_deep_is_a_400(url: str) -> None:
    """100,000 nested arrays (Python's decoder raises RecursionError) on /generate, /set_threads and
    /update_weights_from_disk: each a 400, never a 500, and the server still generates."""
    deep = b"[" * 100_000 + b"]" * 100_000
    async with aiohttp.ClientSession() as s:
        for route in ("/generate", "/update_weights_from_disk", "/update_weight_version"):
            async with s.post(f"{url}{route}", data=b'{"text": ' + deep + b"}") as r:
                assert r.status == 400, (route, r.status, await r.text())
    async with SGLangClient(url) as client:
        assert await client.generate([1, 2], SamplingParams(max_new_tokens=2))
