"""The Sokoban expert: demonstrations from the optimal solver, and the oracle that reflects with it.

- demonstrations (``SokobanEnv.demonstration``): the generated room's optimal plan
  (``GeneratedRoom.plan``, checked by the A* solver when the room was drawn), for train tasks only.
- :func:`oracle_reflection`: replays a path from the room's start with the game's rules and
  measures, after every step, the optimal number of moves left
  (:func:`leafe.envs.sokoban.solver.solve`; unsolvable = infinite, which covers dead squares and
  frozen boxes). tau is the first step after which that distance *grew* (a push into a deadlock, or
  a push that made the solution longer); when no step made it grow, the first step that made no
  progress (a bump into a wall, an unparsed answer, a detour); when every step was optimal, there is
  no mistake (empty experience). e names the step, the move and what it did, and the solver's
  optimal move from the state before it::

      At step 3, moving left pushed a box where it can never reach a target (a corner or along a
      wall). From the position before that step, move up instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from leafe.envs.base import OracleReflection
from leafe.envs.sokoban.solver import ACTIONS, Room, apply_move, solve
from leafe.protocol.prompt import HistoryEntry

__all__ = ["optimal_distance", "oracle_reflection"]

_UNSOLVABLE = 10**9
"""Distance of a state from which no solution exists."""
_STATE_CAP = 200_000
"""Solver state budget per query (the env's rooms are tiny; beyond it a state counts as
unsolvable)."""


def optimal_distance(room: Room, player: int, boxes: frozenset[int]) -> int:
    """Optimal moves left from (player, boxes); a huge number when the room can no longer be
    solved."""
    plan = solve(room.with_state(player, boxes), max_states=_STATE_CAP)
    return _UNSOLVABLE if plan is None else len(plan)


def _move(action: str | None) -> str | None:
    word = (action or "").strip().strip("\"'`.!").strip().lower()
    return word if word in ACTIONS else None


def _what_happened(move: str | None, what: str, before: int, after: int) -> str:
    if move is None:
        return "your answer named no valid move, so nothing happened"
    if after >= _UNSOLVABLE:
        return (
            f"moving {move} pushed a box where it can never reach a target "
            "(a corner or along a wall)"
        )
    if after > before:
        return f"moving {move} made the solution longer ({before} -> {after} moves left)"
    if what == "wall":
        return f"moving {move} walked into a wall and nothing moved"
    if what.startswith("blocked"):
        return f"moving {move} pushed a box that could not move, and nothing moved"
    return f"moving {move} did not bring you closer to solving the room"


def oracle_reflection(room: Room, history: Sequence[HistoryEntry]) -> OracleReflection:
    """tau and e for ``history`` played from ``room``'s start (see the module docstring)."""
    if not history:
        raise ValueError("an oracle reflection needs a history of at least one step")
    player, boxes = room.player, room.boxes
    dist = optimal_distance(room, player, boxes)
    first_idle: tuple[int, str, tuple[int, frozenset[int]]] | None = None
    for t, entry in enumerate(history):
        move = _move(entry.action)
        if move is None:
            nxt_player, nxt_boxes, what = player, boxes, "invalid"
        else:
            nxt_player, nxt_boxes, what = apply_move(room, player, boxes, move)
        after = optimal_distance(room, nxt_player, nxt_boxes)
        if after > dist:
            return _reflection(room, t, _what_happened(move, what, dist, after), (player, boxes))
        if after == dist and first_idle is None:
            first_idle = (t, _what_happened(move, what, dist, after), (player, boxes))
        player, boxes, dist = nxt_player, nxt_boxes, after
        if dist == 0:
            break  # solved: the episode ended here, later steps (if any) were never played
    if first_idle is None:
        return OracleReflection(tau=len(history) - 1, experience="")
    return _reflection(room, *first_idle)


def _reflection(
    room: Room, tau: int, what: str, state: tuple[int, frozenset[int]]
) -> OracleReflection:
    plan = solve(room.with_state(*state), max_states=_STATE_CAP)
    if not plan:  # the state before the first growing step was solvable by construction
        raise ValueError(f"no optimal move from the state before step {tau}")
    experience = (
        f"At step {tau}, {what}. From the position before that step, move {plan[0]} instead."
    )
    return OracleReflection(tau=tau, experience=experience, action=plan[0])
