"""Follow-audit probes that do not reward copying (issue #61 item 5).

W was trained on (e -> the move e names), so with the oracle's "... move X instead." in its prompt,
answering X is copying the last move word. These rewrites of the oracle's e keep its content and
drop the word X, so that answering X needs the state read, not the word copied:

- ``direction``: the fix as a compass direction ("go one square north instead", up = north);
- ``box``: where X pushes a box, the box to push by its position ("push the box at row 3, column 4
  (counted from 1 at the top left) instead"); no probe when X walks;
- ``mistake``: the mistake alone, the fix clause cut ("At step 3, moving left pushed a box where
  it can never reach a target"): does naming the mistake move the policy off the blamed move, and
  onto X, without being told X?

Every rewrite also says "moves to go" for the oracle's "moves left", so that no word of the rewrite
is X (checked: a rewrite that still names X as a word is dropped). Sokoban only (the observation is
the room's text grid, ``leafe.envs.sokoban.generator.SYMBOLS``).
"""

from __future__ import annotations

import re

__all__ = ["COMPASS", "PROBES", "box_position", "rewrites"]

PROBES = ("direction", "box", "mistake")
COMPASS = {"up": "north", "down": "south", "left": "west", "right": "east"}
_DELTA = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_FIX = re.compile(r"\s*From the position before that step, move (up|down|left|right) instead\.?")
_PLAYER = ("P", "S")
_BOX = ("X", "*")
_GRID = re.compile(r"^[#_OX*PS]+$")


def box_position(observation: str, move: str) -> tuple[int, int] | None:
    """(row, column), counted from 1 at the top left, of the box ``move`` pushes from the player's
    cell in the room grid of ``observation``; None when it pushes none (or the grid is not
    found)."""
    rows = [line.strip() for line in observation.splitlines() if _GRID.match(line.strip())]
    player = [(r, c) for r, line in enumerate(rows) for c, ch in enumerate(line) if ch in _PLAYER]
    if len(player) != 1 or move not in _DELTA:
        return None
    (r, c), (dr, dc) = player[0], _DELTA[move]
    r, c = r + dr, c + dc
    if not (0 <= r < len(rows) and 0 <= c < len(rows[r])) or rows[r][c] not in _BOX:
        return None
    return r + 1, c + 1


def _names(text: str, move: str) -> bool:
    return re.search(rf"\b{re.escape(move)}\b", text, flags=re.IGNORECASE) is not None


def rewrites(e: str, move: str, observation: str) -> dict[str, str]:
    """Probe -> the rewritten e, for each probe of :data:`PROBES` that applies to the oracle's
    ``e`` naming ``move`` at the state shown in ``observation``."""
    found = _FIX.search(e)
    if found is None or found.group(1) != move:
        return {}
    head = e[: found.start()].replace(" moves left)", " moves to go)").rstrip()
    head = head if head.endswith(".") else head + "."
    tail = e[found.end() :]
    out = {
        "direction": f"{head} From the position before that step, go one square "
        f"{COMPASS[move]} instead.{tail}",
        "mistake": f"{head}{tail}",
    }
    box = box_position(observation, move)
    if box is not None:
        out["box"] = (
            f"{head} From the position before that step, push the box at row {box[0]}, column "
            f"{box[1]} (counted from 1 at the top left) instead.{tail}"
        )
    return {k: v for k, v in out.items() if not _names(v, move)}
