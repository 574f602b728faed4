"""Which episodes a fold holds, and what became of those it no longer holds.

An episode is *held* from its ``EpisodeStarted`` until the fold releases it (finished or abandoned,
and for GRPO its group emitted): the replayer keeps the episode's anchor unacked that long, so the
number of held episodes is what ``max_ack_pending`` must cover. :class:`OpenLimits` caps it per run
and per actor, and caps the bytes the held episodes' events take (:func:`event_bytes`, their text
and token ids: what the fold keeps in memory), per run and per publishing actor; an
``EpisodeStarted`` past a cap is refused with the reason (the replayer dead-letters it and the rest
of its episode), and an event that would take the held bytes past ``max_bytes`` or its publisher's
past ``max_bytes_per_actor`` is rejected, so a flood of episodes that never finish can neither hold
the consumer nor exhaust memory, online or offline (``leafe replay`` applies the same caps), and one
actor's flood fills only its own share. Episodes that can give no samples are never held.

Every refusal has a code (:data:`CAP_CODES` for the caps): what ``leafe replayer redrive`` selects
dead letters by. The reason is text for people and may quote the input (an episode or branch id), so
nothing decides on it.

Every episode the fold stopped holding is remembered (bounded, oldest forgotten first) with how it
ended and who started it, so later events of it are ignored or rejected consistently. An event from
another actor than the one that started the episode is rejected (code ``foreign_episode``) whatever
the episode became; the starter's own:

| ended       | a later event of the actor that started it                                  |
|-------------|-----------------------------------------------------------------------------|
| `finished`  | ignored when its seq <= the EpisodeFinished's (a redelivery), else rejected |
| `abandoned` | ignored (a straggler of a crashed actor)                                    |
| `ignored`   | ignored (the materializer has no use for the episode)                       |
| `refused`   | rejected, with the reason it was refused                                    |
| `failed`    | rejected, with the exception that failed it                                 |
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal, NamedTuple

from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Reflection, Step

__all__ = ["CAP_CODES", "Closed", "Ledger", "OpenLimits", "Refusal", "event_bytes"]

CAP_CODES = frozenset(
    {"max_open_per_actor", "max_open_episodes", "max_open_bytes", "max_open_bytes_per_actor"}
)
"""Refusal codes of the caps: an episode refused for one of them can be folded once the cause is
gone."""

_EVENT_OVERHEAD = 256
"""Bytes charged per event besides its text and ids (ids, counters, the tree's bookkeeping)."""


def event_bytes(event: EpisodeEvent) -> int:
    """What holding ``event`` costs, roughly: its text fields and its token ids and logprobs.

    An estimate, cheap enough for every event (no encoding); it grows with what an event can make
    large (observations, completions, token ids: 32 bytes each, about what a decoded Python int or
    float and its list slot take), so a cap on it bounds the fold's memory up to a small
    constant."""
    n = _EVENT_OVERHEAD + len(event.event_id) + len(event.episode_id) + len(event.actor_id)
    match event:
        case Step():
            n += (
                len(event.raw_text)
                + len(event.observation)
                + len(event.feedback)
                + 32 * len(event.token_ids)
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
    code: str = ""
    """``refused``/``failed``: the refusal's code (one of :data:`CAP_CODES`, or
    ``episode_failed``)."""
    owner: str = ""
    """The ``actor_id`` of the episode's EpisodeStarted: only its events are the episode's."""


class Refusal(NamedTuple):
    """Why an episode or event may not be held now."""

    code: str
    """One of :data:`CAP_CODES`."""
    reason: str
    """The same for people, with the figures."""


@dataclass(frozen=True)
class OpenLimits:
    """Caps on held episodes (``None``: no cap; offline folds use none, the replayer sets both)."""

    max_open: int | None = None
    """Held episodes of the whole fold (one run)."""
    max_per_actor: int | None = None
    """Held episodes per ``actor_id`` (admitted events' ``actor_id`` is their publisher's NATS
    identity, ``leafe.protocol.codec.admit_event``)."""
    max_bytes: int | None = None
    """:func:`event_bytes` of every event of the held episodes, together."""
    max_bytes_per_actor: int | None = None
    """:func:`event_bytes` of the events one ``actor_id`` (the publisher's NATS identity) added to
    held episodes, its own or another's."""

    @property
    def bounds_bytes(self) -> bool:
        """Whether held bytes are counted at all."""
        return self.max_bytes is not None or self.max_bytes_per_actor is not None


def _shown(actor: str) -> str:
    return repr(actor if len(actor) <= 80 else actor[:77] + "...")


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
        self.bytes: dict[str, Counter[str]] = {}
        """Held episode id -> :func:`event_bytes` of its events so far, by the actor that published
        them."""
        self.actor_bytes: Counter[str] = Counter()
        """Actor id -> bytes its events take in held episodes."""
        self.held_bytes = 0

    def refusal(self, started: EpisodeStarted) -> Refusal | None:
        """Why ``started`` may not be held now (a cap is reached), or ``None``."""
        limits, actor = self.limits, started.actor_id
        if limits.max_per_actor is not None and self.per_actor[actor] >= limits.max_per_actor:
            return Refusal(
                "max_open_per_actor",
                f"actor {_shown(actor)} already holds {self.per_actor[actor]} open episodes "
                f"(max_open_per_actor = {limits.max_per_actor})",
            )
        if limits.max_open is not None and len(self.held) >= limits.max_open:
            return Refusal(
                "max_open_episodes",
                f"{len(self.held)} episodes are open (max_open_episodes = {limits.max_open})",
            )
        return self.over_bytes(event_bytes(started), actor)

    def over_bytes(self, size: int, actor: str) -> Refusal | None:
        """Why ``size`` more bytes published by ``actor`` may not be held now, or ``None``."""
        mine, cap = self.actor_bytes[actor], self.limits.max_bytes_per_actor
        if cap is not None and mine + size > cap:
            return Refusal(
                "max_open_bytes_per_actor",
                f"actor {_shown(actor)} holds {mine:,} bytes in open episodes and this event adds "
                f"{size:,} "
                f"(max_open_bytes_per_actor = {cap:,})",
            )
        cap = self.limits.max_bytes
        if cap is not None and self.held_bytes + size > cap:
            return Refusal(
                "max_open_bytes",
                f"{self.held_bytes:,} bytes are held by {len(self.held)} open episodes and this "
                "event adds "
                f"{size:,} (max_open_bytes = {cap:,})",
            )
        return None

    def hold(self, started: EpisodeStarted) -> None:
        """Hold ``started``'s episode until :meth:`release`."""
        self.held[started.episode_id] = started.actor_id
        self.per_actor[started.actor_id] += 1
        self.bytes[started.episode_id] = Counter()
        self.charge(started.episode_id, event_bytes(started), started.actor_id)

    def charge(self, episode_id: str, size: int, actor: str) -> None:
        """Count ``size`` more bytes, published by ``actor``, held by ``episode_id`` (a held
        episode; others cost nothing here)."""
        charged = self.bytes.get(episode_id)
        if charged is not None:
            charged[actor] += size
            self.actor_bytes[actor] += size
            self.held_bytes += size

    def release(self, episode_id: str) -> None:
        """The episode's events are no longer needed: listed for :meth:`drain`, its slot freed."""
        actor = self.held.pop(episode_id, None)
        if actor is None:
            return
        for publisher, size in self.bytes.pop(episode_id, Counter()).items():
            self.held_bytes -= size
            self.actor_bytes[publisher] -= size
            if self.actor_bytes[publisher] <= 0:
                del self.actor_bytes[publisher]
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
