"""The actor service against a real nats-server: tasks in, complete episodes out, crashes recovered.

These use the scripted engine and the corridor env (real JetStream, real Publisher/Consumer); the
real stack (CPU inference server, Sokoban) is in ``test_actor_service_sokoban.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.actors.engine import EngineError
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.protocol.events import Branch, EpisodeFinished, EpisodeStarted, Step, WeightsPublished
from leafe.protocol.subjects import weights_subject
from leafe.protocol.tasks import TaskAssignment, episode_owner
from leafe.services.actor.main import run_actor
from leafe.services.actor.service import ActorService
from leafe.services.bus import Publisher, connect, ensure_streams
from tests.support.actor_service import (
    attempt_of,
    episode_stem,
    read_events,
    submit,
    tasks_left,
    until,
)
from tests.support.event_checks import check_episode

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def corridor_factory(name: str, **options: Any) -> CorridorEnv:
    assert name == "corridor"
    return CorridorEnv(supports_snapshot=bool(options.get("snapshots", True)))


async def wait_for_calls(engine: ScriptedEngine, n: int) -> None:
    """Until the engine has answered ``n`` requests (the actor is mid-episode)."""
    await until(lambda: len(engine.calls) >= n, f"{n} engine requests")


def left_first_then_learn(kind: str, prompt: str) -> str:
    """Step 0 without a lesson walks into the pit; the reflection says go right; otherwise go
    right."""
    if kind == "reflection":
        return "<step>0</step><experience>go right</experience>"
    return "<action>left</action>" if "(step 0)" in prompt and "Lesson" not in prompt else "right"


def corridor_tasks(run_id: str, n: int, mode: str = "explore") -> list[TaskAssignment]:
    return [
        TaskAssignment(
            task_key=f"{run_id}-corridor-{i}",  # keys are msg ids on a stream all runs share
            run_id=run_id,
            env="corridor",
            task_id=f"corridor/train/{i:05d}",
            mode=mode,
            seed=i,
            env_options={"snapshots": i % 2 == 0},
        )
        for i in range(n)
    ]


async def test_actor_serves_tasks_end_to_end(nats_url: str, run_id: str) -> None:
    """Every task becomes one complete, well-formed episode in the log and leaves the work queue."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    tasks = corridor_tasks(run_id, 4) + corridor_tasks(run_id, 6, "rollout")[4:]
    await submit(js, run_id, tasks)
    engine = ScriptedEngine(script=left_first_then_learn)
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=engine,
        tokenizer=ByteChatTokenizer(),
        config=ActorServiceConfig(concurrency=3),
        actor_id="actor-a",
        env_factory=corridor_factory,
        max_tasks=len(tasks),
    )
    stats = await asyncio.wait_for(service.run(), timeout=60)
    assert (stats.done, stats.failed, stats.abandoned) == (6, 0, 0)
    episodes = await read_events(js, run_id)
    assert sorted(episode_stem(e) for e in episodes) == sorted(f"{t.task_key}.a1" for t in tasks)
    assert {episode_owner(e) for e in episodes} == {"actor-a"}
    for events in episodes.values():
        check_episode(events)
        start = events[0]
        assert isinstance(start, EpisodeStarted) and {e.actor_id for e in events} == {"actor-a"}
        # explore: the pit, a reflection, a branch that succeeds; rollout: just the pit
        assert events[-1].success == (start.mode == "explore")
    assert await tasks_left(js, run_id) == 0
    await nc.close()


async def test_demo_tasks_become_demonstration_episodes(nats_url: str, run_id: str) -> None:
    """``--mode demo`` assignments are served by the demonstration runner: one complete demo episode
    per task with the expert's steps, and the configured Early Experience alternatives off its
    path."""
    from leafe.services.admin.tasks import make_assignments
    from tests.support.demos import ProposalEngine, check_demo_episode

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    options = {"height": 5, "width": 5, "max_solution_len": 2, "max_steps": 6}
    ids = [f"sokoban/train/{i}" for i in range(3)]
    tasks = make_assignments(
        run_id=run_id, env="sokoban", task_ids=ids, mode="demo", split="train", env_options=options
    )
    with pytest.raises(ValueError, match="train split"):
        make_assignments(run_id=run_id, env="sokoban", task_ids=ids, mode="demo", split="test")
    await submit(js, run_id, tasks)
    tok = ByteChatTokenizer()
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ProposalEngine(tokenizer=tok),
        tokenizer=tok,
        config=ActorServiceConfig(demo={"sokoban": {"alternatives": 4}}),
        actor_id="actor-d",
        max_tasks=len(tasks),
    )
    stats = await asyncio.wait_for(service.run(), timeout=60)
    assert (stats.done, stats.failed, stats.succeeded) == (3, 0, 3)
    episodes = await read_events(js, run_id)
    assert len(episodes) == 3
    for events in episodes.values():
        check_demo_episode(events)
    assert sum(isinstance(e, Branch) for events in episodes.values() for e in events) >= 3
    assert await tasks_left(js, run_id) == 0
    await nc.close()


async def test_crashed_actor_task_is_redelivered_and_completed(nats_url: str, run_id: str) -> None:
    """An actor dying mid-episode (connection gone, no nak) leaves a partial episode; the task is
    redelivered after ack_wait and another actor completes it as attempt 2."""
    config = ActorServiceConfig(concurrency=1, ack_wait_s=2.0, in_progress_interval_s=0.5)
    js_nc = await connect(nats_url)
    js = js_nc.jetstream()
    await ensure_streams(js)
    task = corridor_tasks(run_id, 1)[0]
    await submit(js, run_id, [task])

    nc_a = await connect(nats_url)
    slow = ScriptedEngine(default_action="<action>wait</action>", latency_s=0.2)
    actor_a = ActorService(
        nc=nc_a,
        run_id=run_id,
        engine=slow,
        tokenizer=ByteChatTokenizer(),
        config=config,
        actor_id="actor-a",
        env_factory=corridor_factory,
    )
    running = asyncio.create_task(actor_a.run())
    await wait_for_calls(slow, 5)
    await nc_a.close()  # the crash: no more acks, naks or in-progress from A
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)

    nc_b = await connect(nats_url)
    actor_b = ActorService(
        nc=nc_b,
        run_id=run_id,
        engine=ScriptedEngine(),
        tokenizer=ByteChatTokenizer(),
        config=config,
        actor_id="actor-b",
        env_factory=corridor_factory,
        max_tasks=1,
    )
    stats = await asyncio.wait_for(actor_b.run(), timeout=60)
    assert stats.done == 1
    episodes = await read_events(js, run_id)
    partial = attempt_of(episodes, task.task_key, 1)
    complete = attempt_of(episodes, task.task_key, 2)
    assert not any(isinstance(e, EpisodeFinished) for e in partial)
    assert any(isinstance(e, Step) for e in partial)
    check_episode(complete)
    assert complete[0].attempt == 2 and {e.actor_id for e in complete} == {"actor-b"}
    assert await tasks_left(js, run_id) == 0
    await nc_b.close()
    await js_nc.close()


async def test_drain_abandons_long_episodes_for_immediate_redelivery(
    nats_url: str, run_id: str
) -> None:
    """Stopping with a drain timeout: running episodes are cancelled and nak'ed, so a new actor gets
    the task at once (well before ack_wait) and the abandoned episode lacks EpisodeFinished."""
    config = ActorServiceConfig(
        concurrency=2, ack_wait_s=60.0, in_progress_interval_s=5, drain_timeout_s=0.2
    )
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    task = corridor_tasks(run_id, 1)[0]
    await submit(js, run_id, [task])
    slow = ScriptedEngine(default_action="<action>wait</action>", latency_s=0.2)
    stop = asyncio.Event()
    actor = ActorService(
        nc=nc,
        run_id=run_id,
        engine=slow,
        tokenizer=ByteChatTokenizer(),
        config=config,
        actor_id="a",
        env_factory=corridor_factory,
    )
    running = asyncio.create_task(actor.run(stop))
    await wait_for_calls(slow, 1)
    stop.set()
    stats = await asyncio.wait_for(running, timeout=30)
    assert stats.abandoned == 1 and stats.done == 0
    actor2 = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ScriptedEngine(),
        tokenizer=ByteChatTokenizer(),
        config=config,
        actor_id="b",
        env_factory=corridor_factory,
        max_tasks=1,
    )
    assert (await asyncio.wait_for(actor2.run(), timeout=20)).done == 1
    episodes = await read_events(js, run_id)
    assert not any(isinstance(e, EpisodeFinished) for e in attempt_of(episodes, task.task_key, 1))
    check_episode(attempt_of(episodes, task.task_key, 2))
    await nc.close()


async def test_run_actor_connects_serves_and_disconnects(nats_url: str, run_id: str) -> None:
    """The in-process API (what ``leafe run`` starts): its own connection, max_tasks, clean exit."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    await submit(js, run_id, corridor_tasks(run_id, 2))
    stats = await asyncio.wait_for(
        run_actor(
            nats=nats_url,
            run_id=run_id,
            tokenizer=ByteChatTokenizer(),
            engine=ScriptedEngine(),
            actor_id="inproc",
            max_tasks=2,
            env_factory=corridor_factory,
        ),
        timeout=30,
    )
    assert stats.done == 2 and stats.succeeded == 2
    assert len(await read_events(js, run_id)) == 2
    await nc.close()


async def test_engine_failures_are_retried_then_terminated(nats_url: str, run_id: str) -> None:
    """An engine that keeps failing: the task is nak'ed for a retry, then terminated on its last
    allowed attempt; no attempt got a completion, so none left an event (EpisodeStarted waits for
    the first completion's weight version) and the queue is left empty."""

    def down(kind: str, prompt: str) -> str:
        raise EngineError("every server is down")

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    [task] = corridor_tasks(run_id, 1)
    await submit(js, run_id, [task])
    config = ActorServiceConfig(max_attempts=2, retry_delay_s=0.1)
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ScriptedEngine(script=down),
        tokenizer=ByteChatTokenizer(),
        config=config,
        actor_id="a",
        env_factory=corridor_factory,
        max_tasks=2,
    )
    stats = await asyncio.wait_for(service.run(), timeout=30)
    assert (stats.retried, stats.failed, stats.done) == (1, 1, 0)
    assert await read_events(js, run_id) == {}
    assert await tasks_left(js, run_id) == 0
    await nc.close()


async def test_a_sandbox_that_cannot_isolate_fails_the_task_at_once(
    nats_url: str, run_id: str
) -> None:
    """An env whose sandbox refuses (the isolation it requires is missing) is not a transient error:
    the task is terminated on its first attempt with the reason, never retried in a loop."""
    from leafe.envs.sandbox.launch import SandboxUnavailable

    def no_sandbox(name: str, **options: object) -> object:
        raise SandboxUnavailable("user namespaces are unavailable here (test)")

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    [task] = corridor_tasks(run_id, 1)
    await submit(js, run_id, [task])
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ScriptedEngine(),
        tokenizer=ByteChatTokenizer(),
        config=ActorServiceConfig(max_attempts=3, retry_delay_s=0.1),
        actor_id="a",
        env_factory=no_sandbox,  # type: ignore[arg-type]
        max_tasks=1,
    )
    stats = await asyncio.wait_for(service.run(), timeout=30)
    assert (stats.retried, stats.failed) == (0, 1)
    assert await tasks_left(js, run_id) == 0
    await nc.close()


async def test_a_prompt_over_the_context_length_fails_the_task_at_once(
    nats_url: str, run_id: str
) -> None:
    """A prompt the client refused as longer than the engines' context (``PromptTooLong``, never
    sent) is not an outage and would be as long again: the task is terminated on its first attempt,
    not redelivered to send the same prompt again."""
    from leafe.actors.engine import PromptTooLong

    def too_long(kind: str, prompt: str) -> str:
        raise PromptTooLong("the prompt has 9000 tokens, the engines' context length is 8192")

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    [task] = corridor_tasks(run_id, 1)
    await submit(js, run_id, [task])
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ScriptedEngine(script=too_long),
        tokenizer=ByteChatTokenizer(),
        config=ActorServiceConfig(max_attempts=3, retry_delay_s=0.1),
        actor_id="a",
        env_factory=corridor_factory,
        max_tasks=1,
    )
    stats = await asyncio.wait_for(service.run(), timeout=30)
    assert (stats.retried, stats.failed, stats.engine_outages) == (0, 1, 0)
    assert await tasks_left(js, run_id) == 0
    await nc.close()


async def test_actor_follows_weights_announcements(nats_url: str, run_id: str) -> None:
    """The latest WeightsPublished is read at start and new ones are followed while running."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)

    def weights(version: str) -> WeightsPublished:
        return WeightsPublished(
            event_id=f"weights.{run_id}.{version}",
            run_id=run_id,
            version=version,
            uri="/w",
            manifest_sha256="0" * 64,
            learner_step=1,
            base_model="tiny",
        )

    async with Publisher(js) as pub:
        await pub.publish(weights_subject(run_id), weights("v000001"))
    stop = asyncio.Event()
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ScriptedEngine(),
        tokenizer=ByteChatTokenizer(),
        config=ActorServiceConfig(),
        actor_id="a",
        env_factory=corridor_factory,
    )
    running = asyncio.create_task(service.run(stop))
    await until(lambda: service.latest_weights == "v000001", "the last announced version at start")
    async with Publisher(js) as pub:
        await pub.publish(weights_subject(run_id), weights("v000002"))
    await until(lambda: service.latest_weights == "v000002", "a version announced while running")
    stop.set()
    await asyncio.wait_for(running, timeout=10)
    await nc.close()


# -- the real stack: CPU inference server (tiny model), SmolLM2's chat template, Sokoban
# ---------------


async def test_the_staleness_gate_holds_new_episodes_until_the_learner_pushes(
    nats_url: str, run_id: str
) -> None:
    """Issue 62's backpressure: with 2 episodes a version and lag 0, the actor takes 2 rollouts
    while the learner is at v000001, then no more (the tasks wait in the queue, counted as gate
    wait) until v000002 is announced, then 2 more; a demonstration would not count."""
    from leafe.actors.staleness import StalenessConfig

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)

    def weights(version: str) -> WeightsPublished:
        return WeightsPublished(
            event_id=f"weights.{run_id}.{version}",
            run_id=run_id,
            version=version,
            uri="/w",
            manifest_sha256="0" * 64,
            learner_step=1,
            base_model="tiny",
        )

    async with Publisher(js) as pub:
        await pub.publish(weights_subject(run_id), weights("v000001"))
    await submit(js, run_id, corridor_tasks(run_id, 6, "rollout"))
    stop = asyncio.Event()
    gate = StalenessConfig(episodes_per_version=2.0, max_policy_lag=0, max_wait_s=600.0)
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=ScriptedEngine(script=left_first_then_learn),
        tokenizer=ByteChatTokenizer(),
        config=ActorServiceConfig(concurrency=3, staleness=gate),
        actor_id="actor-a",
        env_factory=corridor_factory,
    )
    task = asyncio.create_task(service.run(stop))
    await until(lambda: service.stats.done == 2, "the first two episodes")
    await asyncio.sleep(2.5)  # the gate re-reads the weights every second: still v000001
    assert (service.stats.taken, service.stats.done) == (2, 2)
    assert await tasks_left(js, run_id) == 4
    async with Publisher(js) as pub:
        await pub.publish(weights_subject(run_id), weights("v000002"))
    await until(lambda: service.stats.done == 4, "two more episodes after the push")
    await asyncio.sleep(2.5)
    assert service.stats.taken == 4 and service.gate.lent == 0
    assert service.metrics.gate_wait._value.get() >= 2.5  # the first wait, ended by the push
    stop.set()
    await asyncio.wait_for(task, 30)
    await nc.close()
