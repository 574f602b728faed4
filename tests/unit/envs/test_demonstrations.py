"""Demonstrations: every environment's expert solves its train tasks and refuses test tasks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from leafe.envs.base import Demonstrator, Env, EnvError, ReflectionOracle
from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.humaneval.expert import HumanEvalExpert, expert_code
from leafe.envs.registry import ORACLE_ENVS, demonstrator, reflection_oracle
from leafe.envs.scienceworld import ScienceWorldConfig, ScienceWorldEnv
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.envs.sokoban.solver import solve
from leafe.envs.textworld.env import TextWorldConfig, TextWorldEnv
from tests.support.demos import SMALL_SOKOBAN


def replay(env: Env, task_id: str, actions: list[str]) -> list[bool]:
    """``done`` after each action, asserting the last one solves the task."""
    env.reset(task_id)
    transitions = [env.step(a) for a in actions]
    assert transitions[-1].success and transitions[-1].done, transitions[-1]
    return [t.done for t in transitions]


@pytest.mark.parametrize(
    "config", [SMALL_SOKOBAN, SokobanConfig(height=7, width=7, max_solution_len=8)]
)
def test_sokoban_demonstrations_are_optimal_and_solve(config: SokobanConfig) -> None:
    """The demonstration is the solver's optimal plan; replayed it solves the room on its last
    move."""
    env = SokobanEnv(config)
    for task_id in env.tasks("train")[:8]:
        plan = demonstrator(env).demonstration(task_id)
        assert len(plan) == len(solve(env.room(task_id).room) or [])
        assert replay(env, task_id, plan) == [False] * (len(plan) - 1) + [True]


def test_sokoban_refuses_test_tasks() -> None:
    """Asking for a demonstration of a test task is an EnvError that says why."""
    env = SokobanEnv(SMALL_SOKOBAN)
    with pytest.raises(EnvError, match="train split only"):
        env.demonstration(env.tasks("test")[0])


@pytest.fixture(scope="module")
def textworld(cache_dir: Path) -> Iterator[TextWorldEnv]:
    env = TextWorldEnv(
        TextWorldConfig(cache_dir=str(cache_dir / "textworld"), num_train=2, num_test=1)
    )
    yield env
    env.close()


def test_textworld_demonstration_is_the_walkthrough_and_wins(textworld: TextWorldEnv) -> None:
    """A train game's demonstration is its walkthrough; every command is admissible and it wins."""
    task_id = textworld.tasks("train")[0]
    actions = demonstrator(textworld).demonstration(task_id)
    assert actions == textworld.walkthrough(task_id)
    textworld.reset(task_id)
    for action in actions[:-1]:
        assert action in textworld.valid_actions()
        assert not textworld.step(action).done
    assert textworld.step(actions[-1]).success


def test_textworld_refuses_test_games(textworld: TextWorldEnv) -> None:
    """A test game has no demonstration."""
    with pytest.raises(EnvError, match="train split only"):
        textworld.demonstration(textworld.tasks("test")[0])


@pytest.fixture(scope="module")
def scienceworld(cache_dir: Path) -> Iterator[ScienceWorldEnv]:
    config = ScienceWorldConfig(
        task_names=["find-plant", "boil"], cache_dir=str(cache_dir / "scienceworld")
    )
    env = ScienceWorldEnv(config)
    yield env
    env.close()


def test_scienceworld_demonstration_is_the_gold_path_up_to_success(
    scienceworld: ScienceWorldEnv,
) -> None:
    """The gold path, cut after the completing step, solves a train variation on its last action."""
    task_id = next(t for t in scienceworld.tasks("train") if "/find-plant/" in t)
    actions = demonstrator(scienceworld).demonstration(task_id)
    gold = scienceworld.gold_actions(task_id)
    assert actions == gold[: len(actions)]
    assert replay(scienceworld, task_id, actions) == [False] * (len(actions) - 1) + [True]


def test_scienceworld_gold_paths_longer_than_the_horizon_are_refused(cache_dir: Path) -> None:
    """boil's gold path (36 steps to completion) cannot be demonstrated within 30 steps:
    EnvError."""
    config = ScienceWorldConfig(task_names=["boil"], cache_dir=str(cache_dir / "scienceworld"))
    env = ScienceWorldEnv(config)
    try:
        with pytest.raises(EnvError, match="without success"):
            env.demonstration(env.tasks("train")[0])
    finally:
        env.close()


def test_scienceworld_refuses_test_and_dev_variations(scienceworld: ScienceWorldEnv) -> None:
    """Only train variations are demonstrated."""
    for split in ("test", "dev"):
        with pytest.raises(EnvError, match="train split only"):
            scienceworld.demonstration(scienceworld.tasks(split)[0])


@pytest.fixture(scope="module")
def humaneval() -> HumanEvalEnv:
    return HumanEvalEnv(HumanEvalConfig(num_test=64))


def test_humaneval_demonstrations_solve_in_one_submission(humaneval: HumanEvalEnv) -> None:
    """The canonical solution as a complete function (no docstring) passes every test at once."""
    expert = demonstrator(humaneval)
    for task_id in humaneval.tasks("train")[:6]:
        (code,) = expert.demonstration(task_id)
        problem = humaneval.problem(task_id)
        assert (
            f"def {problem.entry_point}(" in code
            and '"""' not in code.split(f"def {problem.entry_point}(")[1]
        )
        assert replay(humaneval, task_id, [f"```python\n{code}```"]) == [True]


def test_every_humaneval_expert_answer_is_a_valid_program() -> None:
    """For all 164 problems the expert code parses and keeps the prompt's imports and helpers."""
    import ast

    from leafe.envs.humaneval.env import load_problems

    for problem in load_problems():
        code = expert_code(problem)
        ast.parse(code)
        for line in problem.prompt.splitlines():
            if line.startswith(("import ", "from ")):
                assert line in code


def test_humaneval_refuses_test_problems(humaneval: HumanEvalEnv) -> None:
    """A test problem has no demonstration; an unknown id is an EnvError too."""
    expert = HumanEvalExpert(humaneval)
    with pytest.raises(EnvError, match="train split only"):
        expert.demonstration(humaneval.tasks("test")[0])
    with pytest.raises(EnvError):
        expert.demonstration("humaneval/train/99999")


def test_registry_finds_experts_and_oracles(
    humaneval: HumanEvalEnv, textworld: TextWorldEnv
) -> None:
    """Every env has a Demonstrator; only the ORACLE_ENVS have a ReflectionOracle, the others say
    so."""
    sokoban = SokobanEnv(SMALL_SOKOBAN)
    for env in (sokoban, humaneval, textworld):
        assert isinstance(demonstrator(env), Demonstrator)
    assert ORACLE_ENVS == {"sokoban", "humaneval"}
    assert isinstance(reflection_oracle(sokoban), ReflectionOracle)
    assert isinstance(reflection_oracle(humaneval), ReflectionOracle)
    with pytest.raises(EnvError, match="no reflection oracle"):
        reflection_oracle(textworld)
