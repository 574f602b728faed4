"""Sokoban: generated rooms are solvable at the stated difficulty, rules and rewards follow
gym-sokoban."""

from __future__ import annotations

from collections import deque

import pytest

from leafe.envs.base import EnvError
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv, SokobanSnapshot
from leafe.envs.sokoban.generator import RoomSpec, generate_room, render_room, room_split
from leafe.envs.sokoban.solver import Room, apply_move, solve
from tests.support.rooms import room_from


def env_on(layout: list[str], **options: object) -> SokobanEnv:
    """An env whose current state is the hand-made room ``layout``."""
    env = SokobanEnv(SokobanConfig(**options))  # type: ignore[arg-type]
    room = room_from(layout)
    env.restore(
        SokobanSnapshot(task_id="sokoban/test/0", room=room, player=room.player, boxes=room.boxes)
    )
    return env


def bfs_optimum(room: Room) -> int | None:
    """Plain BFS over (player, boxes): the reference the A* solver must match."""
    start = (room.player, room.boxes)
    seen = {start: 0}
    queue = deque([start])
    while queue:
        player, boxes = queue.popleft()
        if boxes == room.targets:
            return seen[(player, boxes)]
        for move in ("up", "down", "left", "right"):
            nxt = apply_move(room, player, boxes, move)[:2]
            if nxt not in seen:
                seen[nxt] = seen[(player, boxes)] + 1
                queue.append(nxt)
    return None


@pytest.mark.parametrize(
    "spec",
    [
        RoomSpec(height=5, width=5, num_boxes=1, max_solution_len=6),
        RoomSpec(height=6, width=6, num_boxes=1, min_solution_len=3, max_solution_len=10),
        RoomSpec(height=7, width=7, num_boxes=2, max_solution_len=20),
        RoomSpec(height=8, width=8, num_boxes=3, max_solution_len=25),
    ],
)
def test_generated_rooms_are_solved_by_their_plan_at_the_stated_difficulty(spec: RoomSpec) -> None:
    """Each room's plan solves it in the env, its length is within bounds and no plan is shorter."""
    env = SokobanEnv(SokobanConfig(max_steps=100))
    for i in range(6):
        g = generate_room(spec, f"t/{i}")
        assert spec.min_solution_len <= len(g.plan) <= spec.max_solution_len
        if spec.num_boxes <= 2:
            assert bfs_optimum(g.room) == len(g.plan)
        env.restore(
            SokobanSnapshot(
                task_id="sokoban/test/0", room=g.room, player=g.room.player, boxes=g.room.boxes
            )
        )
        transitions = [env.step(a) for a in g.plan]
        assert transitions[-1].success and transitions[-1].done
        assert not any(t.done for t in transitions[:-1])


def test_env_tasks_are_solvable_with_the_default_config() -> None:
    """Every default task room (a sample) is won by its own optimal plan with gym-sokoban's final
    reward."""
    env = SokobanEnv()
    for task_id in env.tasks("train")[:20] + env.tasks("test")[:20]:
        env.reset(task_id)
        plan = env.room(task_id).plan
        assert 1 <= len(plan) <= env.config.max_solution_len
        last = [env.step(a) for a in plan][-1]
        assert last.success and last.reward == pytest.approx(-0.1 + 1.0 + 10.0)


def test_splits_are_disjoint_and_stable() -> None:
    """No room is in both splits (tiny rooms, where collisions would be likely), and regeneration is
    exact."""
    config = SokobanConfig(height=5, width=5, max_solution_len=4, num_train=150, num_test=150)
    env = SokobanEnv(config)
    train = {render_room(env.room(t).room) for t in env.tasks("train")}
    test = {render_room(env.room(t).room) for t in env.tasks("test")}
    assert train and test and not train & test
    assert all(room_split(env.room(t).room) == "test" for t in env.tasks("test")[:20])
    again = SokobanEnv(config)
    assert [env.reset(t).observation for t in env.tasks("test")[:10]] == [
        again.reset(t).observation for t in again.tasks("test")[:10]
    ]
    other_seed = SokobanEnv(SokobanConfig(height=5, width=5, max_solution_len=4, seed=1))
    assert [env.reset(t).observation for t in env.tasks("test")[:10]] != [
        other_seed.reset(t).observation for t in other_seed.tasks("test")[:10]
    ]


def test_move_rewards_follow_gym_sokoban() -> None:
    """-0.1 per step, +1 onto a target, -1 off a target, +10 when all boxes are on targets."""
    env = env_on(
        ["########", "#______#", "#P_XO__#", "#______#", "#__X___#", "#__O___#", "########"]
    )
    assert env.step("right").reward == pytest.approx(-0.1)
    t = env.step("right")
    assert (
        t.reward == pytest.approx(0.9)
        and t.feedback == "You pushed a box onto a target."
        and t.score == 0.5
    )
    t = env.step("right")
    assert t.reward == pytest.approx(-1.1) and "off a target" in t.feedback and t.score == 0.0


def test_solving_the_last_box_ends_with_success_and_the_bonus() -> None:
    """Putting the last box on its target ends the episode with +10."""
    env = env_on(["#####", "#PXO#", "#___#", "#####"])
    t = env.step("right")
    assert t.done and t.success and t.reward == pytest.approx(10.9) and "solved" in t.feedback
    assert env.step("left").feedback == "the episode is over"


def test_bumping_a_wall_and_an_immovable_box_give_feedback_and_change_nothing() -> None:
    """A blocked move costs a step (gym-sokoban) and says why."""
    env = env_on(["######", "#PXX_#", "#___O#", "#___O#", "######"])
    before = env.snapshot()
    t = env.step("up")
    assert (
        t.valid
        and t.feedback == "You walked into a wall; nothing moved."
        and t.reward == pytest.approx(-0.1)
    )
    t = env.step("right")
    assert "another box behind it" in t.feedback
    assert (env.snapshot().player, env.snapshot().boxes) == (before.player, before.boxes)
    env2 = env_on(["#####", "#_PX#", "#O__#", "#####"])
    assert "wall behind it" in env2.step("right").feedback


def test_pushing_a_box_into_a_corner_is_an_irreversible_failure() -> None:
    """A box that can never reach a target ends the episode (or only warns with end_on_deadlock
    off)."""
    layout = ["######", "#_X__#", "#_P__#", "#___O#", "######"]
    env = env_on(layout)
    assert not env.step("right").done
    assert not env.step("up").done
    t = env.step("left")  # box (1,2) -> (1,1): the top-left corner
    assert t.done and not t.success and "can no longer be solved" in t.feedback
    lenient = env_on(layout, end_on_deadlock=False)
    ts = [lenient.step(a) for a in ["right", "up", "left"]]
    assert not ts[-1].done and "can no longer be solved" in ts[-1].feedback


def test_pushing_along_a_wall_towards_a_target_is_not_a_deadlock() -> None:
    """A box against a wall that still holds a target in its line is alive."""
    env = env_on(["######", "#___O#", "#_X__#", "#_P__#", "######"])
    t = env.step("up")  # box (2,2) -> (1,2): top wall, the target (1,4) is on that wall
    assert not t.done and "can no longer" not in t.feedback


def test_freeze_deadlock_of_two_boxes_against_a_wall() -> None:
    """Two boxes side by side against a wall (a 2x2 block of boxes and walls) can never move again,
    even though each cell on its own could still reach a target."""
    env = env_on(["#######", "#OX__O#", "#__X__#", "#__P__#", "#_____#", "#######"])
    t = env.step("up")  # box (2,3) -> (1,3), next to the box at (1,2)
    assert t.done and not t.success and "can no longer be solved" in t.feedback
    env = env_on(["#######", "#OX__O#", "#___X_#", "#___P_#", "#_____#", "#######"])
    t = env.step("up")  # box (2,4) -> (1,4): not touching the other box, still alive
    assert not t.done


def test_invalid_actions_give_feedback_never_exceptions() -> None:
    """Anything but the four moves is invalid, changes nothing, costs no reward and counts a
    step."""
    env = SokobanEnv(SokobanConfig(max_steps=3))
    obs = env.reset("sokoban/test/1").observation
    for bad in ["jump", "", "up up", "<action>up</action>", "42"]:
        env.reset("sokoban/test/1")
        t = env.step(bad)
        assert not t.valid and t.observation == obs and t.reward == 0.0
        assert (
            t.feedback.startswith("invalid action:")
            and "valid actions: up, down, left, right" in t.feedback
        )
    env.reset("sokoban/test/1")
    assert [env.step(x).done for x in ["x", "y", "z"]] == [False, False, True]


def test_case_and_whitespace_variants_are_accepted() -> None:
    """'  UP ', 'Left.' and 'down' are moves."""
    env = SokobanEnv()
    for action in ["  UP ", "Left.", "down", "RIGHT\n"]:
        env.reset("sokoban/train/0")
        assert env.step(action).valid


def test_horizon_ends_the_episode() -> None:
    """After max_steps steps the episode is done (not successful) and says so."""
    env = env_on(["#######", "#P____#", "#____O#", "#___X_#", "#######"], max_steps=2)
    assert not env.step("down").done
    t = env.step("up")
    assert t.done and not t.success and "Step limit reached" in t.feedback


def test_snapshot_restore_is_exact() -> None:
    """Restoring a snapshot gives back the board and the same future, even after another task."""
    env = SokobanEnv()
    env.reset("sokoban/train/3")
    board = env.step("left").observation
    snap = env.snapshot()
    a = [env.step(m) for m in ["up", "right", "down"]]
    env.reset("sokoban/test/7")
    assert env.restore(snap) == board
    b = [env.step(m) for m in ["up", "right", "down"]]
    assert a == b


def test_bad_task_ids_raise_env_error() -> None:
    """Unknown splits, malformed ids and out-of-range indices are EnvErrors, not silent rooms."""
    env = SokobanEnv(SokobanConfig(num_test=5))
    for bad in ["sokoban/dev/0", "sokoban/test/x", "textworld/test/0", "sokoban/test/5"]:
        with pytest.raises(EnvError):
            env.reset(bad)
    with pytest.raises(EnvError):
        env.tasks("dev")
    with pytest.raises(EnvError):
        SokobanEnv().step("up")


def test_solver_returns_none_for_unsolvable_rooms() -> None:
    """A box stuck in a corner has no plan."""
    assert solve(room_from(["#####", "#X_O#", "#P__#", "#####"])) is None
