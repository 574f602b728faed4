"""The actor service on the real stack: CPU inference server with the tiny model, SmolLM2's
tokenizer, Sokoban; events rebuild exactly, and a SIGKILLed actor process's task is finished by
another."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import DEVNULL

import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.protocol.events import Branch, EpisodeFinished, Step
from leafe.protocol.prompt import ChatTokenizer, prompt_sha256
from leafe.protocol.tasks import TaskAssignment
from leafe.services.actor.service import ActorService
from leafe.services.bus import connect, ensure_streams
from leafe.services.config import load_config
from tests.support.actor_service import (
    attempt_of,
    episode_stem,
    read_events,
    submit,
    tasks_left,
)
from tests.support.event_checks import check_episode, rebuild_step_prompts

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


SMALL_SOKOBAN = {
    "horizon": 6,
    "k": 3,
    "max_actions": 14,
    "max_branches": 3,
    "max_new_tokens": 8,
    "reflect_max_new_tokens": 16,
}


@pytest.fixture(scope="module")
def inference_url() -> Iterator[str]:
    """A CPU inference server with the tiny random model, in a thread of this process."""
    from leafe.services.inference.local import start_in_thread
    from leafe.services.inference.server import InferenceConfig

    server = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def hf_tokenizer() -> ChatTokenizer:
    from leafe.learner.model_io import HFChatTokenizer, resolve_model

    return HFChatTokenizer.from_dir(resolve_model("tiny"))


def sokoban_tasks(run_id: str, n: int, mode: str = "explore") -> list[TaskAssignment]:
    return [
        TaskAssignment(
            task_key=f"{run_id}-sokoban-{mode}-{i}",
            run_id=run_id,
            env="sokoban",
            task_id=f"sokoban/train/{i:05d}",
            mode=mode,
            seed=i,
        )
        for i in range(n)
    ]


async def test_real_engine_and_sokoban_episodes_rebuild_exactly(
    nats_url: str, run_id: str, inference_url: str, hf_tokenizer: ChatTokenizer
) -> None:
    """With the real client, server, tokenizer and env, tasks become complete episodes whose every
    Step prompt is rebuilt from the log to the recorded sha256 (the replayer's contract)."""
    from leafe.actors.client import SGLangClient

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    tasks = sokoban_tasks(run_id, 3) + sokoban_tasks(run_id, 1, "rollout")
    await submit(js, run_id, tasks)
    config = ActorServiceConfig(
        concurrency=2, explorer={"sokoban": SMALL_SOKOBAN}, rollout={"*": {"horizon": 4}}
    )
    async with SGLangClient([inference_url]) as engine:
        service = ActorService(
            nc=nc,
            run_id=run_id,
            engine=engine,
            tokenizer=hf_tokenizer,
            config=config,
            actor_id="real",
            max_tasks=len(tasks),
        )
        stats = await asyncio.wait_for(service.run(), timeout=300)
    assert stats.done == 4 and stats.failed == 0
    episodes = await read_events(js, run_id)
    assert len(episodes) == 4
    for events in episodes.values():
        check_episode(events)
        for step, messages in rebuild_step_prompts(events):
            ids = hf_tokenizer.encode_chat(messages, events[0].response_prefix)
            assert prompt_sha256(ids) == step.prompt_sha256 and len(ids) == step.prompt_tokens
            assert step.token_ids and step.policy_version == "default"
    assert any(isinstance(e, Branch) for events in episodes.values() for e in events)
    assert await tasks_left(js, run_id) == 0
    await nc.close()


@pytest.mark.slow
async def test_sigkilled_actor_process_task_is_finished_by_another(
    nats_url: str, run_id: str, inference_url: str, hf_tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """``leafe actor`` SIGKILLed mid-episode: the task comes back after ack_wait, another actor
    completes it as attempt 2; the killed attempt's episode has Steps but no EpisodeFinished."""
    from leafe.actors.client import SGLangClient

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    [task] = sokoban_tasks(run_id, 1)
    await submit(js, run_id, [task])
    toml = tmp_path / "actor.toml"
    toml.write_text(
        "ack_wait_s = 3.0\nin_progress_interval_s = 1.0\n[explorer.sokoban]\n"
        "horizon = 10\nk = 3\nmax_actions = 40\nmax_new_tokens = 8\nreflect_max_new_tokens = 16\n"
    )
    args = [
        "actor",
        "--nats",
        nats_url,
        "--run",
        run_id,
        "--engine",
        inference_url,
        "--model",
        "tiny",
        "--config",
        str(toml),
        "--actor-id",
        "victim",
    ]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "leafe.services.cli", *args, cwd=REPO, stdout=DEVNULL, stderr=DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            events = [
                e
                for events in (await read_events(js, run_id)).values()
                if episode_stem(events[0].episode_id) == f"{task.task_key}.a1"
                for e in events
            ]
            if sum(isinstance(e, Step) for e in events) >= 3:
                break
            assert proc.returncode is None and time.monotonic() < deadline, (
                "the actor process never got going"
            )
            await asyncio.sleep(0.2)
    finally:
        proc.kill()
        await proc.wait()
    config = load_config(ActorServiceConfig, files=[toml])
    async with SGLangClient([inference_url]) as engine:
        survivor = ActorService(
            nc=nc,
            run_id=run_id,
            engine=engine,
            tokenizer=hf_tokenizer,
            config=config,
            actor_id="survivor",
            max_tasks=1,
        )
        stats = await asyncio.wait_for(survivor.run(), timeout=300)
    assert stats.done == 1
    episodes = await read_events(js, run_id)
    partial = attempt_of(episodes, task.task_key, 1)
    assert {e.actor_id for e in partial} == {"victim"}
    assert not any(isinstance(e, EpisodeFinished) for e in partial)
    check_episode(attempt_of(episodes, task.task_key, 2))
    assert {e.actor_id for e in attempt_of(episodes, task.task_key, 2)} == {"survivor"}
    assert await tasks_left(js, run_id) == 0
    await nc.close()
