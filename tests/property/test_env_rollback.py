"""Rollback is exact for every environment: back to step tau, the same actions give the same future.

For random action sequences and a random tau, ``leafe.envs.base.rollback_to`` (by snapshot where the
env has one, and always by reset + replay) restores the state before step tau, and re-running the
remaining actions reproduces observations, rewards, done/success flags, feedback and scores exactly.
ScienceWorld and TextWorld run a few cheap examples by default and many more under ``-m slow``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.envs.base import Env, Transition, rollback_to
from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.scienceworld import ScienceWorldConfig, ScienceWorldEnv
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.envs.textworld.env import TextWorldConfig, TextWorldEnv

INVALID = "xyzzy plugh"
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

# A choice is an index into the current valid actions (resolved while playing) or None (an invalid
# action).
choices = st.lists(st.one_of(st.integers(0, 10_000), st.none()), max_size=8)


def resolve(env: Env, task_id: str, picks: Sequence[int | str | None]) -> list[str]:
    """Turn index picks into concrete action strings by playing them once (a str pick is used as
    is)."""
    env.reset(task_id)
    actions = []
    for pick in picks:
        valid = env.valid_actions()
        if isinstance(pick, str):
            action = pick
        else:
            action = INVALID if pick is None or not valid else valid[pick % len(valid)]
        actions.append(action)
        env.step(action)
    return actions


def check_rollback(env: Env, task_id: str, actions: Sequence[str], tau: int) -> None:
    """Play ``actions``; roll back to before step ``tau`` (snapshot and replay); replay must
    agree."""
    first = env.reset(task_id).observation
    snapshots = [env.snapshot()] if env.supports_snapshot else []
    played: list[Transition] = []
    for action in actions:
        played.append(env.step(action))
        if env.supports_snapshot:
            snapshots.append(env.snapshot())
    expected = first if tau == 0 else played[tau - 1].observation
    methods = [None, snapshots[tau]] if env.supports_snapshot else [None]
    for snapshot in methods:
        result = rollback_to(env, task_id, actions[:tau], snapshot=snapshot)
        assert result.observation == expected
        assert result.method == ("replay" if snapshot is None else "snapshot")
        assert result.replay_steps == (tau if snapshot is None else 0)
        assert [env.step(a) for a in actions[tau:]] == played[tau:]


@st.composite
def actions_and_tau(draw: st.DrawFn, actions: st.SearchStrategy[list]) -> tuple[list, int]:
    seq = draw(actions)
    return seq, draw(st.integers(0, len(seq)))


# -- Sokoban -------------------------------------------------------------------------------------
MOVES = st.lists(
    st.sampled_from(["up", "down", "left", "right", " Left ", "UP", "jump", ""]), max_size=30
)
SOKOBAN = {
    "default": SokobanEnv(),
    "bigger": SokobanEnv(
        SokobanConfig(
            height=7, width=7, num_boxes=2, max_solution_len=15, max_steps=40, end_on_deadlock=False
        )
    ),
}


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(sorted(SOKOBAN)),
    split=st.sampled_from(["train", "test"]),
    index=st.integers(0, 199),
    case=actions_and_tau(MOVES),
)
def test_sokoban_rollback_is_exact(
    which: str, split: str, index: int, case: tuple[list[str], int]
) -> None:
    """Sokoban: snapshot and replay rollback reproduce the future exactly."""
    check_rollback(SOKOBAN[which], f"sokoban/{split}/{index}", *case)


@settings(max_examples=40, deadline=None)
@given(index=st.integers(0, 199), case=actions_and_tau(MOVES))
def test_sokoban_plan_after_rollback_still_solves(index: int, case: tuple[list[str], int]) -> None:
    """Rolling back to the start and following the optimal plan always wins, whatever was played
    before."""
    env = SOKOBAN["default"]
    task_id = f"sokoban/train/{index}"
    env.reset(task_id)
    for a in case[0]:
        env.step(a)
    rollback_to(env, task_id, [])
    assert [env.step(a) for a in env.room(task_id).plan][-1].success


# -- HumanEval -----------------------------------------------------------------------------------
SUBMISSIONS = [
    "def add(x, y):\n    return x + y\n",
    "```python\ndef add(x, y):\n    return x - y\n```",
    "    return 1\n",
    "def add(x, y)\n    return x\n",
    "I am not sure.",
]


@pytest.fixture(scope="module")
def humaneval() -> HumanEvalEnv:
    return HumanEvalEnv(HumanEvalConfig(num_test=164))


@settings(max_examples=8, deadline=None, suppress_health_check=FIXTURES)
@given(case=actions_and_tau(st.lists(st.sampled_from(SUBMISSIONS), max_size=5)))
def test_humaneval_rollback_is_exact(humaneval: HumanEvalEnv, case: tuple[list[str], int]) -> None:
    """HumanEval: returning to an earlier turn (snapshot or replay) gives identical later
    feedback."""
    check_rollback(humaneval, "humaneval/test/53", *case)


# -- TextWorld -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def textworld(cache_dir: Path) -> Iterator[TextWorldEnv]:
    env = TextWorldEnv(TextWorldConfig(max_steps=12, cache_dir=str(cache_dir / "textworld")))
    yield env
    env.close()


@settings(max_examples=10, deadline=None, suppress_health_check=FIXTURES)
@given(picks=choices, data=st.data())
def test_textworld_rollback_is_exact(
    textworld: TextWorldEnv, picks: list, data: st.DataObject
) -> None:
    """TextWorld: replay rollback reproduces the future exactly (one game, default run)."""
    actions = resolve(textworld, "textworld-cooking/test/0", picks)
    check_rollback(
        textworld, "textworld-cooking/test/0", actions, data.draw(st.integers(0, len(actions)))
    )


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURES)
@given(
    index=st.integers(0, 2),
    picks=st.lists(st.one_of(st.integers(0, 10_000), st.none()), max_size=20),
    data=st.data(),
)
def test_textworld_rollback_is_exact_on_harder_games(
    cache_dir: Path, index: int, picks: list, data: st.DataObject
) -> None:
    """TextWorld with cooking, cutting, doors and 6 rooms: replay rollback is exact."""
    env = _HARD_TW.setdefault(
        "env",
        TextWorldEnv(
            TextWorldConfig(
                recipe=2,
                take=2,
                go=6,
                open=True,
                cook=True,
                cut=True,
                max_steps=25,
                cache_dir=str(cache_dir / "textworld"),
            )
        ),
    )
    task_id = f"textworld-cooking/train/{index}"
    actions = resolve(env, task_id, picks)
    check_rollback(env, task_id, actions, data.draw(st.integers(0, len(actions))))


_HARD_TW: dict[str, TextWorldEnv] = {}


# -- ScienceWorld --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scienceworld(cache_dir: Path) -> Iterator[ScienceWorldEnv]:
    env = ScienceWorldEnv(
        ScienceWorldConfig(
            task_names=[
                "find-plant",
                "boil",
                "grow-plant",
                "chemistry-mix",
                "mendelian-genetics-known-plant",
                "inclined-plane-determine-angle",
                "test-conductivity",
            ],
            max_steps=25,
            cache_dir=str(cache_dir / "scienceworld"),
        )
    )
    yield env
    env.close()


@settings(max_examples=4, deadline=None, suppress_health_check=FIXTURES)
@given(picks=st.lists(st.one_of(st.integers(0, 10_000), st.none()), max_size=6), data=st.data())
def test_scienceworld_rollback_is_exact(
    scienceworld: ScienceWorldEnv, picks: list, data: st.DataObject
) -> None:
    """ScienceWorld: replay rollback reproduces the future exactly (one task, default run)."""
    task_id = scienceworld.tasks("train")[0]
    actions = resolve(scienceworld, task_id, picks)
    check_rollback(scienceworld, task_id, actions, data.draw(st.integers(0, len(actions))))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURES)
@given(
    task=st.integers(0, 10_000),
    picks=st.lists(st.one_of(st.integers(0, 10_000), st.none()), max_size=20),
    data=st.data(),
)
def test_scienceworld_rollback_is_exact_across_tasks(
    scienceworld: ScienceWorldEnv, task: int, picks: list, data: st.DataObject
) -> None:
    """ScienceWorld on seven kinds of task (incl. time-driven growth and genetics): replay is
    exact."""
    names = scienceworld.task_names()
    name = names[task % len(names)]
    ids = [t for t in scienceworld.tasks("test") if f"/{name}/" in t]
    task_id = ids[task % len(ids)]
    timed = ["wait1" if p is not None and p % 5 == 0 else p for p in picks]  # let time pass too
    actions = resolve(scienceworld, task_id, timed)
    check_rollback(scienceworld, task_id, actions, data.draw(st.integers(0, len(actions))))
