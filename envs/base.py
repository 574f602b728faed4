"""The environment protocol every LEAFE environment implements, and rollback on top of it.

An environment is a synchronous step function with a task catalogue. Rollback returns it to the
state before step tau of some branch: with ``snapshot()``/``restore()`` where the state copies
cheaply, else by deterministic replay (``reset`` + re-executing the action prefix).
:func:`rollback_to` hides the choice and reports what it cost. Environments never raise on a bad
action: they answer with feedback.

Two optional abilities, found by ``leafe.envs.registry.demonstrator`` / ``reflection_oracle``:

- :class:`Demonstrator`: ``demonstration(task_id)`` is an expert's action sequence for a *train*
  task (Sokoban: the solver's optimal moves; TextWorld: the game's walkthrough; ScienceWorld: the
  gold path; HumanEval: the canonical solution, ``envs/humaneval/expert.py``). Replayed from
  ``reset(task_id)`` it solves the task, its last action being the solving one. Any other split is
  an :class:`EnvError`, so no demonstration can leak a test task into training.
- :class:`ReflectionOracle`: ``oracle_reflection(task_id, history)`` plays the reflecting policy
  from privileged knowledge (Sokoban's solver, HumanEval's visible-test feedback): the first faulty
  step tau and a templated experience e. An ablation of Stage 1, never the method itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from leafe.protocol.prompt import HistoryEntry

__all__ = [
    "Demonstrator",
    "Env",
    "EnvError",
    "OracleReflection",
    "ReflectionOracle",
    "Reset",
    "RollbackResult",
    "Transition",
    "play",
    "require_train_split",
    "rollback_to",
]


class EnvError(RuntimeError):
    """The environment itself failed (crashed backend, unknown task id); not a bad action."""


class Reset(msgspec.Struct, frozen=True, kw_only=True):
    """What ``reset`` returns."""

    task: str
    """Task text q shown to the agent."""
    observation: str
    """Initial observation o_0."""


class Transition(msgspec.Struct, frozen=True, kw_only=True):
    """The environment's answer to one action."""

    observation: str
    """Observation after the action."""
    reward: float = 0.0
    """Reward of this transition."""
    done: bool = False
    """The episode is over (success, irreversible failure or the env's own limit)."""
    success: bool = False
    """The task is solved."""
    feedback: str = ""
    """Short text for the agent (invalid action, bumped a wall, test failure...)."""
    valid: bool = True
    """False when the action was not understood or not allowed (nothing changed)."""
    score: float = 0.0
    """Task score so far (env-specific scale; ScienceWorld points, tests passed...)."""


class RollbackResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a rollback did."""

    observation: str
    """Observation of the restored state (o_tau)."""
    method: Literal["snapshot", "replay"]
    """How the state was restored."""
    replay_steps: int
    """Environment steps spent replaying (0 for a snapshot)."""


@runtime_checkable
class Env(Protocol):
    """A LEAFE environment. One instance plays one episode at a time; not thread-safe."""

    name: str
    """Registry name (``sokoban``, ``scienceworld``, ``textworld-cooking``, ``humaneval``)."""
    instructions: str
    """System prompt for the agent: rules and the exact action format."""
    supports_snapshot: bool
    """True when ``snapshot``/``restore`` are cheap and exact."""

    def tasks(self, split: str) -> list[str]:
        """Task ids of a split (``train`` or ``test``); seeded, stable and disjoint across
        splits."""
        ...

    def reset(self, task_id: str) -> Reset:
        """Start ``task_id`` from its initial state."""
        ...

    def step(self, action: str) -> Transition:
        """Apply one action (free text; invalid actions yield feedback, never an exception)."""
        ...

    def valid_actions(self) -> list[str] | None:
        """Currently valid actions where the environment knows them, else ``None``."""
        ...

    def snapshot(self) -> Any:
        """Opaque copy of the current state (only when ``supports_snapshot``)."""
        ...

    def restore(self, snapshot: Any) -> str:
        """Restore a ``snapshot``; returns the observation of that state."""
        ...

    def close(self) -> None:
        """Release processes, files and other resources."""
        ...


class OracleReflection(msgspec.Struct, frozen=True, kw_only=True):
    """What an oracle says about a path: the faulty step and how to fix it."""

    tau: int
    """The first faulty step (0-based index into the history it was given)."""
    experience: str
    """What went wrong at tau and what to do instead; empty when the path holds no mistake."""
    action: str = ""
    """The action ``experience`` names as the fix (empty when it names none)."""


@runtime_checkable
class Demonstrator(Protocol):
    """An expert for the train tasks of one environment (see the module docstring)."""

    def demonstration(self, task_id: str) -> list[str]:
        """Actions that solve train task ``task_id`` from its start; :class:`EnvError` for other
        splits."""
        ...


@runtime_checkable
class ReflectionOracle(Protocol):
    """Names the faulty step of a path and a fix, from knowledge the policy does not have."""

    def oracle_reflection(self, task_id: str, history: Sequence[HistoryEntry]) -> OracleReflection:
        """tau and e for ``history`` (>= 1 step, as the agent saw it) played from ``task_id``'s
        start."""
        ...


def require_train_split(task_id: str, split: str) -> None:
    """Raise :class:`EnvError` unless ``split`` is ``train`` (demonstrations come from train tasks
    only)."""
    if split != "train":
        raise EnvError(
            f"no demonstration of {task_id!r}: demonstrations come from the train split only"
        )


def rollback_to(
    env: Env,
    task_id: str,
    prefix_actions: Sequence[str],
    snapshot: Any | None = None,
) -> RollbackResult:
    """Put ``env`` in the state reached from ``task_id``'s start after ``prefix_actions``.

    Uses ``snapshot`` (taken in that state) when given and supported, else resets and replays the
    prefix; ``replay_steps`` reports the env steps that cost.
    """
    if snapshot is not None and env.supports_snapshot:
        return RollbackResult(observation=env.restore(snapshot), method="snapshot", replay_steps=0)
    obs = env.reset(task_id).observation
    for action in prefix_actions:
        obs = env.step(action).observation
    return RollbackResult(observation=obs, method="replay", replay_steps=len(prefix_actions))


def play(env: Env, task_id: str) -> None:
    """Play ``task_id`` by hand in a terminal (``python -m leafe.envs.sokoban.env`` etc.); closes
    the env."""
    reset = env.reset(task_id)
    print(env.instructions, "\n\n", reset.task, "\n", reset.observation, sep="")
    try:
        done = False
        while not done:
            try:
                action = input("> ")
            except EOFError:  # end of piped input or Ctrl-D
                return
            t = env.step(action)
            print(t.observation, f"\nreward={t.reward} score={t.score} feedback={t.feedback!r}")
            done = t.done
    finally:
        env.close()
