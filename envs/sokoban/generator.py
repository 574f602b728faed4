"""Seeded generator of solvable Sokoban rooms with an exact difficulty.

1. Carve floor with a random walk inside the outer wall (gym-sokoban's topology step) and put the
   targets on random floor cells.
2. Search backwards from every solved state (boxes on the targets, player anywhere): a reverse move
   is a walk or a walk that *pulls* the box behind the player, the exact inverse of a forward walk
   or push. This breadth-first search gives every start state its optimal solution length in moves.
3. Pick a distance uniformly among those in ``[min_solution_len, max_solution_len]`` that occur,
   then a start state at that distance. The independent A* solver (``leafe.envs.sokoban.solver``)
   replays the choice and must find a plan of exactly that length, else :class:`EnvError` (a bug,
   never expected).

Splits stay disjoint by construction: a room belongs to ``train`` or ``test`` by one bit of the
SHA-256 of its rendering, and the generator of a split only picks rooms of that split.

Run ``python -m leafe.envs.sokoban.generator`` to print a few rooms with their optimal plans.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque

import msgspec

from leafe.envs.base import EnvError
from leafe.envs.sokoban.solver import Room, deltas, solve

__all__ = ["GeneratedRoom", "RoomSpec", "check_spec", "generate_room", "render_room", "room_split"]

SYMBOLS = {
    "wall": "#",
    "floor": "_",
    "target": "O",
    "box": "X",
    "box_on_target": "*",
    "player": "P",
}
PLAYER_ON_TARGET = "S"


class RoomSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What kind of room to draw."""

    height: int
    """Rows including the outer wall."""
    width: int
    """Columns including the outer wall."""
    num_boxes: int
    """Boxes (and targets)."""
    min_solution_len: int = 1
    """Smallest optimal solution length (moves) accepted."""
    max_solution_len: int = 0
    """Largest optimal solution length (moves) accepted; 0 = no cap."""
    max_search_states: int = 100_000
    """Cap on the backward search; beyond it only the fully searched distances are used."""
    max_attempts: int = 200
    """Layouts drawn before giving up with :class:`EnvError`."""


class GeneratedRoom(msgspec.Struct, frozen=True, kw_only=True):
    """A room with its optimal plan."""

    room: Room
    plan: list[str]
    """A shortest solution (moves); ``len(plan)`` is the difficulty."""
    attempts: int
    """Draws it took (1 = the first one was accepted)."""


def render_room(room: Room, player: int | None = None, boxes: frozenset[int] | None = None) -> str:
    """Text grid (one line per row) with the legend of :data:`SYMBOLS`."""
    player = room.player if player is None else player
    boxes = room.boxes if boxes is None else boxes
    rows = []
    for r in range(room.height):
        row = []
        for c in range(room.width):
            row.append(_symbol(room, r * room.width + c, player, boxes))
        rows.append("".join(row))
    return "\n".join(rows)


def _symbol(room: Room, cell: int, player: int, boxes: frozenset[int]) -> str:
    if cell in room.walls:
        return SYMBOLS["wall"]
    on_target = cell in room.targets
    if cell == player:
        return PLAYER_ON_TARGET if on_target else SYMBOLS["player"]
    if cell in boxes:
        return SYMBOLS["box_on_target"] if on_target else SYMBOLS["box"]
    return SYMBOLS["target"] if on_target else SYMBOLS["floor"]


def room_split(room: Room) -> str:
    """``train`` or ``test``: one bit of the SHA-256 of the room's rendering."""
    digest = hashlib.sha256(render_room(room).encode()).digest()
    return "test" if digest[0] & 1 else "train"


def generate_room(spec: RoomSpec, key: str, split: str | None = None) -> GeneratedRoom:
    """The room for ``key`` (a seed string): same key and spec, same room, on any machine.

    ``split`` restricts the result to rooms of that split (see :func:`room_split`).
    """
    check_spec(spec)
    rng = random.Random(f"sokoban-room/{key}")
    for attempt in range(1, spec.max_attempts + 1):
        layout = _draw_layout(spec, rng)
        if layout is None:
            continue
        dist = _backward_distances(layout, spec)
        room, length = _pick_start(layout, dist, spec, rng, split)
        if room is None:
            continue
        plan = solve(room, max_len=length, max_states=10 * spec.max_search_states)
        if plan is None or len(plan) != length:
            raise EnvError(
                f"solver disagrees with the backward search on {render_room(room)!r}: {plan}"
            )
        return GeneratedRoom(room=room, plan=plan, attempts=attempt)
    raise EnvError(f"no room found for {spec!r} and key {key!r} in {spec.max_attempts} attempts")


def check_spec(spec: RoomSpec) -> None:
    """Raise :class:`EnvError` when no room can satisfy ``spec``."""
    if spec.height < 4 or spec.width < 4:
        raise EnvError(f"room {spec.height}x{spec.width} is too small (at least 4x4 with walls)")
    interior = (spec.height - 2) * (spec.width - 2)
    if spec.num_boxes < 1 or 2 * spec.num_boxes + 1 > interior:
        raise EnvError(f"num_boxes={spec.num_boxes} does not fit a {spec.height}x{spec.width} room")
    if spec.min_solution_len < 1:
        raise EnvError(f"min_solution_len={spec.min_solution_len} must be at least 1")
    if spec.max_solution_len and spec.max_solution_len < spec.min_solution_len:
        raise EnvError(
            f"max_solution_len={spec.max_solution_len} < min_solution_len={spec.min_solution_len}"
        )


def _draw_layout(spec: RoomSpec, rng: random.Random) -> Room | None:
    """Walls and targets (boxes on them, player anywhere: the solved state), or None if too
    cramped."""
    floor = _carve(spec, rng)
    if len(floor) < 2 * spec.num_boxes + 2:
        return None
    targets = frozenset(rng.sample(sorted(floor), spec.num_boxes))
    player = min(floor - targets)
    walls = frozenset(range(spec.height * spec.width)) - floor
    return Room(
        height=spec.height,
        width=spec.width,
        walls=walls,
        targets=targets,
        boxes=targets,
        player=player,
    )


def _carve(spec: RoomSpec, rng: random.Random) -> set[int]:
    """Floor cells from a random walk over the interior, each step opening one of gym-sokoban's
    masks."""
    h, w = spec.height, spec.width
    masks = [  # gym-sokoban's 3x3 masks, as offsets from the walker
        [(0, -1), (0, 0), (0, 1)],
        [(-1, 0), (0, 0), (1, 0)],
        [(0, -1), (0, 0), (1, 0)],
        [(0, -1), (0, 0), (1, -1), (1, 0)],
        [(0, 0), (0, 1), (1, 0)],
    ]
    r, c = rng.randint(1, h - 2), rng.randint(1, w - 2)
    direction = rng.choice([(0, 1), (1, 0), (0, -1), (-1, 0)])
    floor: set[int] = set()
    for _ in range(int(1.5 * (h + w))):
        for dr, dc in rng.choice(masks):
            rr, cc = r + dr, c + dc
            if 1 <= rr <= h - 2 and 1 <= cc <= w - 2:
                floor.add(rr * w + cc)
        if rng.random() < 0.35:
            direction = rng.choice([(0, 1), (1, 0), (0, -1), (-1, 0)])
        r = min(max(r + direction[0], 1), h - 2)
        c = min(max(c + direction[1], 1), w - 2)
    return floor


State = tuple[int, frozenset[int]]


def _backward_distances(layout: Room, spec: RoomSpec) -> dict[State, int]:
    """Optimal forward distance of every state that reaches the solved set, by BFS over reverse
    moves."""
    floor = [c for c in layout.cells() if c not in layout.walls]
    dist: dict[State, int] = {(p, layout.targets): 0 for p in floor if p not in layout.targets}
    queue = deque(dist)
    cap = spec.max_solution_len or None
    moves = list(deltas(layout.width).values())
    while queue:
        state = queue.popleft()
        depth = dist[state] + 1
        if (cap is not None and depth > cap) or len(dist) >= spec.max_search_states:
            break
        player, boxes = state
        for d in moves:
            nxt = player + d
            if nxt in layout.walls or nxt in boxes:
                continue
            successors = [(nxt, boxes)]
            if player - d in boxes:
                successors.append((nxt, (boxes - {player - d}) | {player}))
            for s in successors:
                if s not in dist:
                    dist[s] = depth
                    queue.append(s)
    return dist


def _pick_start(
    layout: Room, dist: dict[State, int], spec: RoomSpec, rng: random.Random, split: str | None
) -> tuple[Room | None, int]:
    """A start state: a distance uniformly among those in range, then a state at that distance."""
    complete = max(dist.values(), default=0)
    if len(dist) >= spec.max_search_states:
        complete -= (
            1  # the last layer may be cut short; its distances are still exact, but keep it clean
        )
    hi = min(spec.max_solution_len or complete, complete)
    by_length: dict[int, list[State]] = {}
    for state, d in dist.items():
        if spec.min_solution_len <= d <= hi:
            by_length.setdefault(d, []).append(state)
    lengths = sorted(by_length)
    rng.shuffle(lengths)
    for length in lengths:
        states = sorted(by_length[length], key=lambda s: (s[0], sorted(s[1])))
        rng.shuffle(states)
        for player, boxes in states:
            room = layout.with_state(player, boxes)
            if split is None or room_split(room) == split:
                return room, length
    return None, 0


def _demo() -> None:
    spec = RoomSpec(height=6, width=6, num_boxes=1, min_solution_len=3, max_solution_len=8)
    for i in range(3):
        g = generate_room(spec, f"demo/{i}")
        print(
            render_room(g.room), f"\noptimal: {len(g.plan)} moves {g.plan} ({g.attempts} draws)\n"
        )


if __name__ == "__main__":
    _demo()
