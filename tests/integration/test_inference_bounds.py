"""Request bounds of the CPU inference server's ``/generate``: a request cannot ask for unbounded
work.

``n``, the prompts per batch and the sequences per request (prompts x n) have upper bounds, and a
text prompt is bounded by its bytes before it is tokenized (a 6 MB prompt cost 5.7 s of tokenizer
CPU before the context-length check refused it). Each refusal is an SGLang-shaped 400 naming the
value, and fast. A request's texts together are bounded too, before any of them is tokenized (96
prompts of 650 KB, each under the per-prompt bound, were tokenized on the event loop for 97 s before
their 400), tokenizing runs off the event loop (``/health`` answers meanwhile), and a body nested
too deep to decode is a 400, not a 500.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import aiohttp
import pytest

from leafe.actors.client import SGLangClient
from leafe.actors.engine import EngineError, SamplingParams
from leafe.services.inference.api import MAX_N, MAX_PROMPTS, MAX_SEQUENCES, MAX_TEXT_CONTEXTS
from leafe.services.inference.local import ServerThread, start_in_thread
from leafe.services.inference.server import InferenceConfig

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

NOTHING = {
    "max_new_tokens": 0
}  # finished at once: before the bounds, these requests were answered 200


@pytest.fixture(scope="module")
def url_handle() -> Iterator[ServerThread]:
    handle = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def url(url_handle: ServerThread) -> str:
    return url_handle.url


async def test_n_prompts_and_sequences_are_bounded(url: str) -> None:
    async with SGLangClient(url) as client:
        with pytest.raises(EngineError, match=rf"HTTP 400.*n must be at most {MAX_N}, got 100000"):
            await client.generate_raw(
                {"input_ids": [1, 2], "sampling_params": {**NOTHING, "n": 100_000}}
            )
        many = [[1, 2]] * (MAX_PROMPTS + 1)
        with pytest.raises(
            EngineError, match=rf"HTTP 400.*{MAX_PROMPTS + 1} prompts.*at most {MAX_PROMPTS}"
        ):
            await client.generate_raw({"input_ids": many, "sampling_params": NOTHING})
        n = MAX_SEQUENCES // MAX_PROMPTS + 1
        body = {"input_ids": [[1, 2]] * MAX_PROMPTS, "sampling_params": {**NOTHING, "n": n}}
        with pytest.raises(
            EngineError, match=rf"HTTP 400.*{MAX_PROMPTS * n} sequences.*at most {MAX_SEQUENCES}"
        ):
            await client.generate_raw(body)
        # the largest request allowed still works
        await client.generate_raw({"input_ids": [[1, 2]] * MAX_PROMPTS, "sampling_params": NOTHING})
        assert (
            len(await client.generate([1, 2], SamplingParams(max_new_tokens=2), n=MAX_N)) == MAX_N
        )


async def test_a_huge_text_prompt_is_refused_before_it_is_tokenized(url: str) -> None:
    """6 MB of text: refused by its size in well under a second (not after seconds of
    tokenizing)."""
    async with SGLangClient(url) as client:
        for text in ("word " * 1_200_000, ["short", "word " * 1_200_000]):
            start = time.monotonic()
            with pytest.raises(EngineError, match=r"HTTP 400.*text of 6000000 bytes.*at most"):
                await client.generate_raw({"text": text, "sampling_params": NOTHING})
            assert time.monotonic() - start < 1.0
        ok = await client.generate_raw(
            {"text": "a short prompt", "sampling_params": {"max_new_tokens": 2}}
        )
    assert b"output_ids" in ok


TINY_MAX_TEXT = 2048 * 81
"""The tiny model's per-prompt text bound: its context (2048 tokens) x its longest token's bytes
(81)."""


async def test_a_requests_texts_together_are_bounded_before_any_is_tokenized(url: str) -> None:
    """96 texts of 160 KB, each under the per-prompt bound (15 MB together): refused by their total
    in well under a second, naming it; texts just under the total are still tokenized (then refused
    for the context, as before)."""
    per = 160_000
    async with SGLangClient(url) as client:
        start = time.monotonic()
        with pytest.raises(
            EngineError, match=rf"HTTP 400.*texts of {96 * per} bytes together.*at most"
        ):
            await client.generate_raw(
                {"text": ["word " * (per // 5)] * 96, "sampling_params": NOTHING}
            )
        assert time.monotonic() - start < 1.0
        fits = MAX_TEXT_CONTEXTS * TINY_MAX_TEXT // per
        with pytest.raises(EngineError, match=r"HTTP 400.*longer than the model's context length"):
            await client.generate_raw(
                {"text": ["word " * (per // 5)] * fits, "sampling_params": NOTHING}
            )


class _HeldTokenizer:
    """The server's tokenizer, held at its first ``encode`` until the test releases it: a
    tokenization that lasts as long as the test needs, on any machine (a timed one took 0.2 s on a
    fast CI host, too short to tell off-loop from on-loop)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never released the held tokenizer")
        return self.inner.encode(text)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_health_answers_while_a_large_request_is_tokenized(url_handle: ServerThread) -> None:
    """While the largest allowed text request is being tokenized (held mid-``encode``), ``/health``
    answers: tokenizing runs off the event loop. On the loop, the probe would wait for the release
    and time out."""
    server = url_handle.server
    assert server is not None
    held = _HeldTokenizer(server._tokenizer)
    server._tokenizer = held
    fits = MAX_TEXT_CONTEXTS * TINY_MAX_TEXT // 160_000
    body = {"text": ["word " * 32_000] * fits, "sampling_params": NOTHING}
    try:
        async with SGLangClient(url_handle.url) as client, aiohttp.ClientSession() as s:
            tokenizing = asyncio.create_task(client.generate_raw(body))
            assert await asyncio.to_thread(held.entered.wait, 30), (
                "the request never reached the tokenizer"
            )
            async with s.get(
                f"{url_handle.url}/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                assert r.status == 200
            assert not tokenizing.done()
            held.release.set()
            with pytest.raises(
                EngineError, match=r"HTTP 400.*longer than the model's context length"
            ):
                await tokenizing
    finally:
        held.release.set()
        server._tokenizer = held.inner


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
