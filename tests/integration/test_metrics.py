"""Every long-running service's /metrics during a tiny run, in-process against the session's
nats-server: an actor (scripted engine, corridor env) explores, the replayer folds its events into
samples (and dead-letters two bad messages), the learner trains and pushes, weight sync loads the
push into a CPU inference server (tiny model) that also serves a few generations. Each endpoint is
scraped over HTTP and parsed with prometheus-client's parser; the counters show what happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from leafe.actors.client import SGLangClient
from leafe.actors.config import ActorServiceConfig
from leafe.actors.engine import SamplingParams
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.learner.checkpoint import Progress
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from leafe.learner.executor import Executor
from leafe.learner.materializers import make_materializer
from leafe.learner.trainer import Trainer
from leafe.protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, decode_event, encode
from leafe.protocol.events import EpisodeStarted
from leafe.protocol.subjects import event_subject, task_subject
from leafe.protocol.tasks import TaskAssignment
from leafe.services.actor.service import ActorService
from leafe.services.bus import Publisher, connect, ensure_streams, read_stream
from leafe.services.bus.nats_server import free_port
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.learner.service import OnlineLearner
from leafe.services.metrics import (
    ActorMetrics,
    InferenceCollector,
    LearnerMetrics,
    MetricsServer,
    ReplayerMetrics,
    WeightSyncMetrics,
    serve_metrics,
)
from leafe.services.replayer.service import Replayer, ReplayerConfig
from leafe.services.run.metrics import parse_samples, scrape
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]
TASKS = 4


def _script(kind: str, prompt: str) -> str:
    """Walk into the pit first; the reflection says go right; with the lesson (or later) go
    right."""
    if kind == "reflection":
        return "<step>0</step><experience>go right</experience>"
    return "<action>left</action>" if "(step 0)" in prompt and "Lesson" not in prompt else "right"


def _tasks(run_id: str) -> list[TaskAssignment]:
    return [
        TaskAssignment(
            task_key=f"{run_id}-corridor-{i}",
            run_id=run_id,
            env="corridor",
            task_id=f"corridor/train/{i:05d}",
            mode="explore",
            seed=i,
        )
        for i in range(TASKS)
    ]


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def _serve(stack: AsyncExitStack, registry: CollectorRegistry) -> str:
    server = serve_metrics(free_port(), registry, "127.0.0.1")
    assert isinstance(server, MetricsServer)
    stack.callback(server.close)
    return f"http://127.0.0.1:{server.port}/metrics"


async def _metrics(url: str) -> dict[str, float]:
    return parse_samples(await scrape(url))


async def _healthz(metrics_url: str) -> tuple[int, str]:
    url = metrics_url.removesuffix("/metrics") + "/healthz"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, (await resp.text()).strip()


async def _bad_messages(js: Any, run_id: str) -> None:
    """One undecodable message and one event of another run on this run's events subject."""
    await js.publish(
        event_subject(run_id, "step", "junk"),
        b"\x00 not an event",
        headers={MSG_ID_HEADER: f"{run_id}-junk", CODEC_HEADER: CODEC_VERSION},
    )
    async for msg in read_stream(
        js, stream="LEAFE_EVENTS", filter_subject=f"leafe.{run_id}.events.episode_started.*"
    ):
        event = decode_event(msg.data, (msg.headers or {}).get(CODEC_HEADER))
        assert isinstance(event, EpisodeStarted)
        alien = msgspec.structs.replace(
            event, run_id="another-run", event_id=f"{event.event_id}-alien"
        )
        headers = {MSG_ID_HEADER: alien.event_id, CODEC_HEADER: CODEC_VERSION}
        subject = event_subject(run_id, "episode_started", alien.actor_id)
        await js.publish(subject, encode(alien), headers=headers)
        return


async def test_every_service_exports_parseable_metrics_that_move(
    nats_url: str, run_id: str, dist_env: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    """Actor: episodes by outcome, steps, reflections, rollbacks, branches, engine latency.
    Replayer: events, samples by kind, dead letters by category, lag. Learner: steps, loss,
    tokens/s, position. Weight sync: the engine's version index and update time. Inference: tokens,
    batch sizes, cache hits."""
    tok = ByteChatTokenizer()
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(nc.close)
        inference = await stack.enter_async_context(
            InferenceServer(
                InferenceConfig(
                    model=str(tiny_dir), port=0, threads=1, max_batch=4, weights_root=str(tmp_path)
                )
            )
        )
        inference_registry = CollectorRegistry()
        inference_registry.register(
            InferenceCollector(lambda: inference.engine.describe() if inference.engine else None)
        )
        urls = {"inference": _serve(stack, inference_registry)}

        # Actor: every task explored to completion.
        async with Publisher(js) as pub:
            for task in _tasks(run_id):
                await pub.publish(task_subject(run_id), task)
        actor = ActorService(
            nc=nc,
            run_id=run_id,
            engine=ScriptedEngine(script=_script),
            tokenizer=tok,
            config=ActorServiceConfig(concurrency=2),
            actor_id="actor-m",
            env_factory=lambda name, **options: CorridorEnv(),
            max_tasks=TASKS,
            metrics=ActorMetrics(),
        )
        urls["actor"] = _serve(stack, actor.metrics.registry)
        stats = await asyncio.wait_for(actor.run(), 60)
        assert stats.done == TASKS
        await _bad_messages(js, run_id)

        # Replayer, learner and weight sync run together until the push is served.
        replayer = Replayer(
            js,
            run_id=run_id,
            fold=make_materializer("leafe", tok),
            config=ReplayerConfig(fetch_timeout_s=0.2),
            metrics=ReplayerMetrics(),
        )
        urls["replayer"] = _serve(stack, replayer.metrics.registry)
        trainer_cfg = TrainerConfig(
            optim=OptimConfig(lr=1e-3),
            batch=BatchConfig(global_batch=2),
            checkpoint_every=1,
            push_every=1,
        )
        cfg = LearnerConfig(trainer=trainer_cfg, max_batch_wait_s=0.3, ack_wait_s=30.0)
        executor = Executor(
            Trainer(trainer_cfg, tiny_dir, dist_env), tmp_path / "ckpt", keep_checkpoints=1
        )
        learner = OnlineLearner(
            cfg,
            executor,
            Progress(),
            run_id=run_id,
            nats=nats_url,
            store=tmp_path / "store",
            base_model="tiny",
            metrics=LearnerMetrics(),
        )
        urls["learner"] = _serve(stack, learner.metrics.registry)
        sync_cfg = WeightSyncConfig(servers=[inference.url], reconcile_interval_s=1.0)
        sync = WeightSync(sync_cfg, run_id=run_id, metrics=WeightSyncMetrics())
        urls["weight-sync"] = _serve(stack, sync.metrics.registry)
        await replayer.start()
        loops = [
            asyncio.create_task(replayer.run(stop)),
            asyncio.create_task(learner.run(stop)),
            asyncio.create_task(sync.run(nats_url, stop)),
        ]
        try:
            engine = f'leafe_weight_sync_version{{engine="{inference.url}"}}'

            async def pushed_and_served() -> bool:
                return (await _metrics(urls["weight-sync"])).get(engine, 0) >= 1

            await _until(pushed_and_served, "a pushed version served by the inference server")
            got = {name: await _metrics(url) for name, url in urls.items()}
            health = {name: await _healthz(url) for name, url in urls.items()}
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*loops), 120)
        # With the learner and weight sync stopped no push can land between the two prompts (a
        # weight update empties the prefix cache: under load one did, and the second prompt missed).
        async with SGLangClient(inference.url) as client:
            for _ in range(2):  # the second prompt is a prefix-cache hit
                await client.generate(list(range(5, 40)), SamplingParams(max_new_tokens=4), n=2)
        got["inference"] = await _metrics(urls["inference"])

    # /healthz on the same port: the actor has stopped (its consumer closed), replayer and learner
    # run.
    assert health["actor"] == (503, "actor: consumer not bound")
    for name in ("replayer", "learner"):
        assert health[name][0] == 200 and health[name][1].startswith(f"{name}: ok, consumer "), (
            health[name]
        )
    assert (
        health["weight-sync"][0] == 200 and health["inference"][0] == 200
    )  # nothing attached to check
    actor_m, replayer_m, learner_m = got["actor"], got["replayer"], got["learner"]
    assert actor_m['leafe_actor_episodes_total{mode="explore",outcome="success"}'] == TASKS
    assert actor_m["leafe_actor_steps_total"] > TASKS
    for what in ("reflections", "rollbacks", "branches"):
        assert actor_m[f"leafe_actor_{what}_total"] >= TASKS, what
    assert actor_m["leafe_actor_engine_latency_seconds_count"] >= actor_m["leafe_actor_steps_total"]
    assert actor_m["leafe_actor_episodes_in_flight"] == 0

    assert replayer_m["leafe_replayer_events_total"] > actor_m["leafe_actor_steps_total"]
    assert replayer_m['leafe_replayer_samples_total{kind="cf"}'] >= TASKS
    assert replayer_m['leafe_replayer_dead_letters_total{reason="undecodable"}'] == 1
    assert replayer_m['leafe_replayer_dead_letters_total{reason="wrong_run"}'] == 1
    assert (
        replayer_m["leafe_replayer_open_episodes"] == 0
        and "leafe_replayer_consumer_lag" in replayer_m
    )

    assert learner_m["leafe_learner_steps_total"] >= 1 and learner_m["leafe_learner_step"] >= 1
    assert learner_m['leafe_learner_loss{term="total"}'] > 0
    assert (
        learner_m["leafe_learner_tokens_per_second"] > 0
        and learner_m["leafe_learner_samples_seq"] > 0
    )
    assert learner_m["leafe_learner_push_seconds_count"] >= 1
    assert learner_m["leafe_learner_checkpoint_seconds_count"] >= 1

    assert got["weight-sync"]["leafe_weight_sync_push_seconds_count"] >= 1

    inf = got["inference"]
    assert (
        inf["leafe_inference_prefill_tokens_total"] > 0
        and inf["leafe_inference_decode_tokens_total"] > 0
    )
    assert inf["leafe_inference_prefix_cache_hit_tokens_total"] > 0
    assert inf["leafe_inference_batch_size_count"] > 0 and inf["leafe_inference_queue_depth"] == 0
