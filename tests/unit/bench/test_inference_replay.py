"""bench/inference_replay.py: the committed agent workload has the recorded shape, and its replay
sends exactly the recorded token ids, lengths and seeds, episode turns in order with 16 episodes in
flight, to our server (the tiny model) and to an OpenAI-compatible peer. vLLM itself is too heavy
for tests: the peer here is a small aiohttp app answering as vLLM 0.32's /v1/completions, /metrics
and /reset_prefix_cache do (checked against a real vLLM CPU by hand, docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from bench.inference_replay import (
    LlamaCppTarget,
    OpenAITarget,
    SGLangTarget,
    WorkloadRequest,
    episodes_of,
    ideal_share,
    load_workload,
    replay,
)
from leafe.services.inference.config import InferenceConfig
from leafe.services.inference.local import start_in_thread

pytestmark = pytest.mark.anyio


def _workload(episodes: int, turns: int) -> list[WorkloadRequest]:
    """Episodes whose prompts grow turn by turn (shared prefixes), started round-robin as evaluate
    does."""
    out: list[WorkloadRequest] = []
    for t in range(turns):
        for e in range(episodes):
            ids = [1, 100 + e, *range(200, 230), *(300 + k for k in range(5 * t)), 2]
            sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 48}
            out.append(
                WorkloadRequest(
                    order=len(out),
                    episode=e,
                    turn=t,
                    input_ids=ids,
                    completion_tokens=3 + (e + t) % 4,
                    seed=1000 * e + t,
                    **sampling,
                )
            )
    return out


def test_the_committed_workload_is_the_recorded_agent_shape() -> None:
    """About 256 Sokoban requests, ~250 prompt and ~23 completion tokens, multi-turn with shared
    prefixes."""
    reqs, meta = load_workload()
    assert 200 <= len(reqs) <= 320 and meta["requests"] == len(reqs)
    assert 180 <= meta["prompt_tokens_mean"] <= 330 and 10 <= meta["completion_tokens_mean"] <= 40
    assert meta["evaluation"]["concurrency"] == 16 and meta["server"]["dtype"] == "bfloat16"
    assert all(0 <= t < 49152 for r in reqs for t in r.input_ids)  # SmolLM2's vocabulary
    eps = episodes_of(reqs)
    assert len(eps) == meta["episodes"] and max(len(e) for e in eps) > 1
    assert [e[0].episode for e in eps] == sorted(e[0].episode for e in eps)
    assert ideal_share(reqs) == meta["ideal_prefix_share"] > 0.3
    assert len({r.seed for r in reqs}) == len(reqs), "every request was recorded with its own seed"


@pytest.mark.integration
async def test_replay_against_our_server_gets_the_recorded_lengths_and_reuses_prefixes() -> None:
    handle = await asyncio.to_thread(
        start_in_thread, InferenceConfig(model="tiny", port=0, threads=1)
    )
    try:
        reqs = _workload(episodes=4, turns=3)
        row = await replay(SGLangTarget(handle.url), reqs, in_flight=2)
    finally:
        await asyncio.to_thread(handle.stop)
    assert row["requests"] == 12 and row["completion_tokens"] == sum(
        r.completion_tokens for r in reqs
    )
    assert row["completion_tokens_per_s"] > 0 and row["latency_mean_s"] > 0
    assert 0 < row["prefix_cache_share"] <= ideal_share(reqs)
    assert row["cached_tokens_reported"] == row["engine_counters"]["cached_tokens"]


class FakeVLLM:
    """/v1/completions, /metrics and /reset_prefix_cache shaped as vLLM 0.32 answers them."""

    def __init__(self, *, short: bool = False, reset: bool = True) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.returned: set[tuple[int, int]] = set()
        self.in_flight = self.max_in_flight = self.resets = 0
        self.order_errors: list[str] = []
        self.short, self.reset = short, reset
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.complete)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics)
        if reset:
            self.app.router.add_post("/reset_prefix_cache", self.reset_cache)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smol", "object": "model"}]})

    async def reset_cache(self, request: web.Request) -> web.Response:
        self.resets += 1
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        n = len(self.bodies)
        return web.Response(
            text="# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="smol"}} {100.0 * n}\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="smol"}} {25.0 * n}\n'
        )

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        episode, turn = body["prompt"][1] - 100, (len(body["prompt"]) - 33) // 5
        if turn and (episode, turn - 1) not in self.returned:
            self.order_errors.append(
                f"episode {episode} turn {turn} before turn {turn - 1} returned"
            )
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        n = body["max_tokens"] - (1 if self.short else 0)
        self.returned.add((episode, turn))
        logprobs = {"tokens": ["x"] * n, "token_logprobs": [-0.5] * n, "top_logprobs": [{}] * n}
        choice = {"index": 0, "text": "x" * n, "token_ids": list(range(n)), "logprobs": logprobs}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0,
                 "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
        return web.json_response(
            {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": usage}
        )


@asynccontextmanager
async def _serve(fake: FakeVLLM | FakeLlamaCpp) -> AsyncIterator[str]:
    runner = web.AppRunner(fake.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_peer_gets_the_exact_requests_16_episodes_at_once_turns_in_order() -> None:
    fake, reqs = FakeVLLM(), _workload(episodes=40, turns=3)
    async with _serve(fake) as url:
        row = await replay(OpenAITarget(url), reqs)
    assert fake.resets == 1 and fake.max_in_flight == 16 and not fake.order_errors
    sent = {(b["prompt"][1] - 100, b["seed"]): b for b in fake.bodies}
    for r in reqs:
        b = sent[(r.episode, r.seed)]
        assert b["prompt"] == r.input_ids and b["model"] == "smol"
        assert b["max_tokens"] == b["min_tokens"] == r.completion_tokens and b["ignore_eos"] is True
        assert b["logprobs"] == 1 and b["temperature"] == r.temperature and "top_k" not in b
    assert row["completion_tokens"] == sum(r.completion_tokens for r in reqs)
    assert row["prefix_cache_share"] == 0.25 and row["cached_tokens_reported"] == 16 * len(reqs)


async def test_a_completion_shorter_than_recorded_fails_the_replay() -> None:
    async with _serve(FakeVLLM(short=True)) as url:
        with pytest.raises(RuntimeError, match="like for like"):
            await replay(OpenAITarget(url), _workload(episodes=2, turns=1))


async def test_a_peer_that_cannot_empty_its_prefix_cache_is_refused() -> None:
    """Without VLLM_SERVER_DEV_MODE=1 vLLM has no /reset_prefix_cache: later runs would be served
    warm."""
    async with _serve(FakeVLLM(reset=False)) as url:
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
            await replay(OpenAITarget(url), _workload(episodes=2, turns=1))


class FakeLlamaCpp:
    """/v1/models and /v1/completions shaped as llama-cpp-python 0.3.36's server answers them: a
    text prompt (the fake's "tokenizer" is one token per space-separated word), no token ids back,
    no cache routes or counters."""

    def __init__(self, *, extra_token: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.extra_token = extra_token
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.complete)
        self.app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smol-gguf"}]})

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        n = body["max_tokens"]
        prompt = len(body["prompt"].split()) + (1 if self.extra_token else 0)
        logprobs = {"tokens": ["x"] * n, "token_logprobs": [-0.5] * n, "top_logprobs": [{}] * n}
        choice = {"index": 0, "text": "x" * n, "logprobs": logprobs, "finish_reason": "length"}
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        return web.json_response({"id": "cmpl-1", "choices": [choice], "usage": usage})


def _words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


async def test_llama_cpp_gets_the_decoded_prompt_exact_lengths_and_no_extra_samplers() -> None:
    """The prompt goes as the decoded text (its server takes no ids), ``min_tokens = max_tokens``
    for the recorded length, and llama.cpp's own sampler stages (min-p, repetition penalty, its
    default top-k of 40) are set to their no-ops so that it samples as the recording did."""
    fake, reqs = FakeLlamaCpp(), _workload(episodes=3, turns=2)
    async with _serve(fake) as url:
        row = await replay(LlamaCppTarget(url, decode=_words), reqs)
    assert row["requests"] == 6 and row["prefix_cache_share"] is None
    by_seed = {b["seed"]: b for b in fake.bodies}
    for r in reqs:
        b = by_seed[r.seed]
        assert b["prompt"] == _words(r.input_ids) and b["model"] == "smol-gguf"
        assert b["max_tokens"] == b["min_tokens"] == r.completion_tokens and b["logprobs"] == 1
        assert b["top_k"] == 0 and b["min_p"] == 0.0 and b["repeat_penalty"] == 1.0


async def test_llama_cpp_tokenizing_the_text_otherwise_fails_the_replay() -> None:
    async with _serve(FakeLlamaCpp(extra_token=True)) as url:
        with pytest.raises(RuntimeError, match="prompt tokens"):
            await replay(LlamaCppTarget(url, decode=_words), _workload(episodes=2, turns=1))
