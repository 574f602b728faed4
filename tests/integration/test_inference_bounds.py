"""Request bounds of the CPU inference server's ``/generate``: a request cannot ask for unbounded work.

``n``, the prompts per batch and the sequences per request (prompts x n) have upper bounds, and a text
prompt is bounded by its bytes before it is tokenized (a 6 MB prompt cost 5.7 s of tokenizer CPU before
the context-length check refused it). Each refusal is an SGLang-shaped 400 naming the value, and fast.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from actors.client import SGLangClient
from actors.engine import EngineError, SamplingParams
from services.inference.api import MAX_N, MAX_PROMPTS, MAX_SEQUENCES
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
