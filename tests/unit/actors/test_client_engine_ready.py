"""The SGLang client's readiness check, its seeds for ``n > 1`` and the policy version it reports,
against recorded SGLang bodies (tests/fixtures/sglang) replayed on loopback."""

from __future__ import annotations

import json

import pytest

from leafe.actors.client import EngineUnavailable, SGLangClient
from leafe.actors.engine import SamplingParams
from tests.unit.actors.test_client_contract import dead_url, fast_client, fixture, replay

pytestmark = pytest.mark.anyio


async def test_ready_uses_ready_then_the_routers_readiness() -> None:
    """``/ready`` where it exists (SGLang, leafe inference); the router's ``/readiness`` where
    ``/ready`` is 404; a 503 or an unreachable server is simply not ready."""
    async with replay({"/ready": (503, b"")}) as sglang:
        async with fast_client([sglang.url]) as c:
            assert not await c.ready()
            sglang.routes["/ready"] = (200, b"")
            assert await c.ready()
    async with replay({"/readiness": (200, b"")}) as router, fast_client([router.url]) as c:
        assert await c.ready()
        assert [p for p, _ in router.requests] == ["/ready", "/readiness"]
    async with fast_client([dead_url()]) as c:
        assert not await c.ready()


async def test_an_unreachable_engine_raises_engine_unavailable() -> None:
    """Refused connections and 503s on every attempt are EngineUnavailable (not the task's
    fault)."""
    async with fast_client([dead_url()], retries=1) as c:
        with pytest.raises(EngineUnavailable):
            await c.generate([1], SamplingParams())
    async with replay({"/generate": (503, b"")}) as rep, fast_client([rep.url], retries=1) as c:
        with pytest.raises(EngineUnavailable):
            await c.generate([1], SamplingParams())


async def test_n_samples_with_a_seed_are_n_requests_with_distinct_seeds() -> None:
    """``n > 1`` with a seed is never one request with a shared ``sampling_seed`` (SGLang would
    return n identical samples) nor a batch with a list of ``sampling_params`` (sglang-router 0.3.2
    answers 422): it is n requests of one sample, each with one ``sampling_params`` object and its
    own seed; without a seed it stays one request with ``n``."""
    async with (
        replay({"/generate": (200, fixture("generate_stop_eos.json"))}) as rep,
        fast_client([rep.url]) as c,
    ):
        three = await c.generate([4, 5], SamplingParams(sampling_seed=11), n=3)
    assert len(three) == 3
    bodies = [body for _, body in rep.requests]
    assert all(b["input_ids"] == [4, 5] and isinstance(b["sampling_params"], dict) for b in bodies)
    seeds = [b["sampling_params"]["sampling_seed"] for b in bodies]
    assert sorted(seeds) == sorted(set(seeds)) and 11 in seeds and len(seeds) == 3
    assert all("n" not in b["sampling_params"] for b in bodies)
    async with (
        replay({"/generate": (200, fixture("generate_n2.json"))}) as rep,
        fast_client([rep.url]) as c,
    ):
        await c.generate([4, 5], SamplingParams(), n=2)
    [(_, unseeded)] = rep.requests
    assert (
        unseeded["sampling_params"]["n"] == 2 and "sampling_seed" not in unseeded["sampling_params"]
    )


async def test_completions_carry_the_generating_servers_weight_version() -> None:
    """The version of a completion is its own ``meta_info.weight_version`` (what episodes' Steps and
    thus the learner's staleness bound read), not what ``/get_model_info`` says: behind the router
    that answers from the first healthy worker, which may serve another version."""
    info = json.loads(fixture("model_info.json"))
    info["weight_version"] = "v000001"
    routes = {
        "/generate": (200, fixture("generate_n2.json")),  # weight_version "7"
        "/get_model_info": (200, json.dumps(info).encode()),
    }
    async with replay(routes) as router, SGLangClient(router.url) as c:
        completions = await c.generate([1], SamplingParams(), n=2)
        assert await c.weight_version() == "v000001"
    assert {x.weight_version for x in completions} == {"7"}
