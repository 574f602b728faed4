"""Sokoban with gym-sokoban's rules and rewards, as a LEAFE :class:`~leafe.envs.base.Env`.

Rooms come from the seeded generator (``leafe.envs.sokoban.generator``): task
``sokoban/<split>/<index>`` is the same room on every machine for a given config. Rewards follow
gym-sokoban: -0.1 per step, +1 for a box pushed onto a target, -1 for one pushed off, +10 when all
boxes are on targets. Extras for LEAFE: feedback on bumping a wall or an immovable box, on a box
pushed where it can never reach a target (a dead square or a frozen 2x2 block: an irreversible
failure; ``end_on_deadlock`` ends the episode) and a step horizon. The state is two ints and a
frozenset, so ``snapshot``/``restore`` are exact and cheap. Demonstrations are the solver's optimal
plans and the reflection oracle uses the solver (``leafe.envs.sokoban.expert``).

Play a room by hand: ``python -m leafe.envs.sokoban.env`` (type up/down/left/right).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import msgspec

from leafe.envs.base import EnvError, OracleReflection, Reset, Transition, play, require_train_split
from leafe.envs.sokoban.expert import oracle_reflection
from leafe.envs.sokoban.generator import (
    GeneratedRoom,
    RoomSpec,
    check_spec,
    generate_room,
    render_room,
)
from leafe.envs.sokoban.solver import ACTIONS, Room, apply_move, is_frozen_box, push_distances
from leafe.protocol.prompt import HistoryEntry

__all__ = ["SokobanConfig", "SokobanEnv", "SokobanSnapshot"]

STEP_PENALTY = -0.1
BOX_ON_TARGET = 1.0
BOX_OFF_TARGET = -1.0
ALL_ON_TARGETS = 10.0
SPLITS = ("train", "test")

INSTRUCTIONS = """You are playing Sokoban. Push every box onto a target.
Map legend: # wall, _ floor, O target, X box, * box on a target, P you, S you standing on a target.
Rows are listed top to bottom. Moving into a box pushes it one cell if the cell behind it is free.
You cannot pull boxes, and a box pushed into a corner can never be moved again.
Valid actions: up, down, left, right.
Answer with exactly one action in this format: <action>up</action>"""


class SokobanConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``make_env("sokoban", ...)``.

    Defaults suit the 135M default model: base SmolLM2-135M-Instruct (temperature 1) solved 1 of 12
    episodes on 5x5 rooms one or two moves from the goal, and 0 of 16 on 6x6 rooms up to three moves
    away (bench/results/envs_difficulty.json). gym-sokoban-like rooms: ``height=width=7..10``,
    ``num_boxes=1..3``, ``max_solution_len=0``, ``max_steps=120``.
    """

    height: int = 5
    """Room rows, including the outer wall."""
    width: int = 5
    """Room columns, including the outer wall."""
    num_boxes: int = 1
    """Boxes (= targets) per room."""
    min_solution_len: int = 1
    """Smallest optimal solution length in moves."""
    max_solution_len: int = 2
    """Largest optimal solution length in moves (the difficulty cap); 0 = no cap."""
    max_steps: int = 8
    """Horizon: the episode ends after this many steps (invalid actions count)."""
    end_on_deadlock: bool = True
    """End the episode (done, not success) when a box can no longer reach a target."""
    seed: int = 0
    """Seed of the task catalogue; the splits use different streams derived from it."""
    num_train: int = 10_000
    """Tasks in the ``train`` split."""
    num_test: int = 500
    """Tasks in the ``test`` split."""
    room_cache: int = 4096
    """Generated rooms kept in memory (generation is deterministic, so this only saves time)."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(
                f"num_train/num_test must be >= 0, got {self.num_train}/{self.num_test}"
            )
        try:
            check_spec(self.room_spec())
        except EnvError as e:
            raise ValueError(str(e)) from e

    def room_spec(self) -> RoomSpec:
        """The generator's spec for these options."""
        return RoomSpec(
            height=self.height,
            width=self.width,
            num_boxes=self.num_boxes,
            min_solution_len=self.min_solution_len,
            max_solution_len=self.max_solution_len,
        )


class SokobanSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that defines a Sokoban episode's state (immutable, so the snapshot is the
    state)."""

    task_id: str
    room: Room
    player: int
    boxes: frozenset[int]
    steps: int = 0
    done: bool = False
    success: bool = False


class SokobanEnv:
    """Seeded Sokoban rooms; see the module docstring. One episode at a time, not thread-safe."""

    name = "sokoban"
    instructions = INSTRUCTIONS
    supports_snapshot = True

    def __init__(self, config: SokobanConfig | None = None) -> None:
        self.config = config or SokobanConfig()
        self._spec = self.config.room_spec()
        self._generate = functools.lru_cache(maxsize=self.config.room_cache)(
            self._generate_uncached
        )
        self._state: SokobanSnapshot | None = None
        self._dist: dict[int, int] = {}

    # -- catalogue -------------------------------------------------------------------------------
    def tasks(self, split: str) -> list[str]:
        """``sokoban/<split>/<index>`` for every index of the split."""
        count = {"train": self.config.num_train, "test": self.config.num_test}.get(split)
        if count is None:
            raise EnvError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [f"sokoban/{split}/{i}" for i in range(count)]

    def room(self, task_id: str) -> GeneratedRoom:
        """The generated room (with its optimal plan) behind ``task_id``."""
        return self._generate(task_id)

    def _generate_uncached(self, task_id: str) -> GeneratedRoom:
        split, index = _parse_task_id(task_id)
        count = self.config.num_train if split == "train" else self.config.num_test
        if index >= count:
            raise EnvError(f"task {task_id!r} is outside the {split} split ({count} tasks)")
        key = f"{self.config.seed}/{split}/{index}"
        return generate_room(self._spec, key, split=split)

    def demonstration(self, task_id: str) -> list[str]:
        """The solver's optimal moves for train task ``task_id`` (:class:`EnvError` for a test
        task)."""
        require_train_split(task_id, _parse_task_id(task_id)[0])
        return list(self.room(task_id).plan)

    def oracle_reflection(self, task_id: str, history: Sequence[HistoryEntry]) -> OracleReflection:
        """The solver's verdict on ``history``: first step that made things worse, and the optimal
        move."""
        return oracle_reflection(self.room(task_id).room, history)

    # -- episode ---------------------------------------------------------------------------------
    def reset(self, task_id: str) -> Reset:
        """Start the room of ``task_id``."""
        room = self.room(task_id).room
        self._state = SokobanSnapshot(
            task_id=task_id, room=room, player=room.player, boxes=room.boxes
        )
        self._dist = push_distances(room)
        n = len(room.targets)
        what = (
            "the box (X) onto the target (O)"
            if n == 1
            else f"all {n} boxes (X) onto the targets (O)"
        )
        task = f"Push {what}."
        return Reset(task=task, observation=render_room(room))

    def step(self, action: str) -> Transition:
        """Apply one move; anything but up/down/left/right is an invalid action with feedback."""
        state = self._require_state()
        obs = render_room(state.room, state.player, state.boxes)
        if state.done:
            return Transition(
                observation=obs,
                done=True,
                success=state.success,
                valid=False,
                feedback="the episode is over",
                score=self._score(state.boxes),
            )
        move = _normalize(action)
        steps = state.steps + 1
        if move is None:
            feedback = (
                f"invalid action: {action.strip()[:80]!r}; valid actions: {', '.join(ACTIONS)}"
            )
            return self._finish(state, state.player, state.boxes, steps, 0.0, feedback, valid=False)
        player, boxes, what = apply_move(state.room, state.player, state.boxes, move)
        reward, feedback = self._reward_and_feedback(state, boxes, what)
        return self._finish(state, player, boxes, steps, reward, feedback, valid=True)

    def _reward_and_feedback(
        self, state: SokobanSnapshot, boxes: frozenset[int], what: str
    ) -> tuple[float, str]:
        targets = state.room.targets
        before, after = len(state.boxes & targets), len(boxes & targets)
        reward = (
            STEP_PENALTY
            + BOX_ON_TARGET * max(after - before, 0)
            + BOX_OFF_TARGET * max(before - after, 0)
        )
        if after == len(targets):
            return reward + ALL_ON_TARGETS, "All boxes are on targets: solved!"
        messages = {
            "wall": "You walked into a wall; nothing moved.",
            "blocked_wall": "The box cannot move: there is a wall behind it.",
            "blocked_box": "The box cannot move: there is another box behind it.",
            "moved": "",
        }
        if what != "pushed":
            return reward, messages[what]
        pushed = next(iter(boxes - state.boxes))
        if self._is_dead(boxes, pushed):
            return reward, (
                "You pushed a box where it can never reach a target (a corner or along a wall): "
                "the puzzle can no longer be solved."
            )
        if after > before:
            return reward, "You pushed a box onto a target."
        if after < before:
            return reward, "You pushed a box off a target."
        return reward, ""

    def _is_dead(self, boxes: frozenset[int], box: int) -> bool:
        room = self._require_state().room
        if box in room.targets:
            return is_frozen_box(room, boxes, box)
        return box not in self._dist or is_frozen_box(room, boxes, box)

    def _finish(
        self,
        state: SokobanSnapshot,
        player: int,
        boxes: frozenset[int],
        steps: int,
        reward: float,
        feedback: str,
        *,
        valid: bool,
    ) -> Transition:
        success = boxes == state.room.targets
        deadlocked = valid and boxes != state.boxes and self._any_dead(boxes)
        done = (
            success
            or steps >= self.config.max_steps
            or (deadlocked and self.config.end_on_deadlock)
        )
        if done and not success and steps >= self.config.max_steps and not deadlocked:
            feedback = f"{feedback} Step limit reached ({self.config.max_steps} steps).".strip()
        self._state = msgspec.structs.replace(
            state, player=player, boxes=boxes, steps=steps, done=done, success=success
        )
        return Transition(
            observation=render_room(state.room, player, boxes),
            reward=round(reward, 6),
            done=done,
            success=success,
            feedback=feedback,
            valid=valid,
            score=self._score(boxes),
        )

    def _any_dead(self, boxes: frozenset[int]) -> bool:
        return any(self._is_dead(boxes, b) for b in boxes)

    def _score(self, boxes: frozenset[int]) -> float:
        targets = self._require_state().room.targets
        return len(boxes & targets) / len(targets)

    def valid_actions(self) -> list[str]:
        """The four moves (always the same)."""
        return list(ACTIONS)

    def snapshot(self) -> SokobanSnapshot:
        """The current state (immutable, so no copy is needed)."""
        return self._require_state()

    def restore(self, snapshot: SokobanSnapshot) -> str:
        """Return to ``snapshot``; returns its board."""
        if not isinstance(snapshot, SokobanSnapshot):
            raise EnvError(f"not a Sokoban snapshot: {type(snapshot).__name__}")
        self._state = snapshot
        self._dist = push_distances(snapshot.room)
        return render_room(snapshot.room, snapshot.player, snapshot.boxes)

    def close(self) -> None:
        """Nothing to release."""
        self._state = None

    def _require_state(self) -> SokobanSnapshot:
        if self._state is None:
            raise EnvError("step() before reset(): call reset(task_id) first")
        return self._state


def _parse_task_id(task_id: str) -> tuple[str, int]:
    parts = task_id.split("/")
    if len(parts) != 3 or parts[0] != "sokoban" or parts[1] not in SPLITS or not parts[2].isdigit():
        raise EnvError(f"bad Sokoban task id {task_id!r}; expected sokoban/<train|test>/<index>")
    return parts[1], int(parts[2])


def _normalize(action: str) -> str | None:
    word = action.strip().strip("\"'`.!").strip().lower()
    return word if word in ACTIONS else None


def _play() -> None:
    play(SokobanEnv(), "sokoban/test/0")


if __name__ == "__main__":
    _play()
