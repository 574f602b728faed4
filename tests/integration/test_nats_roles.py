"""Each service's real code does its whole job under its own NATS role, on the session server
running deploy/base/nats/permissions.json: the actor (its durable on the tasks, events, a dead
letter, the weights announcements), the replayer (events, recovery reads after a crash, samples),
the learner (samples, a push) and weight sync (the latest announcement and new ones), without one
operation refused. The durables are the admin's (``leafe streams ensure --run``:
:func:`leafe.services.admin.streams.durables_for_run`); each service binds its own, waiting for it
when it is not there yet.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.actors.fake_episodes import ExploreSpec, build_explore_episode, interleave
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.learner.checkpoint import Progress
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from leafe.learner.executor import Executor
from leafe.learner.materializers import fold_events, make_materializer
from leafe.learner.model_io import HFChatTokenizer
from leafe.learner.trainer import Trainer
from leafe.protocol import WeightsPublished, decode_weights, weights_subject
from leafe.protocol.codec import decode_sample
from leafe.protocol.subjects import (
    EVENTS,
    SAMPLES,
    TASKS,
    WEIGHTS,
    dead_letter_subject,
    task_subject,
)
from leafe.protocol.subjects import replayer_durable as replayer_durable_name
from leafe.protocol.tasks import TaskAssignment
from leafe.services.actor.service import ActorService
from leafe.services.admin.streams import durables_for_run
from leafe.services.bus import (
    NatsOptions,
    Publisher,
    ensure_durables,
    read_stream,
    wait_for_streams,
)
from leafe.services.bus.dead_letters import letters_filter
from leafe.services.learner.service import OnlineLearner
from leafe.services.replayer import service as replayer_service
from leafe.services.replayer.replay import stream_events
from leafe.services.replayer.service import Replayer, ReplayerConfig
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig
from tests.support.acks import settled_counts
from tests.support.learner import make_sample, publish_samples
from tests.support.nats_auth import RoleClient, stored

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def publish_events(client: RoleClient, events: list[Any]) -> None:
    async with Publisher(client.js) as pub:
        for e in events:
            await pub.publish_event(e)


def _weights(run_id: str, version: str, uri: str = "/nowhere") -> WeightsPublished:
    return WeightsPublished(
        event_id=f"weights.{run_id}.{version}",
        run_id=run_id,
        version=version,
        uri=uri,
        manifest_sha256="0" * 64,
        learner_step=1,
        base_model="tiny",
    )


async def test_the_actor_serves_tasks_under_its_own_identity(
    nats_roles: dict[str, NatsOptions], admin_client: RoleClient, run_id: str
) -> None:
    """As `actor`: the durable on LEAFE_TASKS, events published, an undecodable task dead-lettered,
    the latest weights read and followed, every task acked; not one operation refused."""
    tasks = [
        TaskAssignment(
            task_key=f"{run_id}-c{i}",
            run_id=run_id,
            env="corridor",
            task_id=f"corridor/train/{i:05d}",
            seed=i,
        )
        for i in range(2)
    ]
    await admin_client.js.publish(
        task_subject(run_id), b"not a task"
    )  # first: the actor stops after 2 tasks
    async with Publisher(admin_client.js) as pub:
        for task in tasks:
            await pub.publish(task_subject(run_id), task)
    async with RoleClient(nats_roles["learner"]) as learner, Publisher(learner.js) as pub:
        await pub.publish(weights_subject(run_id), _weights(run_id, "v000001"))
    config = ActorServiceConfig(concurrency=2)
    async with RoleClient(nats_roles["actor"]) as client:
        service = ActorService(
            nc=client.nc,
            run_id=run_id,
            engine=ScriptedEngine(),
            tokenizer=ByteChatTokenizer(),
            config=config,
            actor_id="actor-0",  # its credentials are actor.actor-0: events on its own token only
            env_factory=lambda name, **kw: CorridorEnv(),
            max_tasks=len(tasks),
            streams_timeout_s=5.0,
        )
        running = asyncio.create_task(service.run())
        await asyncio.sleep(1.0)  # the actor waits for its durable, as for its streams
        assert not running.done()
        await ensure_durables(admin_client.js, durables_for_run(run_id, actor=config))
        stats = await asyncio.wait_for(running, timeout=60)
        assert client.violations == []
    assert (stats.done, stats.failed) == (2, 0)
    assert service.latest_weights == "v000001"
    events = [
        m
        async for m in read_stream(
            admin_client.js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.>"
        )
    ]
    assert {m.headers["Nats-Msg-Id"].split(".")[0] for m in events} >= {t.task_key for t in tasks}
    # the actor's own letters: leafe.<run>.dead.leafe_tasks.actor-0.<seq>
    letters = letters_filter(dead_letter_subject(run_id, TASKS.name))
    assert await stored(admin_client.js, letters) == 1
    assert await settled_counts(admin_client.js, TASKS.name, service.durable) == (0, 0)


async def test_the_replayer_folds_and_recovers_under_its_own_identity(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    tokenizer: HFChatTokenizer,
) -> None:
    """As `replayer` (events published as `actor`): cancelled mid-stream and restarted (recovery
    reads the unreleased episodes by sequence, with no consumer of its own), it publishes exactly
    the offline rebuild's samples; not one operation refused."""
    episodes = [
        build_explore_episode(
            ExploreSpec(seed=i, max_depth=2, budget=12, horizon=4, p_success=0.3, reflect_every=2),
            run_id=run_id,
            episode_id=f"{run_id}-ep{i}",
            tokenizer=tokenizer,
        )
        for i in range(6)
    ]
    events = interleave(episodes, random.Random(3))
    half = len(events) // 2
    config = ReplayerConfig(
        materializer="leafe",
        model="tiny",
        batch=8,
        ack_wait_s=2.0,
        fetch_timeout_s=0.2,
        stale_check_s=0.5,
    )
    await ensure_durables(admin_client.js, durables_for_run(run_id, replayer=config))
    async with (
        RoleClient(nats_roles["actor"]) as actor,
        RoleClient(nats_roles["replayer"]) as client,
    ):
        await publish_events(actor, events[:half])
        await wait_for_streams(client.js, replayer_service.STREAMS_USED, timeout_s=5.0)
        first = Replayer(
            client.js,
            run_id=run_id,
            fold=make_materializer("leafe", tokenizer, rehearsal_fraction=1.0),
            config=config,
        )
        task = asyncio.create_task(first.run(asyncio.Event()))
        await _until(lambda: first.fold.stats.events >= half, "the first half folded")
        task.cancel()  # episodes still open: their events stay unacked, for the restart to recover
        await asyncio.gather(task, return_exceptions=True)
        await publish_events(actor, events[half:])
        second = Replayer(
            client.js,
            run_id=run_id,
            fold=make_materializer("leafe", tokenizer, rehearsal_fraction=1.0),
            config=config,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(second.run(stop))
        durable = replayer_durable_name(run_id, "leafe")

        async def settled() -> bool:
            info = await admin_client.js.consumer_info(EVENTS.name, durable)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await _until_async(settled, "every event folded and acked")
        stop.set()
        await task
        assert (actor.violations, client.violations) == ([], [])
    assert second.stats.recovered_events > 0
    online = [
        decode_sample(m.data).sample_id
        async for m in read_stream(
            admin_client.js, stream=SAMPLES.name, filter_subject=f"leafe.{run_id}.samples.>"
        )
    ]
    offline = fold_events(
        [e async for e in stream_events(admin_client.js, run_id)],
        make_materializer("leafe", tokenizer, rehearsal_fraction=1.0),
    )
    assert online and sorted(online) == sorted(s.sample_id for s in offline.samples)


async def test_weight_sync_follows_announcements_under_its_own_identity(
    nats_roles: dict[str, NatsOptions], run_id: str
) -> None:
    """As `weight-sync` (announcements published as `learner`): the latest version is read on start
    and a new one arrives through the subscription."""
    async with RoleClient(nats_roles["learner"]) as learner:
        async with Publisher(learner.js) as pub:
            await pub.publish(weights_subject(run_id), _weights(run_id, "v000001"))
        sync = WeightSync(WeightSyncConfig(servers=["http://127.0.0.1:9"]), run_id=run_id)
        stop = asyncio.Event()
        task = asyncio.create_task(sync.run(nats_roles["weight-sync"], stop))
        await _until(lambda: sync.desired is not None, "the latest announcement read on start")
        assert sync.desired is not None and sync.desired.version == "v000001"
        async with Publisher(learner.js) as pub:
            await pub.publish(weights_subject(run_id), _weights(run_id, "v000002"))
        await _until(
            lambda: sync.desired is not None and sync.desired.version == "v000002", "v000002"
        )
        stop.set()
        await asyncio.wait_for(task, 30)
        assert learner.violations == []


async def test_the_learner_trains_and_pushes_under_its_own_identity(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    dist_env: Any,
    tiny_dir: Path,
    tmp_path: Path,
    one_thread: None,
) -> None:
    """As `learner` (samples published as `replayer`): its durable on LEAFE_SAMPLES, one step, the
    push on stop announced on the weights subject, every sample acked."""
    await publish_samples(nats_roles["replayer"], [make_sample(i, run_id=run_id) for i in range(8)])
    trainer_cfg = TrainerConfig(
        optim=OptimConfig(lr=1e-3), batch=BatchConfig(global_batch=8), retain_versions=1
    )
    cfg = LearnerConfig(
        trainer=trainer_cfg, ack_wait_s=6.0, max_batch_wait_s=0.5, stop_after_steps=1
    )
    await ensure_durables(admin_client.js, durables_for_run(run_id, learner=cfg))
    learner = OnlineLearner(
        cfg,
        Executor(Trainer(cfg.trainer, tiny_dir, dist_env), tmp_path / "ckpt", keep_checkpoints=1),
        Progress(),
        run_id=run_id,
        nats=nats_roles["learner"],
        store=tmp_path / "store",
        base_model="tiny",
    )
    progress = await asyncio.wait_for(learner.run(asyncio.Event()), 240)
    assert progress.step == 1
    raw = await admin_client.js.get_last_msg(WEIGHTS.name, weights_subject(run_id))
    assert decode_weights(raw.data).learner_step == 1
    assert await settled_counts(admin_client.js, SAMPLES.name, f"learner-{run_id}") == (0, 0)


async def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60.0
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _until_async(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 60.0
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_offline_replay_reads_a_run_under_the_replayer_role(
    nats_roles: dict[str, NatsOptions], run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """`leafe replay` from the stream (the replay Job, as `replayer`): the run's events are read by
    sequence, in order, with their stream sequence, though the role may not create the ephemeral
    consumer the admin's export uses."""
    spec = ExploreSpec(seed=1, max_depth=2, budget=8, horizon=3, p_success=0.5, reflect_every=2)
    events = build_explore_episode(
        spec, run_id=run_id, episode_id=f"{run_id}-ep0", tokenizer=tokenizer
    )
    async with (
        RoleClient(nats_roles["actor"]) as actor,
        RoleClient(nats_roles["replayer"]) as client,
    ):
        await publish_events(actor, events)
        assert [e async for e in stream_events(client.js, run_id)] == events
        seqs = [
            m.metadata.sequence.stream
            async for m in read_stream(
                client.js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.events.>"
            )
        ]
        assert len(seqs) == len(events) and seqs == sorted(seqs)
        assert client.violations == []
