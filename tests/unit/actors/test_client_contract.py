"""The SGLang client against recorded SGLang response bodies (tests/fixtures/sglang), replayed by a
local aiohttp server: parsing, error shapes, retries, routing and timeouts. No model, no network
beyond loopback.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from leafe.actors.client import SGLangClient, SGLangClientConfig, error_message, parse_completions
from leafe.actors.engine import EngineError, SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sglang"
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0)

pytestmark = pytest.mark.anyio


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


@dataclass
class Replay:
    """Answers each route with a fixed status and body; records request bodies."""

    routes: dict[str, tuple[int, bytes]]
    delay_s: float = 0.0
    requests: list[tuple[str, Any]] = field(default_factory=list)
    url: str = ""
    first: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    """Answers given once each, in order, before a route falls back to ``routes``."""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, body))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        queued = self.first.get(request.path)
        default = self.routes.get(request.path, (404, fixture("not_found.json")))
        status, payload = queued.pop(0) if queued else default
        ctype = "application/json" if payload.startswith((b"{", b"[")) else "text/plain"
        return web.Response(status=status, body=payload, content_type=ctype)


@asynccontextmanager
async def replay(
    routes: dict[str, tuple[int, bytes]], delay_s: float = 0.0
) -> AsyncIterator[Replay]:
    rep = Replay(routes, delay_s)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rep.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    rep.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield rep
    finally:
        await runner.cleanup()


def dead_url() -> str:
    """A loopback URL nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def fast_client(urls: list[str], **kw: Any) -> SGLangClient:
    return SGLangClient(urls, backoff_s=0.01, max_backoff_s=0.02, **kw)


async def test_generate_parses_eos_stop_and_ignores_unknown_keys() -> None:
    """An EOS-stopped answer gives exact output ids (EOS kept), text, version and prompt length;
    extra meta_info keys are ignored; the request carries input_ids and SGLang sampling_params."""
    async with replay({"/generate": (200, fixture("generate_stop_eos.json"))}) as rep:
        async with fast_client([rep.url]) as client:
            [c] = await client.generate([1, 2, 3], PARAMS)
    assert c.output_ids == [378, 3575, 282, 4649, 314, 7042, 30, 2]
    assert c.text == " The capital of France is Paris."
    assert (c.finish_reason, c.weight_version, c.prompt_tokens, c.logprobs) == (
        "stop",
        "default",
        31,
        None,
    )
    path, body = rep.requests[0]
    assert path == "/generate" and body["input_ids"] == [1, 2, 3]
    assert body["sampling_params"] == PARAMS.to_sglang() and body["return_logprob"] is False


async def test_generate_reads_output_token_logprobs_and_length_finish() -> None:
    """``output_token_logprobs`` triples become one float per output id; a length finish, the weight
    version and cached tokens are read."""
    async with replay({"/generate": (200, fixture("generate_length_logprob.json"))}) as rep:
        async with fast_client([rep.url]) as client:
            [c] = await client.generate([5, 6], PARAMS, return_logprob=True)
    assert c.logprobs == [-0.5125, -0.0625, -1.25] and len(c.logprobs) == len(c.output_ids)
    assert (c.finish_reason, c.weight_version, c.cached_tokens) == ("length", "step-40", 8)
    assert rep.requests[0][1]["return_logprob"] is True


async def test_generate_stop_string_and_n2() -> None:
    """A stop-string finish keeps its tokens in output_ids; n=2 sends ``n`` and returns the list."""
    routes = {"/generate": (200, fixture("generate_stop_string.json"))}
    async with replay(routes) as rep, fast_client([rep.url]) as client:
        [c] = await client.generate([1], PARAMS)
        assert c.finish_reason == "stop" and c.text == "<action>left" and len(c.output_ids) == 7
        rep.routes["/generate"] = (200, fixture("generate_n2.json"))
        two = await client.generate([1], PARAMS, n=2)
    assert [x.finish_reason for x in two] == ["stop", "length"]
    assert [x.output_ids for x in two] == [[2423, 2], [1570, 1570]]
    assert rep.requests[1][1]["sampling_params"]["n"] == 2


async def test_n_mismatch_and_garbage_are_engine_errors() -> None:
    """Asking n=3 and getting 2 results, or a non-SGLang body, raises EngineError saying so."""
    async with (
        replay({"/generate": (200, fixture("generate_n2.json"))}) as rep,
        fast_client([rep.url]) as c,
    ):
        with pytest.raises(EngineError, match="n=3"):
            await c.generate([1], PARAMS, n=3)
        rep.routes["/generate"] = (200, b'{"hello": 1}')
        with pytest.raises(EngineError, match="unexpected /generate response"):
            await c.generate([1], PARAMS)


def test_abort_finish_is_returned_as_abort() -> None:
    """An aborted request parses to finish_reason "abort" with no output."""
    [c] = parse_completions(fixture("generate_abort.json"))
    assert c.finish_reason == "abort" and c.output_ids == []


def test_finish_reason_variants() -> None:
    """A plain-string or missing finish_reason and a null logprob are tolerated."""
    body = {
        "text": "a",
        "output_ids": [7],
        "meta_info": {"finish_reason": "length", "output_token_logprobs": [[None, 7, None]]},
    }
    [c] = parse_completions(json.dumps(body).encode())
    assert c.finish_reason == "length" and c.logprobs is not None and math.isnan(c.logprobs[0])
    [d] = parse_completions(
        json.dumps({"output_ids": [1], "meta_info": {"finish_reason": None}}).encode()
    )
    assert d.finish_reason == "stop" and d.weight_version == "default"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "error_plain.json",
            "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
        ),
        (
            "error_nested.json",
            "SamplingParams.__init__() got an unexpected keyword argument 'seed'",
        ),
        ("error_openai.json", "max_new_tokens must be at least 0, got -1."),
    ],
)
async def test_each_error_shape_surfaces_its_message_without_retry(name: str, message: str) -> None:
    """All three SGLang 400 bodies raise EngineError carrying the server's message; 400 is not
    retried."""
    assert error_message(fixture(name)) == message
    async with (
        replay({"/generate": (400, fixture(name))}) as rep,
        fast_client([rep.url], retries=3) as c,
    ):
        with pytest.raises(EngineError) as err:
            await c.generate([1], PARAMS)
    assert message in str(err.value) and "HTTP 400" in str(err.value)
    assert len(rep.requests) == 1


async def test_unknown_route_404_detail() -> None:
    """A 404 surfaces FastAPI's ``detail`` text."""
    async with replay({}) as rep, fast_client([rep.url]) as c:
        with pytest.raises(EngineError, match="HTTP 404: Not Found"):
            await c.model_info()


async def test_connection_errors_retry_on_the_live_server() -> None:
    """A dead server is skipped after its connection error; the request succeeds on the live one."""
    async with replay({"/generate": (200, fixture("generate_stop_eos.json"))}) as rep:
        async with fast_client([dead_url(), rep.url]) as c:
            for _ in range(3):
                [out] = await c.generate([1], PARAMS)
                assert out.output_ids[-1] == 2
    assert len(rep.requests) == 3


async def test_all_servers_down_names_every_server() -> None:
    """When every server refuses connections, EngineError names each URL after the retries."""
    urls = [dead_url(), dead_url()]
    async with fast_client(urls, retries=2) as c:
        with pytest.raises(EngineError) as err:
            await c.generate([1], PARAMS)
    text = str(err.value)
    assert "failed on every inference server after 3 attempts" in text
    assert all(u in text for u in urls)


async def test_503_is_retried_then_reported() -> None:
    """A 503 (server starting or overloaded) is retried; if it persists the error says HTTP 503."""
    async with replay({"/generate": (503, b"")}) as rep, fast_client([rep.url], retries=2) as c:
        with pytest.raises(EngineError, match="HTTP 503"):
            await c.generate([1], PARAMS)
    assert len(rep.requests) == 3


async def test_least_loaded_routing_spreads_concurrent_requests() -> None:
    """Concurrent requests go to the server with fewest in flight, so two slow servers share them
    evenly."""
    body = (200, fixture("generate_stop_eos.json"))
    async with replay({"/generate": body}, 0.2) as a, replay({"/generate": body}, 0.2) as b:
        async with fast_client([a.url, b.url]) as c:
            await asyncio.gather(*(c.generate([i + 1], PARAMS) for i in range(6)))
    assert (len(a.requests), len(b.requests)) == (3, 3)


async def test_timeout_is_not_retried() -> None:
    """A request that outlives timeout_s raises EngineError naming the timeout, without a second
    try."""
    async with replay({"/generate": (200, fixture("generate_stop_eos.json"))}, 1.0) as rep:
        async with fast_client([rep.url], timeout_s=0.2) as c:
            with pytest.raises(EngineError, match=r"timed out after 0\.2 s"):
                await c.generate([1], PARAMS)
    assert len(rep.requests) == 1


async def test_update_weights_reports_each_server() -> None:
    """update_weights_from_disk posts model_path and weight_version to every server and returns one
    result each: success, SGLang's failure message, or unreachable."""
    ok = {"/update_weights_from_disk": (200, fixture("update_weights_ok.json"))}
    bad = {"/update_weights_from_disk": (400, fixture("update_weights_failed.json"))}
    down = dead_url()
    async with replay(ok) as a, replay(bad) as b, fast_client([a.url, b.url, down]) as c:
        results = await c.update_weights_from_disk("/weights/step-40", "step-40")
    by_url = {r.url: r for r in results}
    assert by_url[a.url].success and "Weight version updated to step-40" in by_url[a.url].message
    assert not by_url[b.url].success and "repository not found" in by_url[b.url].message
    assert not by_url[down].success and "unreachable" in by_url[down].message
    assert a.requests[0][1] == {"model_path": "/weights/step-40", "weight_version": "step-40"}


async def test_model_info_weight_version_and_health() -> None:
    """weight_version comes from /model_info; health is per server (empty 200 body = healthy)."""
    routes = {"/model_info": (200, fixture("model_info.json")), "/health": (200, b"")}
    down = dead_url()
    async with replay(routes) as rep, fast_client([rep.url]) as c:
        assert await c.weight_version() == "step-40"
        assert (await c.model_info())["served_model_name"] == "SmolLM2-135M-Instruct"
    async with replay(routes) as rep, fast_client([rep.url, down]) as c:
        assert await c.health() == {rep.url: True, down: False}


async def test_bad_arguments_fail_before_sending() -> None:
    """An empty prompt or n < 1 is refused locally."""
    async with fast_client([dead_url()]) as c:
        with pytest.raises(EngineError, match="non-empty prompt"):
            await c.generate([], PARAMS)
        with pytest.raises(EngineError, match="n must be"):
            await c.generate([1], PARAMS, n=0)


def _with_abort(
    name: str, status: int | None, message: str = "Abort all requests (weight update)."
) -> bytes:
    """``name``'s body with every result's finish_reason turned into an abort carrying
    ``status``."""
    data = json.loads(fixture(name))
    for out in data if isinstance(data, list) else [data]:
        out["output_ids"], out["text"] = [], ""
        reason = {"type": "abort", "message": message, "status_code": status, "err_type": None}
        out["meta_info"]["finish_reason"] = reason
    return json.dumps(data).encode()


async def test_an_aborted_generation_is_sent_again_and_never_returned() -> None:
    """An abort (e.g. a weight update with abort_all_requests) is retried; the caller gets the
    retry's completion, never the empty aborted one."""
    async with replay({"/generate": (200, fixture("generate_stop_eos.json"))}) as rep:
        rep.first["/generate"] = [(200, fixture("generate_abort.json"))]
        async with fast_client([rep.url]) as c:
            [out] = await c.generate([1, 2], PARAMS)
    assert out.finish_reason == "stop" and out.output_ids[-1] == 2
    assert [path for path, _ in rep.requests] == ["/generate", "/generate"]
    assert rep.requests[0][1] == rep.requests[1][1]


async def test_one_aborted_result_of_n_retries_the_request() -> None:
    """With n=2, one aborted result among the two sends the request again; both returned completions
    come from the answer without an abort."""
    n2 = json.loads(fixture("generate_n2.json"))
    n2[1]["meta_info"]["finish_reason"] = {
        "type": "abort",
        "message": "scheduler",
        "status_code": 503,
    }
    async with replay({"/generate": (200, fixture("generate_n2.json"))}) as rep:
        rep.first["/generate"] = [(200, json.dumps(n2).encode())]
        async with fast_client([rep.url]) as c:
            two = await c.generate([1], PARAMS, n=2)
    assert [x.finish_reason for x in two] == ["stop", "length"] and len(rep.requests) == 2


async def test_a_persistent_abort_is_an_engine_error() -> None:
    """Aborted on every attempt: EngineError with the server's abort message after abort_retries + 1
    requests (no completion comes back to become a Step)."""
    async with replay({"/generate": (200, fixture("generate_abort.json"))}) as rep:
        async with fast_client([rep.url], abort_retries=2) as c:
            with pytest.raises(
                EngineError, match=r"aborted.*Abort before prefill.*after 3 attempt"
            ):
                await c.generate([1], PARAMS)
    assert len(rep.requests) == 3


async def test_an_abort_with_status_400_is_raised_at_once() -> None:
    """An abort that says the request is bad (status 400) is not sent again."""
    body = _with_abort(
        "generate_stop_eos.json", 400, "The input is longer than the context length."
    )
    async with (
        replay({"/generate": (200, body)}) as rep,
        fast_client([rep.url], abort_retries=3) as c,
    ):
        with pytest.raises(EngineError, match="longer than the context length"):
            await c.generate([1], PARAMS)
    assert len(rep.requests) == 1


async def test_an_aborted_retry_moves_to_another_server() -> None:
    """An abort on one server (its weights are being swapped) is retried on the least-loaded server,
    which may be another one; whichever answers, the result is a real completion."""
    body = (200, fixture("generate_stop_eos.json"))
    async with (
        replay({"/generate": (200, fixture("generate_abort.json"))}) as bad,
        replay({"/generate": body}) as good,
    ):
        async with fast_client([bad.url, good.url], abort_retries=4) as c:
            outs = [await c.generate([1], PARAMS) for _ in range(3)]
    assert all(o.finish_reason == "stop" for [o] in outs)
    assert len(good.requests) == 3 and len(bad.requests) >= 1


async def test_model_info_falls_back_to_get_model_info_on_404() -> None:
    """A server without /model_info (the sglang router of 0.5.23) is asked /get_model_info; the
    route that answered is used from then on."""
    routes = {"/get_model_info": (200, fixture("model_info.json"))}
    async with replay(routes) as rep, fast_client([rep.url]) as c:
        assert await c.weight_version() == "step-40"
        assert await c.weight_version() == "step-40"
    assert [p for p, _ in rep.requests] == ["/model_info", "/get_model_info", "/get_model_info"]


async def test_model_info_missing_on_both_routes_names_them() -> None:
    """If neither route exists, the error names both 404s."""
    async with replay({}) as rep, fast_client([rep.url]) as c:
        with pytest.raises(EngineError) as err:
            await c.model_info()
    assert "/model_info" in str(err.value) and "/get_model_info" in str(err.value)


async def test_timeout_comes_from_the_client_config() -> None:
    """``SGLangClient.from_config`` applies the config's request timeout (what actors and leafe eval
    pass through), and a per-call ``timeout_s`` still overrides it."""
    config = SGLangClientConfig(timeout_s=0.2, backoff_s=0.01)
    async with replay({"/generate": (200, fixture("generate_stop_eos.json"))}, 0.5) as rep:
        async with SGLangClient.from_config([rep.url], config) as c:
            assert c.config == config
            with pytest.raises(EngineError, match=r"timed out after 0\.2 s"):
                await c.generate([1], PARAMS)
            [out] = await c.generate([1], PARAMS, timeout_s=5.0)
    assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    ("field_name", "value"),
    [("timeout_s", 0.0), ("retries", -1), ("abort_retries", -2), ("backoff_s", -1.0)],
)
def test_client_config_rejects_bad_values(field_name: str, value: float) -> None:
    """A non-positive timeout or a negative count is refused, naming the field and the value."""
    with pytest.raises(ValueError, match=f"{field_name} must be .*{value}"):
        SGLangClientConfig(**{field_name: value})
    with pytest.raises(ValueError, match=field_name):
        SGLangClient(["http://127.0.0.1:1"], **{field_name: value})


async def test_an_abort_never_becomes_a_step() -> None:
    """Through the real episode code: an abort that persists raises out of the rollout before any
    Step is emitted (the episode stays unfinished and is retried), and an abort followed by a real
    answer gives Steps with the real answer's exact output ids."""
    from leafe.actors.config import RolloutConfig
    from leafe.actors.episode import EpisodeSpec, ListSink
    from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv
    from leafe.actors.rollout import run_rollout
    from leafe.protocol.events import Step

    spec = EpisodeSpec(
        run_id="r1",
        episode_id="k.a1",
        actor_id="a",
        task_key="k",
        env="corridor",
        task_id="corridor/test/00002",
        mode="eval",
        seed=10,
    )
    answer = {"text": "<action>left</action>", "output_ids": [60, 97, 62], "meta_info": {"id": "x"}}

    async def rollout(rep: Replay, sink: ListSink) -> ListSink:
        async with fast_client([rep.url], abort_retries=1) as c:
            await run_rollout(
                engine=c,
                tokenizer=ByteChatTokenizer(),
                env=CorridorEnv(),
                spec=spec,
                config=RolloutConfig(horizon=2),
                sink=sink,
            )
        return sink

    info = (200, fixture("model_info.json"))
    aborted = ListSink()
    async with replay(
        {"/generate": (200, fixture("generate_abort.json")), "/model_info": info}
    ) as rep:
        with pytest.raises(EngineError, match="aborted"):
            await rollout(rep, aborted)
    assert aborted.events == [], "an abort is no completion: not even EpisodeStarted is emitted"
    async with replay(
        {"/generate": (200, json.dumps(answer).encode()), "/model_info": info}
    ) as rep:
        rep.first["/generate"] = [(200, fixture("generate_abort.json"))]
        steps = [e for e in (await rollout(rep, ListSink())).events if isinstance(e, Step)]
    assert steps and all(s.token_ids == [60, 97, 62] for s in steps)
