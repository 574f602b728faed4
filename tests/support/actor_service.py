"""Helpers of the actor-service integration tests: submit tasks, read a run's events, poll."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from leafe.protocol.codec import CODEC_HEADER, decode_event
from leafe.protocol.events import EpisodeEvent, EpisodeStarted
from leafe.protocol.subjects import EVENTS, TASKS, task_subject
from leafe.protocol.tasks import TaskAssignment
from leafe.services.bus import Publisher, read_stream

__all__ = ["attempt_of", "episode_stem", "read_events", "submit", "tasks_left", "until"]


async def submit(js: Any, run_id: str, tasks: list[TaskAssignment]) -> None:
    async with Publisher(js) as pub:
        for task in tasks:
            await pub.publish(task_subject(run_id), task)


async def read_events(js: Any, run_id: str) -> dict[str, list[EpisodeEvent]]:
    by_episode: dict[str, list[EpisodeEvent]] = defaultdict(list)
    async for msg in read_stream(js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.events.>"):
        event = decode_event(msg.data, (msg.headers or {}).get(CODEC_HEADER))
        by_episode[event.episode_id].append(event)
    return {k: sorted(v, key=lambda e: e.seq) for k, v in by_episode.items()}


def episode_stem(episode_id: str) -> str:
    """``<task_key>.a<attempt>`` of an episode id ``<task_key>.a<attempt>@<actor>``."""
    return episode_id.rpartition("@")[0]


def attempt_of(
    episodes: dict[str, list[EpisodeEvent]], task_key: str, attempt: int
) -> list[EpisodeEvent]:
    """The events of the one episode that served delivery ``attempt`` of ``task_key`` (its id also
    names its actor, so it is found by its EpisodeStarted)."""
    found = [
        events
        for events in episodes.values()
        if events
        and isinstance(events[0], EpisodeStarted)
        and (events[0].task_key, events[0].attempt) == (task_key, attempt)
    ]
    assert len(found) == 1, f"{len(found)} episodes served attempt {attempt} of {task_key!r}"
    return found[0]


async def tasks_left(js: Any, run_id: str) -> int:
    info = await js.consumer_info(TASKS.name, f"actors-{run_id}")
    return int(info.num_pending) + int(info.num_ack_pending)


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after 30 s."""
    deadline = time.monotonic() + 30.0
    while True:
        if predicate():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
