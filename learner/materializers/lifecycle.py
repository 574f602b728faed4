"""Which episodes a fold holds, and what became of those it no longer holds.

An episode is *held* from its ``EpisodeStarted`` until the fold releases it (finished or abandoned, and
for GRPO its group emitted): the replayer keeps the episode's anchor unacked that long, so the number of
held episodes is what ``max_ack_pending`` must cover. :class:`OpenLimits` caps it per run and per actor;
an ``EpisodeStarted`` past a cap is refused with the reason (the replayer dead-letters it and the rest of
its episode), so a flood of episodes that never finish cannot hold the consumer. Episodes that can give
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

from protocol.events import EpisodeStarted

__all__ = ["Closed", "Ledger", "OpenLimits"]

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
    """Held episodes per ``actor_id``."""


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
        return None

    def hold(self, started: EpisodeStarted) -> None:
        """Hold ``started``'s episode until :meth:`release`."""
        self.held[started.episode_id] = started.actor_id
        self.per_actor[started.actor_id] += 1

    def release(self, episode_id: str) -> None:
        """The episode's events are no longer needed: listed for :meth:`drain`, its slot freed."""
        actor = self.held.pop(episode_id, None)
        if actor is None:
            return
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
