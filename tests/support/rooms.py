"""Hand-made Sokoban rooms for the env and oracle tests."""

from __future__ import annotations

from leafe.envs.sokoban.solver import Room

__all__ = ["room_from"]


def room_from(layout: list[str]) -> Room:
    """A room from text: # wall, _ floor, O target, X box, * box on target, P player, S player on
    target."""
    w = len(layout[0])
    cells = {r * w + c: ch for r, row in enumerate(layout) for c, ch in enumerate(row)}
    return Room(
        height=len(layout),
        width=w,
        walls=frozenset(i for i, ch in cells.items() if ch == "#"),
        targets=frozenset(i for i, ch in cells.items() if ch in "O*S"),
        boxes=frozenset(i for i, ch in cells.items() if ch in "X*"),
        player=next(i for i, ch in cells.items() if ch in "PS"),
    )
