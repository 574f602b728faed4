"""Emitting an episode's events: where they go (:class:`EventSink`) and how they are stamped.

Every event of an episode gets ``seq`` (0, 1, 2... in emission order), ``event_id =
event_id_for(episode_id, seq)``, the run/episode/actor ids, the wall-clock ``ts``, the latest
``policy_version`` an engine reported and a fresh ``msg_nonce`` (its ``Nats-Msg-Id`` is then
``<event_id>:<msg_nonce>``, which no other actor can publish first). :class:`EpisodeRecorder` does
that stamping; the explorer and the rollouts only name the event type and its own fields. The actor
service's sink publishes through the bus ``Publisher``; tests use :class:`ListSink`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec

from leafe.protocol.events import EpisodeEvent, Mode, event_id_for, new_msg_nonce

__all__ = ["EpisodeRecorder", "EpisodeSpec", "EpisodeSummary", "EventSink", "ListSink"]

E = TypeVar("E", bound=msgspec.Struct)


class EventSink(Protocol):
    """Where an episode's events go, in order. ``emit`` returns once the event is accepted
    (queued)."""

    async def emit(self, event: EpisodeEvent) -> None:
        """Accept one event."""
        ...


class ListSink:
    """Keeps events in a list (tests, in-process evaluation)."""

    def __init__(self) -> None:
        self.events: list[EpisodeEvent] = []

    async def emit(self, event: EpisodeEvent) -> None:
        """Append ``event``."""
        self.events.append(event)


class EpisodeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Identity and provenance of one episode (what ``EpisodeStarted`` records besides env
    output)."""

    run_id: str
    """Run id."""
    episode_id: str
    """``episode_id_for(task_key, attempt, actor_id)``: ``<task_key>.a<attempt>@<actor_id>``, it
    names its actor (``leafe.protocol.tasks``)."""
    actor_id: str
    """Actor process id."""
    task_key: str
    """Task assignment id."""
    env: str
    """Environment registry name."""
    task_id: str
    """Environment task id."""
    split: str = "train"
    """Task split."""
    seed: int = 0
    """Sampling seed of the episode."""
    mode: Mode = "explore"
    """``explore``, ``rollout`` or ``eval``."""
    attempt: int = 1
    """Delivery attempt of the assignment."""
    group_id: str | None = None
    """GRPO group, if any."""
    group_size: int = 1
    """Episodes in the group."""
    config_digest: str = ""
    """sha256 of the resolved config."""

    def started_fields(self) -> dict[str, Any]:
        """The fields of this episode's ``EpisodeStarted`` that come from the spec (the recorder
        fills in the ids, the caller what the environment and the prompt settings say)."""
        return {
            "task_key": self.task_key,
            "env": self.env,
            "task_id": self.task_id,
            "split": self.split,
            "seed": self.seed,
            "mode": self.mode,
            "group_id": self.group_id,
            "group_size": self.group_size,
            "config_digest": self.config_digest,
            "attempt": self.attempt,
        }


class EpisodeSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What an episode did (the figures of its ``EpisodeFinished``)."""

    episode_id: str
    """Episode id."""
    success: bool
    """Any branch succeeded."""
    branches: int
    """Branches opened, root included."""
    actions: int
    """Policy actions taken."""
    reflections: int
    """Reflection calls."""
    replay_steps: int
    """Env steps spent replaying prefixes."""
    parse_failures: int
    """Completions with no valid action."""
    events: int
    """Events emitted."""
    error: str = ""
    """Env error text when a branch ended with ``reason == "error"``."""


class Stamp(Protocol):
    """Who an episode's events come from: what every event of it carries besides its own fields."""

    run_id: str
    episode_id: str
    actor_id: str
    policy_version: str


def stamp_event(
    cls: type[E], who: Stamp, seq: int, ts: float, *, msg_nonce: str = "", **fields: Any
) -> E:
    """``cls(**fields)`` with the common fields: event id, run, episode, actor, seq, policy version,
    ts and ``msg_nonce`` (empty: the event's ``Nats-Msg-Id`` is its id, as in fakes)."""
    return cls(
        event_id=event_id_for(who.episode_id, seq),
        run_id=who.run_id,
        episode_id=who.episode_id,
        actor_id=who.actor_id,
        seq=seq,
        policy_version=who.policy_version,
        ts=ts,
        msg_nonce=msg_nonce,
        **fields,
    )


class EpisodeRecorder:
    """Stamps and emits the events of one episode."""

    def __init__(
        self,
        sink: EventSink,
        *,
        run_id: str,
        episode_id: str,
        actor_id: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self.run_id = run_id
        self.episode_id = episode_id
        self.actor_id = actor_id
        self.clock = clock
        self.seq = 0
        self.policy_version = "default"

    async def emit(self, cls: type[E], **fields: Any) -> E:
        """Build ``cls(**fields)`` with the common fields filled in, emit it, and return it."""
        seq = self.seq
        self.seq += 1
        event = stamp_event(cls, self, seq, self.clock(), msg_nonce=new_msg_nonce(), **fields)
        await self.sink.emit(event)  # type: ignore[arg-type]
        return event
