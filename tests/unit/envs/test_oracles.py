"""Reflection oracles: Sokoban's solver names the first step that made the room worse and the
optimal move instead; HumanEval's names the first failed submission and its failing visible test."""

from __future__ import annotations

import pytest

from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.humaneval.expert import HumanEvalExpert
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.envs.sokoban.expert import optimal_distance, oracle_reflection
from leafe.protocol.prompt import HistoryEntry
from tests.support.rooms import room_from

# Box at row 2, target at its right end; the player starts right of the box, below it. Optimal: walk
# left under and past the box (left, left, left), up, then push right twice: 6 moves.
CORRIDOR = [
    "#######",
    "#_____#",
    "#__X_O#",
    "#____P#",
    "#######",
]


def moves(*actions: str | None) -> list[HistoryEntry]:
    return [HistoryEntry(a, a or "gibberish", "", "") for a in actions]


def test_solver_distance_of_the_constructed_room() -> None:
    """The room is as described: 6 optimal moves; a box pushed against the top wall is lost
    forever."""
    room = room_from(CORRIDOR)
    assert optimal_distance(room, room.player, room.boxes) == 6
    box = next(iter(room.boxes))
    assert optimal_distance(room, box + room.width, frozenset({box - room.width})) >= 10**9


def corridor(k: int) -> list[str]:
    """CORRIDOR with the player k cells right of the cell under the box (k optimal 'left's to get
    there)."""
    width = k + 7
    row = ["#"] + ["_"] * (width - 2) + ["#"]
    boxes, player = list(row), list(row)
    boxes[3], boxes[width - 2], player[3 + k] = "X", "O", "P"
    return ["#" * width, "".join(row), "".join(boxes), "".join(player), "#" * width]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_tau_is_the_first_step_that_made_the_room_unsolvable(k: int) -> None:
    """k optimal moves (lefts: the player ends under the box), then 'up' pushes the box against the
    top wall at step k: tau == k, and e names the losing move and the solver's move instead."""
    room = room_from(corridor(k))
    assert optimal_distance(room, room.player, room.boxes) == 2 * k + 4
    verdict = oracle_reflection(room, moves(*["left"] * k, "up", "left", "right"))
    assert verdict.tau == k
    assert (
        f"At step {k}, moving up pushed a box where it can never reach a target"
        in verdict.experience
    )
    assert verdict.experience.endswith("From the position before that step, move left instead.")


def test_a_detour_that_lengthens_the_solution_is_named_with_the_distances() -> None:
    """Walking away from the box (6 -> 7 moves left) is the faulty step when nothing worse
    happened."""
    room = room_from(CORRIDOR)
    verdict = oracle_reflection(room, moves("left", "up", "down"))
    assert verdict.tau == 1
    assert "moving up made the solution longer (5 -> 6 moves left)" in verdict.experience
    assert verdict.experience.endswith("move left instead.")


def test_idle_steps_are_blamed_when_nothing_got_worse() -> None:
    """A bump into the wall or an unparsed answer changes nothing: the first one is tau."""
    room = room_from(CORRIDOR)
    bump = oracle_reflection(room, moves("left", "down", "left"))
    assert bump.tau == 1 and "walked into a wall" in bump.experience
    unparsed = oracle_reflection(room, moves(None))
    assert unparsed.tau == 0 and "named no valid move" in unparsed.experience


def test_an_optimal_path_has_no_mistake() -> None:
    """Optimal moves only: empty experience, so no branch is opened."""
    room = room_from(CORRIDOR)
    assert oracle_reflection(room, moves("left", "left", "left")).experience == ""


def test_sokoban_env_oracle_replays_the_generated_room() -> None:
    """On generated rooms the optimal plan holds no mistake, and an unparsed answer inserted at step
    1 is blamed, with the plan's next move as the fix."""
    env = SokobanEnv(SokobanConfig(height=7, width=7, min_solution_len=3, max_solution_len=8))
    for task_id in env.tasks("train")[:10]:
        room = env.room(task_id).room
        plan = env.demonstration(task_id)
        verdict = env.oracle_reflection(task_id, moves(*plan[:-1]))
        assert verdict.experience == ""  # still on the optimal path
        assert optimal_distance(room, room.player, room.boxes) == len(plan)
        off = env.oracle_reflection(task_id, moves(plan[0], None, *plan[1:]))
        assert off.tau == 1 and f"move {plan[1]} instead" in off.experience


def test_humaneval_oracle_quotes_the_first_failing_visible_test_from_the_observation() -> None:
    """tau is the first failed submission; e quotes its failing visible test and what went wrong,
    taken from the feedback the agent saw."""
    env = HumanEvalEnv(HumanEvalConfig(num_test=64))
    task_id = env.tasks("train")[0]
    problem = env.problem(task_id)
    env.reset(task_id)
    wrong = env.step(f"```python\ndef {problem.entry_point}(*args):\n    return None\n```")
    fixed = env.step(
        f"```python\ndef {problem.entry_point}(*args):\n    raise ValueError('boom')\n```"
    )
    history = [
        HistoryEntry("code", "raw", wrong.observation, wrong.feedback),
        HistoryEntry("code", "raw", fixed.observation, fixed.feedback),
    ]
    verdict = HumanEvalExpert(env).oracle_reflection(task_id, history)
    failed = next(
        line for line in wrong.observation.splitlines() if line.startswith("Failed test: ")
    )
    assert verdict.tau == 0
    assert failed.removeprefix("Failed test: ")[:60] in verdict.experience
    assert "returned None" in verdict.experience and verdict.experience.startswith(
        "Submission 0 failed"
    )


def test_humaneval_oracle_never_reads_hidden_tests() -> None:
    """Visible tests passed but hidden ones failed: e says so without quoting any test."""
    env = HumanEvalEnv(HumanEvalConfig(num_test=64))
    obs = "Submission 1 of 4: All 2 visible tests passed, but some hidden tests failed."
    history = [HistoryEntry("code", "raw", obs, obs.split(": ", 1)[1])]
    verdict = HumanEvalExpert(env).oracle_reflection(env.tasks("train")[0], history)
    assert (
        verdict.tau == 0 and "hidden" in verdict.experience and "assert" not in verdict.experience
    )
