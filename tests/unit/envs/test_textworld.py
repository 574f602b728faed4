"""TextWorld cooking: seeded offline games, admissible commands, won/lost, safe concurrent
generation."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from leafe.envs.base import EnvError
from leafe.envs.textworld.env import TextWorldConfig, TextWorldEnv, clean_observation
from leafe.envs.textworld.generator import CookingSpec, ensure_game, game_seed
from leafe.protocol.paths import publish_dir

TASK = "textworld-cooking/test/0"


@pytest.fixture(scope="module")
def env(cache_dir: Path) -> Iterator[TextWorldEnv]:
    e = TextWorldEnv(TextWorldConfig(cache_dir=str(cache_dir / "textworld")))
    yield e
    e.close()


def test_walkthrough_wins_with_the_game_points_as_rewards(env: TextWorldEnv) -> None:
    """The generator's walkthrough wins: success and done on the last step, rewards sum to the
    score."""
    reset = env.reset(TASK)
    assert "cook" in reset.task.lower() and "TEXT" not in reset.observation  # banner stripped
    walkthrough = env.walkthrough(TASK)
    transitions = [env.step(a) for a in walkthrough]
    assert transitions[-1].done and transitions[-1].success
    assert not any(t.done for t in transitions[:-1])
    assert sum(t.reward for t in transitions) == transitions[-1].score > 0


def test_inadmissible_commands_are_invalid_and_change_nothing(env: TextWorldEnv) -> None:
    """A command outside the admissible list gets feedback listing them; the state is unchanged."""
    obs = env.reset(TASK).observation
    valid = env.valid_actions()
    t = env.step("dance wildly")
    assert not t.valid and t.observation == obs and t.reward == 0.0
    assert t.feedback.startswith("invalid action: 'dance wildly'; valid actions: ")
    assert all(a in t.feedback for a in valid)
    assert env.valid_actions() == valid


def test_commands_match_up_to_case_and_spacing(env: TextWorldEnv) -> None:
    """'  LOOK ' runs 'look'."""
    env.reset(TASK)
    assert env.step("  LOOK ").valid


def test_horizon_ends_the_episode(cache_dir: Path) -> None:
    """After max_steps commands the episode is done without success."""
    short = TextWorldEnv(TextWorldConfig(max_steps=2, cache_dir=str(cache_dir / "textworld")))
    try:
        short.reset(TASK)
        assert not short.step("look").done
        t = short.step("inventory")
        assert t.done and not t.success and "Step limit" in t.feedback
    finally:
        short.close()


def test_task_ids_and_splits() -> None:
    """Splits use different seed streams; bad ids are EnvErrors."""
    env = TextWorldEnv(TextWorldConfig(num_train=30, num_test=30))
    train = {game_seed(0, "train", i) for i in range(30)}
    test = {game_seed(0, "test", i) for i in range(30)}
    assert not train & test
    assert len(env.tasks("train")) == 30
    for bad in ["textworld-cooking/dev/0", "textworld-cooking/test/30", "textworld/test/0"]:
        with pytest.raises(EnvError):
            env.game_path(bad)


def test_clean_observation_drops_prompt_and_blank_runs() -> None:
    """The trailing '>' status line goes, blank-line runs shrink."""
    raw = "\n\nYou see a fridge.\n\n\n\nIt is closed.\n\n>      -= Kitchen =-0/3"
    assert clean_observation(raw) == "You see a fridge.\n\nIt is closed."


def test_publish_dir_keeps_the_first_copy(tmp_path: Path) -> None:
    """Of two finished copies, the first rename wins and the second is dropped whole."""
    final = tmp_path / "game"
    for name in ("a", "b"):
        d = tmp_path / f".tmp-{name}"
        d.mkdir()
        (d / "game.z8").write_text(name)
    assert publish_dir(tmp_path / ".tmp-a", final)
    assert not publish_dir(tmp_path / ".tmp-b", final)
    assert (final / "game.z8").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["game"]


def test_threads_generating_different_games_all_succeed(tmp_path: Path) -> None:
    """TextWorld's generator shares module state; without the process lock, threads generating at
    once failed with ``pop from empty list`` or logic-file parse errors (envs run in threads)."""
    with ThreadPoolExecutor(3) as pool:
        games = list(
            pool.map(lambda i: ensure_game(CookingSpec(), 0, "train", 20 + i, tmp_path), range(3))
        )
    assert len(set(games)) == 3 and all(
        g.is_file() and g.with_suffix(".json").is_file() for g in games
    )


@pytest.mark.slow
def test_concurrent_generation_of_the_same_game(tmp_path: Path) -> None:
    """Two processes generating the same game both end with the same complete file; no temp dirs
    remain."""
    code = (
        "import sys; from pathlib import Path; from leafe.envs.textworld.generator import "
        "CookingSpec, ensure_game; "
        "print(ensure_game(CookingSpec(), 0, 'train', 7, Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=300)[0].decode().strip().splitlines()[-1] for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    game = Path(paths.pop())
    assert game.is_file() and game.with_suffix(".json").is_file()
    assert [p.name for p in game.parent.parent.iterdir()] == [game.parent.name]


@pytest.mark.slow
def test_train_and_test_games_differ(cache_dir: Path) -> None:
    """The first games of each split are different games."""
    env = TextWorldEnv(TextWorldConfig(cache_dir=str(cache_dir / "textworld")))
    try:
        seen = {}
        for task_id in [
            "textworld-cooking/train/0",
            "textworld-cooking/train/1",
            TASK,
            "textworld-cooking/test/1",
        ]:
            seen[task_id] = (env.reset(task_id).observation, tuple(env.walkthrough(task_id)))
        assert len(set(seen.values())) == 4
    finally:
        env.close()
