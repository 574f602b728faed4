"""experiments/paper/follow_probe.py: the oracle's e rewritten so that X is not a word to copy, on
real rooms; and the follow audit's new conditions and per-answer records on a real explore log."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.paper.follow_audit import (
    answer_records,
    audit_items,
    run_audit,
    summarize,
    write_records,
)
from experiments.paper.follow_probe import box_position, rewrites
from experiments.tests.test_follow_audit import TOK, _log
from leafe.actors.engine import SamplingParams
from leafe.actors.fakes import ScriptedEngine
from leafe.envs.sokoban.expert import oracle_reflection
from leafe.envs.sokoban.generator import render_room
from leafe.envs.sokoban.solver import ACTIONS, apply_move
from leafe.protocol.prompt import HistoryEntry
from tests.support.sokoban_episodes import MOVES, sokoban_env

pytestmark = pytest.mark.anyio


def _push_state() -> tuple[str, str, str]:
    """(the oracle's e, its move X, the grid before the step) for a detour whose fix is a push."""
    env = sokoban_env()
    for task in env.tasks("train")[:200]:
        room = env.room(task).room
        for first in ACTIONS:
            _, _, what = apply_move(room, room.player, room.boxes, first)
            if what != "moved":
                continue
            v = oracle_reflection(room, [HistoryEntry(first, "", "", "")])
            grid = render_room(room)
            if v.experience and box_position(grid, v.action):
                return v.experience, v.action, grid
    raise AssertionError("no first-step detour whose fix pushes a box in 200 rooms")


def test_rewrites_keep_the_content_and_drop_the_word_x() -> None:
    e, x, grid = _push_state()
    out = rewrites(e, x, grid)
    assert set(out) == {"direction", "box", "mistake"}
    for text in out.values():
        assert not re.search(rf"\b{x}\b", text, flags=re.IGNORECASE)
        assert text.startswith(e.split(".")[0].replace(" moves left)", " moves to go)"))
    compass = {"up": "north", "down": "south", "left": "west", "right": "east"}[x]
    assert f"go one square {compass} instead." in out["direction"]
    assert "instead" not in out["mistake"]
    r, c = box_position(grid, x) or (0, 0)
    assert grid.splitlines()[r - 1][c - 1] in "X*"
    assert f"push the box at row {r}, column {c}" in out["box"]


def test_a_walk_has_no_box_probe_and_an_e_without_a_fix_none() -> None:
    grid = "#####\n#P__#\n#_XO#\n#####"
    assert box_position(grid, "right") is None and box_position(grid, "down") is None
    assert box_position("#####\n#_P_#\n#_XO#\n#####", "down") == (3, 3)
    e = (
        "At step 0, moving up walked into a wall and nothing moved. From the position before "
        "that step, move right instead."
    )
    assert set(rewrites(e, "right", grid)) == {"direction", "mistake"}
    assert rewrites("At step 0 you hesitated.", "right", grid) == {}
    assert rewrites(e, "left", grid) == {}  # e names another move


async def test_probe_conditions_are_sampled_and_every_answer_is_recorded(tmp_path: Path) -> None:
    log = await _log(tmp_path)
    items = audit_items(log, TOK, MOVES)
    assert items and all({"direction", "mistake"} <= set(it.prompts) for it in items)

    def compass_reader(kind: str, prompt: str) -> str:
        words = {"north": "up", "south": "down", "west": "left", "east": "right"}
        found = re.findall(r"go one square (north|south|west|east) instead", prompt)
        return f"<action>{words[found[-1]] if found else 'up'}</action>"

    await run_audit(
        ScriptedEngine(script=compass_reader),
        items,
        samples=3,
        params=SamplingParams(max_new_tokens=16, stop=["</action>"]),
        response_prefix="<action>",
        actions=MOVES,
    )
    s = summarize(items, gate=0.7)
    assert s["named_with_direction_e"]["share"] == 1.0
    records = answer_records(items)
    assert len(records) == sum(len(a) for it in items for a in it.answers.values())
    path = write_records(items, tmp_path / "audit")
    back = [json.loads(line) for line in path.read_text().splitlines()]
    assert back == records
    # the share recounted from the records
    none = [r for r in back if r["condition"] == "none"]
    hits = sum(r["answer"] == r["named"] for r in none)
    assert s["named_without_e"]["share"] == round(hits / len(none), 4)
