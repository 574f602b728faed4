"""Task assignments: the messages on the ``LEAFE_TASKS`` work queue.

Produced by ``leafe run`` / ``leafe tasks submit`` (services), consumed by ``leafe actor``. An actor
acks an assignment only after the episode's ``EpisodeFinished`` is durably in the log; a crashed
actor's assignment is redelivered and served as a new episode (``attempt`` + 1).
"""

from __future__ import annotations

import msgspec

from leafe.protocol.events import Mode

__all__ = ["TaskAssignment", "episode_id_for", "task_slug"]


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


def episode_id_for(task_key: str, attempt: int) -> str:
    """Episode id for a delivery attempt of an assignment: redelivery yields a fresh episode id."""
    return f"{task_key}.a{attempt}"


def task_slug(task_id: str) -> str:
    """A task id (or a label) as a subject/key-safe token: ``sokoban/train/3`` ->
    ``sokoban-train-3``."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in task_id)
