"""The whole pipeline on a 3-node NATS cluster (R3 streams) with 4 actor processes and 2 inference
servers, as `leafe run` starts it against external NATS and engine URLs. Mid-run, either the node
leading LEAFE_EVENTS is SIGKILLed and restarted, or one inference server is SIGKILLed for good (the
actors must fail over to the other URL). The run finishes; the samples the learner consumed equal
`leafe replay`'s rebuild of the exported log, each stored once and trained or dropped once: 0 lost,
0 duplicated.

Printed figures: seconds from the kill to the next event stored in LEAFE_EVENTS (recovery), and for
the NATS node the seconds until the restarted node is a current replica again.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from rich.console import Console

from leafe.protocol.subjects import EVENTS, SAMPLES, learner_durable, samples_filter
from leafe.services.bus import connect, read_stream
from leafe.services.bus.nats_cluster import NatsCluster
from leafe.services.bus.nats_server import free_port
from leafe.services.run.context import RunContext
from leafe.services.run.presets import resolve_run_config
from leafe.services.run.stages import run_stages
from leafe.services.run.supervisor import ServiceProcess, wait_http_ok
from tests.support.cluster import stream_leader

# Each run takes minutes on 2 cores (9 Python services and 3 nats-servers); the default set keeps
# tests/integration/cluster/test_nats_cluster.py (the leader kill with a Publisher, ~10 s).
pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.slow]

ACTORS = 4


async def _start_engines(
    model_dir: Path, run_dir: Path, stack: AsyncExitStack
) -> list[tuple[ServiceProcess, str]]:
    """Two `leafe inference` processes (not supervised by the run, so a killed one stays dead) that
    load the learner's pushes from the run's weights directory, as `leafe run`'s own engines do."""
    logs = run_dir / "logs"
    engines = []
    for i in range(2):
        port = free_port()
        argv = [
            "inference",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--max-batch",
            "4",
            "--threads",
            "1",
            "--weights-root",
            str(run_dir / "weights"),
        ]
        proc = ServiceProcess(f"inference-{i}", argv, logs / f"inference-{i}.log")
        await proc.start()
        stack.push_async_callback(proc.stop)
        engines.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in engines:
        await wait_http_ok(f"{url}/health", proc)
    return engines


async def _last_seq(js: Any) -> int:
    return int((await js.stream_info(EVENTS.name)).state.last_seq)


async def _next_event_after(js: Any, seq: int, killed_at: float, timeout_s: float = 120.0) -> float:
    """Seconds from ``killed_at`` until LEAFE_EVENTS holds a message past ``seq``."""
    while time.monotonic() - killed_at < timeout_s:
        try:
            if await _last_seq(js) > seq:
                return time.monotonic() - killed_at
        except Exception:  # no stream leader yet / reconnecting
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"no event stored within {timeout_s}s of the kill")


async def _load(url: str) -> tuple[int, int]:
    """(requests running or waiting, requests finished) on one engine, from ``/get_server_info``."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/get_server_info") as resp:
        state = (await resp.json())["internal_states"][0]
    return int(state["running"]) + int(state["waiting"]), int(state["finished"])


async def _busiest(engines: list[tuple[ServiceProcess, str]], window_s: float = 0.5) -> int:
    """The engine the run is using now: most requests in flight, then most finished within a short
    window. Actors keep an episode on one engine (prefix affinity), so killing a fixed index may hit
    an engine no remaining episode uses, and the failover would go untested."""
    before = [await _load(url) for _, url in engines]
    await asyncio.sleep(window_s)
    after = [await _load(url) for _, url in engines]
    score = [(a[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    return max(range(len(engines)), key=lambda i: score[i])


async def _chaos(
    ctx: RunContext, victim: str, cluster: NatsCluster, engines: list[tuple[ServiceProcess, str]]
) -> dict[str, Any]:
    """Wait until the run is well under way, kill the victim, time the recovery."""
    while ctx.progress is None or ctx.progress.steps < 12:  # noqa: ASYNC110 (the follower owns the counter)
        await asyncio.sleep(0.2)
    figures: dict[str, Any] = {"victim": victim, "steps_at_kill": ctx.progress.steps}
    seq = await _last_seq(ctx.jetstream)
    if victim == "nats":
        node = cluster.index_of(await stream_leader(ctx.jetstream, EVENTS.name))
        cluster.kill(node)
    else:
        target = await _busiest(engines)
        seq = await _last_seq(ctx.jetstream)
        engines[target][0].kill()
        figures["killed_engine"] = target
    killed_at = time.monotonic()
    figures["recovery_s"] = await _next_event_after(ctx.jetstream, seq, killed_at)
    if victim == "nats":
        await asyncio.sleep(2.0)  # down for a while: the others go on without it
        cluster.restart(node)
        figures["rejoined_healthy_s"] = await asyncio.to_thread(cluster.wait_healthy, node, 120.0)
        figures["killed_node"] = f"n{node}"
        figures["new_leader"] = await stream_leader(ctx.jetstream, EVENTS.name)
    return figures


async def _stored_sample_ids(js: Any, run_id: str) -> list[str]:
    msgs = [
        m async for m in read_stream(js, stream=SAMPLES.name, filter_subject=samples_filter(run_id))
    ]
    return [(m.headers or {})["Nats-Msg-Id"] for m in msgs]


def _learner_totals(log_path: Path) -> dict[str, Any]:
    """The learner's final progress (``learner.stopped``): samples trained and dropped, in total."""
    stopped = [json.loads(x) for x in log_path.read_text().splitlines() if '"learner.stopped"' in x]
    assert stopped, f"the learner never stopped cleanly; see {log_path}"
    return stopped[-1]


def _retries_to(logs: Path, url: str) -> int:
    return sum(
        1
        for path in logs.glob("actor-*.log")
        for line in path.read_text(errors="replace").splitlines()
        if '"engine.request.retry"' in line and url in line
    )


@pytest.mark.parametrize("victim", ["nats", "inference"])
async def test_pipeline_on_a_cluster_survives_a_kill(
    victim: str, tmp_path: Path, cache_dir: Path, nats_cluster: NatsCluster, replicated: int
) -> None:
    """4 actors, 2 engines, R3 streams; one NATS node (the events leader) or one engine SIGKILLed
    mid-run: every task finishes, stream samples == offline rebuild, each stored once, and the
    learner trained or dropped each exactly once."""
    from leafe.learner.model_io import resolve_model

    run_dir = tmp_path / "runs" / "cluster"
    logs = run_dir / "logs"
    async with AsyncExitStack() as stack:
        engines = await _start_engines(
            await asyncio.to_thread(resolve_model, "tiny"), run_dir, stack
        )
        overrides = {
            "runs_dir": str(tmp_path / "runs"),
            "run_id": "cluster",
            "budget_minutes": 8.0,
            "eval": {"before": False, "after": False},
            "explore": {"tasks": 24},
            "services": {
                "actors": ACTORS,
                "actor_concurrency": 1,
                "nats_url": nats_cluster.url,
                "stream_replicas": replicated,
                "engines": [url for _, url in engines],
            },
            "actor": {"ack_wait_s": 10.0, "in_progress_interval_s": 3.0},
            "replayer": {"ack_wait_s": 10.0},
            "learner": {"ack_wait_s": 10.0},
        }
        config = resolve_run_config("tiny", overrides=overrides)
        ctx = RunContext(
            config=config, console=Console(file=io.StringIO()), stop=asyncio.Event(), live=False
        )
        run = asyncio.create_task(run_stages(ctx))
        chaos = asyncio.create_task(_chaos(ctx, victim, nats_cluster, engines))
        await run
        figures = await chaos
    nc = await connect(nats_cluster.url)
    try:
        js = nc.jetstream()
        info = await js.consumer_info(SAMPLES.name, learner_durable(config.run_id))
        stored = await _stored_sample_ids(js, config.run_id)
    finally:
        await nc.close()
    totals = _learner_totals(logs / "learner.log")
    figures.update(
        samples=len(stored), trained=totals["samples_trained"], dropped=totals["samples_dropped"]
    )
    if victim == "inference":
        figures["retries_to_dead_engine"] = _retries_to(logs, engines[figures["killed_engine"]][1])
    print(f"\ncluster pipeline, {victim} killed: {figures}")
    report = json.loads((ctx.run_dir / "report.json").read_text())
    assert report["dataset"]["identical"], report["dataset"]
    assert ctx.progress is not None and set(ctx.explore_keys) <= ctx.progress.finished_keys, report
    assert stored, "no samples were produced; the test would prove nothing"
    assert len(stored) == len(set(stored)), "a sample was stored twice"
    assert info.num_pending == 0 and info.num_ack_pending == 0, f"samples left unconsumed: {info}"
    assert totals["samples_trained"] + totals["samples_dropped"] == len(stored), (
        totals,
        len(stored),
    )
    if victim == "inference":
        assert figures["retries_to_dead_engine"] > 0, (
            "no actor ever hit the dead engine: failover untested"
        )
