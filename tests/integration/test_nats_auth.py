"""NATS least privilege on a real nats-server running deploy/base/nats/permissions.json (the session server of
tests/conftest.py: every role an nkey user of its own).

Each role is refused every subject it must not touch (the server reports a permissions violation naming the
subject, and nothing happens: no message stored, no stream or consumer created, changed or deleted), the
admin may do all of it (so the probes would notice a permitted action), and each service's real code does
its whole job under its own identity: the actor (tasks, events, dead letters, weights), the replayer
(events, recovery readers, samples), the learner (samples, weights) and weight sync (announcements).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError

from actors.config import ActorServiceConfig
from actors.fake_episodes import ExploreSpec, build_explore_episode, interleave
from actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from learner.checkpoint import Progress
from learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from learner.executor import Executor
from learner.materializers import fold_events, make_materializer
from learner.model_io import HFChatTokenizer
from learner.trainer import Trainer
from protocol import WeightsPublished, decode_weights, weights_subject
from protocol.codec import decode_sample
from protocol.subjects import EVENTS, SAMPLES, TASKS, WEIGHTS, dead_letter_subject, task_subject
from protocol.subjects import replayer_durable as replayer_durable_name
from protocol.tasks import TaskAssignment
from services import actor_service, learner_service, replayer_service, weight_sync_service
from services.actor_service import ActorService
from services.bus import NatsOptions, Publisher, connect, read_stream, wait_for_streams
from services.learner_service import OnlineLearner
from services.replay import stream_events
from services.replayer_service import Replayer, ReplayerConfig
from services.weight_sync_service import WeightSync, WeightSyncConfig
from tests.support.learner import make_sample, publish_samples

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

SERVICES = ("actor", "replayer", "learner", "weight-sync")


class RoleClient:
    """A connection as one role that records every permissions violation the server reports."""

    def __init__(self, opts: NatsOptions) -> None:
        self.opts = opts
        self.violations: list[str] = []

    async def __aenter__(self) -> RoleClient:
        async def on_error(e: Exception) -> None:
            if "permissions violation" in str(e).lower():
                self.violations.append(str(e).lower())

        self.nc = await connect(self.opts, name="test-role", error_cb=on_error)
        self.js = self.nc.jetstream()
        self.probe = self.nc.jetstream(timeout=1.0)
        """For calls that are expected to go unanswered (a denied request gets no reply)."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def violated(self, subject: str) -> bool:
        """Whether the server reported a violation naming ``subject`` (waits up to 10 s for the report)."""
        needle = f'"{subject.lower()}"'
        deadline = time.monotonic() + 10.0
        while not any(needle in v for v in self.violations):
            if time.monotonic() > deadline:
                return False
            await self.nc.flush()
            await asyncio.sleep(0.02)
        return True


@pytest.fixture
async def admin(nats_admin: NatsOptions) -> AsyncIterator[RoleClient]:
    async with RoleClient(nats_admin) as client:
        yield client


@pytest.fixture
async def scratch(admin: RoleClient, run_id: str) -> AsyncIterator[str]:
    """A stream of this test's own (one message in it) to try administering: never a LEAFE stream."""
    name = f"T_{run_id.replace('-', '_')}"[:60]
    await admin.js.add_stream(StreamConfig(name=name, subjects=[f"leafe.{run_id}.scratch.>"]))
    await admin.js.publish(f"leafe.{run_id}.scratch.a", b"keep me")
    yield name
    await admin.js.delete_stream(name)


async def stored(js: Any, subject: str) -> int:
    """Messages on ``subject`` in whichever stream holds it."""
    stream = await js.find_stream_name_by_subject(subject)
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def consumer_exists(js: Any, stream: str, name: str) -> bool:
    try:
        await js.consumer_info(stream, name)
    except NotFoundError:
        return False
    return True


def _probe_consumer(stream: str, run_id: str) -> tuple[ConsumerConfig, str]:
    name = f"probe-{run_id}"[:60]
    config = ConsumerConfig(name=name, durable_name=name, ack_policy=AckPolicy.EXPLICIT)
    return config, name


async def attempt(c: RoleClient, kind: str, target: str, run_id: str) -> str:
    """Try ``kind`` on ``target`` as ``c``; returns the subject the server must refuse."""
    if kind == "publish":
        await c.nc.publish(target, b"x")
        return target
    if kind == "subscribe":
        await c.nc.subscribe(target)
        return target
    calls: dict[str, tuple[str, Callable[[], Awaitable[Any]]]] = {
        "create-stream": (
            f"$JS.API.STREAM.CREATE.{target}",
            lambda: c.probe.add_stream(StreamConfig(name=target, subjects=[f"leafe.{run_id}.u"])),
        ),
        "update-stream": (
            f"$JS.API.STREAM.UPDATE.{target}",
            lambda: c.probe.update_stream(
                StreamConfig(name=target, subjects=[f"leafe.{run_id}.scratch.>", "more"])
            ),
        ),
        "delete-stream": (f"$JS.API.STREAM.DELETE.{target}", lambda: c.probe.delete_stream(target)),
        "purge-stream": (f"$JS.API.STREAM.PURGE.{target}", lambda: c.probe.purge_stream(target)),
        "create-consumer": (
            f"$JS.API.CONSUMER.CREATE.{target}.{_probe_consumer(target, run_id)[1]}",
            lambda: c.probe.add_consumer(target, _probe_consumer(target, run_id)[0]),
        ),
        "get-msg": (f"$JS.API.STREAM.MSG.GET.{target}", lambda: c.probe.get_msg(target, seq=1)),
    }
    subject, call = calls[kind]
    with pytest.raises(NatsTimeoutError):  # a refused request is never answered
        await call()
    return subject


async def no_effect(admin: RoleClient, kind: str, target: str, run_id: str) -> None:
    """What the refused attempt would have done, checked as the admin: it did not happen."""
    if kind == "publish":
        assert await stored(admin.js, target) == 0, target
    elif kind == "create-stream":
        with pytest.raises(NotFoundError):
            await admin.js.stream_info(target)
    elif kind in ("update-stream", "delete-stream", "purge-stream"):
        info = await admin.js.stream_info(target)
        assert (info.config.subjects, info.state.messages) == ([f"leafe.{run_id}.scratch.>"], 1), info
    elif kind == "create-consumer":
        assert not await consumer_exists(admin.js, target, _probe_consumer(target, run_id)[1])


ADMINISTRATION = [
    (role, kind, "U_{run}" if kind == "create-stream" else "scratch")
    for role in SERVICES
    for kind in ("create-stream", "update-stream", "delete-stream", "purge-stream")
]
DENIED = [
    ("actor", "publish", "leafe.{run}.weights"),
    ("actor", "publish", "leafe.{run}.samples.cf"),
    ("actor", "publish", "leafe.{run}.tasks"),
    ("actor", "publish", "leafe.{run}.dead.leafe_events"),
    ("actor", "subscribe", "leafe.{run}.events.>"),
    ("actor", "subscribe", "leafe.{run}.samples.>"),
    ("actor", "create-consumer", EVENTS.name),
    ("actor", "create-consumer", SAMPLES.name),
    ("replayer", "publish", "leafe.{run}.weights"),
    ("replayer", "publish", "leafe.{run}.events.step"),
    ("replayer", "publish", "leafe.{run}.tasks"),
    ("replayer", "subscribe", "leafe.{run}.weights"),
    ("replayer", "create-consumer", TASKS.name),
    ("replayer", "create-consumer", SAMPLES.name),
    ("learner", "publish", "leafe.{run}.events.step"),
    ("learner", "publish", "leafe.{run}.samples.cf"),
    ("learner", "publish", "leafe.{run}.tasks"),
    ("learner", "create-consumer", EVENTS.name),
    ("weight-sync", "publish", "leafe.{run}.weights"),
    ("weight-sync", "publish", "leafe.{run}.events.step"),
    ("weight-sync", "publish", "leafe.{run}.samples.cf"),
    ("weight-sync", "publish", "leafe.{run}.tasks"),
    ("weight-sync", "publish", "leafe.{run}.dead.leafe_tasks"),
    ("weight-sync", "create-consumer", WEIGHTS.name),
    ("weight-sync", "get-msg", EVENTS.name),
    *ADMINISTRATION,
]


def _target(template: str, run_id: str, scratch: str) -> str:
    return scratch if template == "scratch" else template.format(run=run_id)


@pytest.mark.parametrize(("role", "kind", "template"), DENIED)
async def test_each_role_is_refused_what_it_must_not_touch(
    nats_roles: dict[str, NatsOptions],
    admin: RoleClient,
    scratch: str,
    run_id: str,
    role: str,
    kind: str,
    template: str,
) -> None:
    """Only the learner publishes weights, only the actor events, only the replayer samples, only the admin
    tasks; no service creates, updates, deletes or purges a stream or reads another role's stream: the
    server reports the violation naming the subject, and the attempt leaves no trace."""
    target = _target(template, run_id, scratch)
    async with RoleClient(nats_roles[role]) as client:
        subject = await attempt(client, kind, target, run_id)
        assert await client.violated(subject), (role, kind, subject, client.violations)
    await no_effect(admin, kind, target, run_id)


@pytest.mark.parametrize(
    ("kind", "template"),
    [
        ("publish", "leafe.{run}.tasks"),
        ("create-consumer", EVENTS.name),
        ("create-stream", "U_{run}"),
        ("purge-stream", "scratch"),
    ],
)
async def test_the_admin_may_do_what_the_services_may_not(
    admin: RoleClient, scratch: str, run_id: str, kind: str, template: str
) -> None:
    """The same probes as the admin take effect without a violation (so a refusal above is the server's
    permissions at work, not a probe that could never succeed)."""
    target = _target(template, run_id, scratch)
    if kind == "publish":
        await admin.js.publish(target, b"x")
        assert await stored(admin.js, target) == 1
    elif kind == "create-consumer":
        config, name = _probe_consumer(target, run_id)
        await admin.js.add_consumer(target, config)
        assert await consumer_exists(admin.js, target, name)
        await admin.js.delete_consumer(target, name)
    elif kind == "create-stream":
        await admin.js.add_stream(StreamConfig(name=target, subjects=[f"leafe.{run_id}.u"]))
        assert (await admin.js.stream_info(target)).config.name == target
        await admin.js.delete_stream(target)
    else:
        await admin.js.purge_stream(target)
        assert (await admin.js.stream_info(target)).state.messages == 0
    assert admin.violations == []


@pytest.mark.parametrize(
    ("role", "module"),
    [
        ("actor", actor_service),
        ("replayer", replayer_service),
        ("learner", learner_service),
        ("weight-sync", weight_sync_service),
    ],
)
async def test_each_service_may_read_the_streams_it_waits_for(
    nats_roles: dict[str, NatsOptions], role: str, module: Any
) -> None:
    """A service's start-up check of its streams (``STREAMS_USED``) is within its role's rights."""
    async with RoleClient(nats_roles[role]) as client:
        await wait_for_streams(client.js, module.STREAMS_USED, timeout_s=5.0)
        assert client.violations == []


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
    nats_roles: dict[str, NatsOptions], admin: RoleClient, run_id: str
) -> None:
    """As `actor`: the durable on LEAFE_TASKS, events published, an undecodable task dead-lettered, the
    latest weights read and followed, every task acked; not one operation refused."""
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
    await admin.js.publish(task_subject(run_id), b"not a task")  # first: the actor stops after 2 tasks
    async with Publisher(admin.js) as pub:
        for task in tasks:
            await pub.publish(task_subject(run_id), task)
    async with RoleClient(nats_roles["learner"]) as learner, Publisher(learner.js) as pub:
        await pub.publish(weights_subject(run_id), _weights(run_id, "v000001"))
    async with RoleClient(nats_roles["actor"]) as client:
        service = ActorService(
            nc=client.nc,
            run_id=run_id,
            engine=ScriptedEngine(),
            tokenizer=ByteChatTokenizer(),
            config=ActorServiceConfig(concurrency=2),
            actor_id="least-privilege",
            env_factory=lambda name, **kw: CorridorEnv(),
            max_tasks=len(tasks),
            streams_timeout_s=5.0,
        )
        stats = await asyncio.wait_for(service.run(), timeout=60)
        assert client.violations == []
    assert (stats.done, stats.failed) == (2, 0)
    assert service.latest_weights == "v000001"
    events = [m async for m in read_stream(admin.js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.>")]
    assert {m.headers["Nats-Msg-Id"].split(".")[0] for m in events} >= {t.task_key for t in tasks}
    assert await stored(admin.js, dead_letter_subject(run_id, TASKS.name)) == 1
    info = await admin.js.consumer_info(TASKS.name, service.durable)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_dir(tiny_dir)


async def test_the_replayer_folds_and_recovers_under_its_own_identity(
    nats_roles: dict[str, NatsOptions], admin: RoleClient, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """As `replayer` (events published as `actor`): cancelled mid-stream and restarted (recovery reads the
    unreleased episodes with ephemeral consumers), it publishes exactly the offline rebuild's samples;
    not one operation refused."""
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
        materializer="leafe", model="tiny", batch=8, ack_wait_s=2.0, fetch_timeout_s=0.2, stale_check_s=0.5
    )
    async with RoleClient(nats_roles["actor"]) as actor, RoleClient(nats_roles["replayer"]) as client:
        await publish_events(actor, events[:half])
        await wait_for_streams(client.js, replayer_service.STREAMS_USED, timeout_s=5.0)
        first = Replayer(client.js, run_id=run_id, fold=make_materializer("leafe", tokenizer), config=config)
        task = asyncio.create_task(first.run(asyncio.Event()))
        await _until(lambda: first.fold.stats.events >= half, "the first half folded")
        task.cancel()  # episodes still open: their events stay unacked, for the restart to recover
        await asyncio.gather(task, return_exceptions=True)
        await publish_events(actor, events[half:])
        second = Replayer(client.js, run_id=run_id, fold=make_materializer("leafe", tokenizer), config=config)
        stop = asyncio.Event()
        task = asyncio.create_task(second.run(stop))
        durable = replayer_durable_name(run_id, "leafe")

        async def settled() -> bool:
            info = await admin.js.consumer_info(EVENTS.name, durable)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await _until_async(settled, "every event folded and acked")
        stop.set()
        await task
        assert (actor.violations, client.violations) == ([], [])
    assert second.stats.recovered_events > 0
    online = [
        decode_sample(m.data).sample_id
        async for m in read_stream(admin.js, stream=SAMPLES.name, filter_subject=f"leafe.{run_id}.samples.>")
    ]
    offline = fold_events(
        [e async for e in stream_events(admin.js, run_id)], make_materializer("leafe", tokenizer)
    )
    assert online and sorted(online) == sorted(s.sample_id for s in offline.samples)


async def test_weight_sync_follows_announcements_under_its_own_identity(
    nats_roles: dict[str, NatsOptions], run_id: str
) -> None:
    """As `weight-sync` (announcements published as `learner`): the latest version is read on start and a
    new one arrives through the subscription."""
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
        await _until(lambda: sync.desired is not None and sync.desired.version == "v000002", "v000002")
        stop.set()
        await asyncio.wait_for(task, 30)
        assert learner.violations == []


async def test_the_learner_trains_and_pushes_under_its_own_identity(
    nats_roles: dict[str, NatsOptions],
    admin: RoleClient,
    run_id: str,
    dist_env: Any,
    tiny_dir: Path,
    tmp_path: Path,
    one_thread: None,
) -> None:
    """As `learner` (samples published as `replayer`): its durable on LEAFE_SAMPLES, one step, the push on
    stop announced on the weights subject, every sample acked."""
    await publish_samples(nats_roles["replayer"], [make_sample(i, run_id=run_id) for i in range(8)])
    trainer_cfg = TrainerConfig(
        optim=OptimConfig(lr=1e-3), batch=BatchConfig(global_batch=8), retain_versions=1
    )
    cfg = LearnerConfig(trainer=trainer_cfg, ack_wait_s=6.0, max_batch_wait_s=0.5, stop_after_steps=1)
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
    raw = await admin.js.get_last_msg(WEIGHTS.name, weights_subject(run_id))
    assert decode_weights(raw.data).learner_step == 1
    info = await admin.js.consumer_info(SAMPLES.name, f"learner-{run_id}")
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


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
