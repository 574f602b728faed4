"""Which episodes a fold holds, and what became of those it no longer holds.

An episode is *held* from its ``EpisodeStarted`` until the fold releases it (finished or abandoned, and
for GRPO its group emitted): the replayer keeps the episode's anchor unacked that long, so the number of
held episodes is what ``max_ack_pending`` must cover. :class:`OpenLimits` caps it per run and per actor,
and caps the bytes the held episodes' events take (:func:`event_bytes`, their text and token ids: what
the fold keeps in memory); an ``EpisodeStarted`` past a cap is refused with the reason (the replayer
dead-letters it and the rest of its episode), and an event that would take the held bytes past
``max_open_bytes`` is rejected, so a flood of episodes that never finish can neither hold the consumer
nor exhaust memory, online or offline (``leafe replay`` applies the same caps). Episodes that can give
no samples are never held.

Every episode the fold stopped holding is remembered (bounded, oldest forgotten first) with how it ended,
so later events of it are ignored or rejected consistently:

| ended      | a later event                                                                       |
|------------|-------------------------------------------------------------------------------------|
| `finished` | ignored when its seq is at or below the EpisodeFinished's (a redelivery), else rejected |
| `abandoned`| ignored (a straggler of a crashed actor)                                            |
| `ignored`  | ignored (the materializer has no use for the episode)                               |
| `refused`  | rejected, with the reason it was refused                                            |
| `failed`   | rejected, with the exception that failed it                                         |
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal, NamedTuple

from protocol.events import Branch, EpisodeEvent, EpisodeStarted, Reflection, Step

__all__ = ["Closed", "Ledger", "OpenLimits", "event_bytes"]

_EVENT_OVERHEAD = 256
"""Bytes charged per event besides its text and ids (ids, counters, the tree's bookkeeping)."""


def event_bytes(event: EpisodeEvent) -> int:
    """What holding ``event`` costs, roughly: its text fields and its token ids and logprobs.

    An estimate, cheap enough for every event (no encoding); it grows with what an event can make large
    (observations, completions, token ids: 32 bytes each, about what a decoded Python int or float and
    its list slot take), so a cap on it bounds the fold's memory up to a small constant."""
    n = _EVENT_OVERHEAD + len(event.event_id) + len(event.episode_id) + len(event.actor_id)
    match event:
        case Step():
            n += (
                len(event.raw_text) + len(event.observation) + len(event.feedback) + 32 * len(event.token_ids)
            )
            n += len(event.action or "") + 32 * len(event.logprobs or ())
        case EpisodeStarted():
            n += (
                len(event.task)
                + len(event.observation)
                + len(event.instructions)
                + len(event.response_prefix)
            )
        case Reflection():
            n += (
                len(event.raw_text)
                + len(event.experience)
                + 32 * len(event.token_ids)
                + 16 * len(event.flags)
            )
        case Branch():
            n += len(event.experience) + len(event.reflection_event_id)
    return n


Ending = Literal["finished", "abandoned", "ignored", "refused", "failed"]


class Closed(NamedTuple):
    """How an episode the fold no longer holds ended."""

    ending: Ending
    """See the module docstring."""
    last_seq: int | None = None
    """``finished``: the seq of its EpisodeFinished."""
    reason: str = ""
    """``refused``/``failed``: why."""


@dataclass(frozen=True)
class OpenLimits:
    """Caps on held episodes (``None``: no cap; offline folds use none, the replayer sets both)."""

    max_open: int | None = None
    """Held episodes of the whole fold (one run)."""
    max_per_actor: int | None = None
    """Held episodes per ``actor_id`` (admitted events' ``actor_id`` is their publisher's NATS identity,
    ``protocol.codec.admit_event``)."""
    max_bytes: int | None = None
    """:func:`event_bytes` of every event of the held episodes, together."""


class Ledger:
    """Held episodes per actor, the release list, and the bounded memory of closed episodes."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.limits = OpenLimits()
        self.closed: OrderedDict[str, Closed] = OrderedDict()
        self.held: dict[str, str] = {}
        """Held episode id -> its actor id."""
        self.per_actor: Counter[str] = Counter()
        self.released: list[str] = []
        self.bytes: dict[str, int] = {}
        """Held episode id -> :func:`event_bytes` of its events so far."""
        self.held_bytes = 0

    def refusal(self, started: EpisodeStarted) -> str | None:
        """Why ``started`` may not be held now (a cap is reached), or ``None``."""
        limits, actor = self.limits, started.actor_id
        if limits.max_per_actor is not None and self.per_actor[actor] >= limits.max_per_actor:
            shown = actor if len(actor) <= 80 else actor[:77] + "..."
            return (
                f"actor {shown!r} already holds {self.per_actor[actor]} open episodes "
                f"(max_open_per_actor = {limits.max_per_actor})"
            )
        if limits.max_open is not None and len(self.held) >= limits.max_open:
            return f"{len(self.held)} episodes are open (max_open_episodes = {limits.max_open})"
        return self.over_bytes(event_bytes(started))

    def over_bytes(self, size: int) -> str | None:
        """Why ``size`` more bytes may not be held now (``max_bytes`` would be passed), or ``None``."""
        cap = self.limits.max_bytes
        if cap is None or self.held_bytes + size <= cap:
            return None
        return (
            f"{self.held_bytes:,} bytes are held by {len(self.held)} open episodes and this event adds "
            f"{size:,} (max_open_bytes = {cap:,})"
        )

    def hold(self, started: EpisodeStarted) -> None:
        """Hold ``started``'s episode until :meth:`release`."""
        self.held[started.episode_id] = started.actor_id
        self.per_actor[started.actor_id] += 1
        self.bytes[started.episode_id] = 0
        self.charge(started.episode_id, event_bytes(started))

    def charge(self, episode_id: str, size: int) -> None:
        """Count ``size`` more bytes held by ``episode_id`` (a held episode; others cost nothing here)."""
        if episode_id in self.bytes:
            self.bytes[episode_id] += size
            self.held_bytes += size

    def release(self, episode_id: str) -> None:
        """The episode's events are no longer needed: listed for :meth:`drain`, its slot freed."""
        actor = self.held.pop(episode_id, None)
        if actor is None:
            return
        self.held_bytes -= self.bytes.pop(episode_id, 0)
        self.per_actor[actor] -= 1
        if self.per_actor[actor] <= 0:
            del self.per_actor[actor]
        self.released.append(episode_id)

    def drain(self) -> list[str]:
        """Episodes released since the last call."""
        out, self.released = self.released, []
        return out

    def remember(self, episode_id: str, closed: Closed) -> None:
        """Record how ``episode_id`` ended (forgetting the oldest beyond ``memory``)."""
        self.closed[episode_id] = closed
        self.closed.move_to_end(episode_id)
        while len(self.closed) > self.memory:
            self.closed.popitem(last=False)
