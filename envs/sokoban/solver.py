"""Sokoban rooms and an optimal solver (A* over player + box positions).

A :class:`Room` is an immutable layout: walls, targets, boxes and the player, each cell an ``int``
(``row * width + col``). :func:`solve` returns a shortest plan in *moves* (what gym-sokoban counts
as steps), so its length is the room's difficulty. The heuristic is the sum over boxes of the pushes
a lone box needs to reach its nearest target (admissible and consistent with unit move costs); cells
from which no target is reachable (:func:`push_distances` gives them ``None``) prune dead pushes.

Run ``python -m leafe.envs.sokoban.solver`` to solve a small demo room.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable

import msgspec

__all__ = [
    "ACTIONS",
    "Room",
    "apply_move",
    "deltas",
    "is_frozen_box",
    "push_distances",
    "solve",
]

ACTIONS: tuple[str, ...] = ("up", "down", "left", "right")
"""The four moves, in the order gym-sokoban numbers its push actions."""


class Room(msgspec.Struct, frozen=True, kw_only=True):
    """An immutable Sokoban layout; cells are ``row * width + col``."""

    height: int
    """Rows, including the outer wall."""
    width: int
    """Columns, including the outer wall."""
    walls: frozenset[int]
    """Wall cells (everything outside the playable area is a wall too)."""
    targets: frozenset[int]
    """Target cells; as many as there are boxes."""
    boxes: frozenset[int]
    """Box cells."""
    player: int
    """The player's cell."""

    def cells(self) -> Iterable[int]:
        """All cells, row by row."""
        return range(self.height * self.width)

    def with_state(self, player: int, boxes: frozenset[int]) -> Room:
        """The same layout with another player and box placement."""
        return Room(
            height=self.height,
            width=self.width,
            walls=self.walls,
            targets=self.targets,
            boxes=boxes,
            player=player,
        )


def deltas(width: int) -> dict[str, int]:
    """Cell offset of each move for a room ``width`` columns wide."""
    return {"up": -width, "down": width, "left": -1, "right": 1}


def apply_move(
    room: Room, player: int, boxes: frozenset[int], move: str
) -> tuple[int, frozenset[int], str]:
    """One move under gym-sokoban's rules: walk, or push a single box if the cell behind it is free.

    Returns the new player cell, the new boxes and what happened: ``moved``, ``pushed``, ``wall``
    (bumped a wall), ``blocked_wall`` / ``blocked_box`` (the box has a wall / another box behind
    it).
    """
    d = deltas(room.width)[move]
    nxt = player + d
    if nxt in room.walls:
        return player, boxes, "wall"
    if nxt not in boxes:
        return nxt, boxes, "moved"
    beyond = nxt + d
    if beyond in room.walls:
        return player, boxes, "blocked_wall"
    if beyond in boxes:
        return player, boxes, "blocked_box"
    return nxt, (boxes - {nxt}) | {beyond}, "pushed"


def push_distances(room: Room) -> dict[int, int]:
    """Pushes a lone box needs from each floor cell to its nearest target; dead cells are absent.

    Computed by pulling boxes backwards from every target (a box at ``c`` can be pushed towards
    ``d`` when both ``c - d`` and ``c + d`` are floor), ignoring other boxes.
    """
    dist: dict[int, int] = {t: 0 for t in room.targets}
    queue = deque(room.targets)
    steps = deltas(room.width).values()
    while queue:
        cell = queue.popleft()
        for d in steps:
            prev, player_cell = cell - d, cell - 2 * d
            if prev in room.walls or player_cell in room.walls or prev in dist:
                continue
            if not _inside(room, prev) or not _inside(room, player_cell):
                continue
            dist[prev] = dist[cell] + 1
            queue.append(prev)
    return dist


def _inside(room: Room, cell: int) -> bool:
    return 0 <= cell < room.height * room.width


def is_frozen_box(room: Room, boxes: frozenset[int], box: int) -> bool:
    """True when ``box`` closes a 2x2 block of walls and boxes holding a box that is off its target.

    Such a block can never move again (a classic freeze deadlock).
    """
    w = room.width
    for corner in (box, box - 1, box - w, box - w - 1):
        block = (corner, corner + 1, corner + w, corner + w + 1)
        if box not in block:
            continue
        if all(c in room.walls or c in boxes for c in block) and any(
            c in boxes and c not in room.targets for c in block
        ):
            return True
    return False


def solve(room: Room, *, max_len: int | None = None, max_states: int = 200_000) -> list[str] | None:
    """A shortest move sequence that puts every box on a target, or ``None``.

    ``None`` also when the optimum exceeds ``max_len`` or the search expands more than
    ``max_states`` states (the generator rejects such rooms).
    """
    dist = push_distances(room)
    if any(b not in dist for b in room.boxes):
        return None
    d_of = deltas(room.width)
    start = (room.player, room.boxes)
    parents: dict[tuple[int, frozenset[int]], tuple[tuple[int, frozenset[int]], str] | None] = {
        start: None
    }
    cost = {start: 0}
    tie = itertools.count()
    frontier = [(_heuristic(room.boxes, dist), next(tie), start)]
    while frontier:
        _, _, state = heapq.heappop(frontier)
        player, boxes = state
        g = cost[state]
        if boxes == room.targets:
            return _plan(parents, state)
        if len(cost) > max_states:
            return None
        for move, d in d_of.items():
            nxt = _successor(room, player, boxes, d, dist)
            if nxt is None or (nxt in cost and cost[nxt] <= g + 1):
                continue
            h = _heuristic(nxt[1], dist)
            if max_len is not None and g + 1 + h > max_len:
                continue
            cost[nxt] = g + 1
            parents[nxt] = (state, move)
            heapq.heappush(frontier, (g + 1 + h, next(tie), nxt))
    return None


def _heuristic(boxes: frozenset[int], dist: dict[int, int]) -> int:
    return sum(dist[b] for b in boxes)


def _successor(
    room: Room, player: int, boxes: frozenset[int], d: int, dist: dict[int, int]
) -> tuple[int, frozenset[int]] | None:
    nxt = player + d
    if nxt in room.walls:
        return None
    if nxt not in boxes:
        return nxt, boxes
    beyond = nxt + d
    if beyond in room.walls or beyond in boxes or beyond not in dist:
        return None
    new_boxes = (boxes - {nxt}) | {beyond}
    if is_frozen_box(room, new_boxes, beyond):
        return None
    return nxt, new_boxes


def _plan(parents: dict, state: tuple[int, frozenset[int]]) -> list[str]:
    moves: list[str] = []
    link = parents[state]
    while link is not None:
        state, move = link
        moves.append(move)
        link = parents[state]
    return moves[::-1]


def _demo() -> None:
    layout = ["#####", "#P__#", "#_X_#", "#__O#", "#####"]
    w = len(layout[0])
    cells = {(r * w + c): ch for r, row in enumerate(layout) for c, ch in enumerate(row)}
    room = Room(
        height=len(layout),
        width=w,
        walls=frozenset(i for i, ch in cells.items() if ch == "#"),
        targets=frozenset(i for i, ch in cells.items() if ch == "O"),
        boxes=frozenset(i for i, ch in cells.items() if ch == "X"),
        player=next(i for i, ch in cells.items() if ch == "P"),
    )
    print(solve(room))


if __name__ == "__main__":
    _demo()
