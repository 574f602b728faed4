"""Task assignments: the messages on the ``LEAFE_TASKS`` work queue, and the ids of the episodes
that serve them.

Produced by ``leafe run`` / ``leafe tasks submit`` (services), consumed by ``leafe actor``. An actor
acks an assignment only after the episode's ``EpisodeFinished`` is durably in the log; a crashed
actor's assignment is redelivered and served as a new episode (``attempt`` + 1).

An episode id names the actor that started it: ``<task_key>.a<attempt>@<actor>``
(:func:`episode_id_for`; an actor token has no ``@``, so :func:`episode_owner` reads it back), and
its events' ids are ``<episode_id>.<seq>``, so admission can refuse an event whose episode names
another actor than its publisher (``leafe.protocol.codec.admit_event``). Ids stay deterministic
(a replayed or rerun log gives the same ids, samples and rehearsal choices); what no other actor
may predict is each event's ``Nats-Msg-Id`` (``<event_id>:<msg_nonce>``, ``leafe.protocol.events``):
JetStream dedupes that id stream-wide, so whoever could store another actor's next one first had
the real event dropped as a duplicate. Ids written before (``<task_key>.a<attempt>``, or anything
without ``@<actor>``) name no owner (:func:`episode_owner` is ``None``).
"""

from __future__ import annotations

import re

import msgspec

from leafe.protocol.events import Mode

__all__ = [
    "OWNER_MARK",
    "TaskAssignment",
    "episode_id_for",
    "episode_owner",
    "owned_episode_id",
    "task_slug",
]

OWNER_MARK = "@"
"""Separates an episode id's stem from the actor that owns it (no actor token holds it)."""
_ACTOR = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""An actor token (``leafe.protocol.subjects``: what an event subject's last token may be)."""


class TaskAssignment(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="task"):
    """One episode to run."""

    task_key: str
    """Unique, deterministic id of this assignment (``Nats-Msg-Id``), e.g.
    ``sokoban-train-00017-x0``."""
    run_id: str
    """Run the episode belongs to."""
    env: str
    """Environment registry name."""
    task_id: str
    """Environment task id."""
    split: str = "train"
    """``train`` or ``test``."""
    mode: Mode = "explore"
    """``explore`` runs the LEAFE tree; ``rollout``/``eval`` one plain sample; ``demo`` the expert's
    demonstration of a train task (``actors/demo.py``)."""
    seed: int = 0
    """Sampling seed for the episode."""
    group_id: str | None = None
    """GRPO group (n rollouts of one task); ``None`` when not grouped."""
    group_size: int = 1
    """Episodes in the group."""
    env_options: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)
    """Options passed to the environment constructor (registry name + options make an env)."""


def owned_episode_id(stem: str, actor_id: str) -> str:
    """``<stem>@<actor_id>``: an episode id that names its owner; ``ValueError`` for an empty stem
    or an actor id that is not a subject token."""
    if not isinstance(actor_id, str) or not _ACTOR.fullmatch(actor_id):
        raise ValueError(f"invalid actor id {actor_id!r} for an episode id (a subject token)")
    if not stem:
        raise ValueError("an episode id needs a non-empty stem")
    return f"{stem}{OWNER_MARK}{actor_id}"


def episode_id_for(task_key: str, attempt: int, actor_id: str) -> str:
    """The id of the episode ``actor_id`` starts for delivery ``attempt`` of an assignment:
    ``<task_key>.a<attempt>@<actor_id>`` (a redelivery gets a new one)."""
    return owned_episode_id(f"{task_key}.a{attempt}", actor_id)


def episode_owner(episode_id: str) -> str | None:
    """The actor an episode id names (``<stem>@<actor>``), or ``None`` for an id that names none
    (written before ids did)."""
    stem, mark, actor = episode_id.rpartition(OWNER_MARK)
    if not mark or not stem or not _ACTOR.fullmatch(actor):
        return None
    return actor


def task_slug(task_id: str) -> str:
    """A task id (or a label) as a subject/key-safe token: ``sokoban/train/3`` ->
    ``sokoban-train-3``."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in task_id)
