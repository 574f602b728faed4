"""ScienceWorld: package splits, score as reward, success at 100, failure ends, invalid commands
explained."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from leafe.envs.base import EnvError
from leafe.envs.scienceworld import EXCLUDED_TASKS, ScienceWorldConfig, ScienceWorldEnv

TASKS = ["find-plant"]


@pytest.fixture(scope="module")
def env(cache_dir: Path) -> Iterator[ScienceWorldEnv]:
    e = ScienceWorldEnv(
        ScienceWorldConfig(task_names=TASKS, cache_dir=str(cache_dir / "scienceworld"))
    )
    yield e
    e.close()


def test_splits_are_the_package_variation_lists_and_disjoint(env: ScienceWorldEnv) -> None:
    """train/dev/test hold different variations of each task; ids name split, task and variation."""
    splits = {s: set(env.tasks(s)) for s in ("train", "dev", "test")}
    variations = {s: {t.rsplit("/", 1)[1] for t in ids} for s, ids in splits.items()}
    assert all(variations.values())
    assert (
        not variations["train"] & variations["test"] and not variations["dev"] & variations["test"]
    )
    assert next(iter(splits["test"])).startswith("scienceworld/test/find-plant/")


def test_gold_path_succeeds_with_score_100(env: ScienceWorldEnv) -> None:
    """Following the simulator's gold actions reaches score 100: success, done, rewards sum to the
    gain."""
    task_id = env.tasks("test")[0]
    gold = env.gold_actions(task_id)
    start = env.reset(task_id)
    assert "plant" in start.task and start.observation.startswith("This room is called")
    transitions = [env.step(a) for a in gold]
    last = transitions[-1]
    assert last.success and last.done and last.score == 100.0
    assert not any(t.done for t in transitions[:-1])
    first_score = transitions[0].score - transitions[0].reward
    assert sum(t.reward for t in transitions) == pytest.approx(100.0 - first_score)


def test_focusing_on_the_wrong_thing_fails_irreversibly(env: ScienceWorldEnv) -> None:
    """A wrong 'focus on' drops the score below 0: done, no success, feedback says so."""
    env.reset(env.tasks("test")[0])
    t = env.step("focus on air")
    assert t.done and not t.success and t.score < 0 and "cannot be undone" in t.feedback


def test_unknown_commands_are_invalid_with_templates(env: ScienceWorldEnv) -> None:
    """Gibberish is invalid (valid=False), and the feedback lists the action templates."""
    env.reset(env.tasks("train")[0])
    t = env.step("dance wildly")
    assert not t.valid and not t.done and t.reward == 0.0
    assert t.feedback.startswith("invalid action: 'dance wildly'") and "open OBJ" in t.feedback
    assert not env.step("reset task").valid
    assert not env.step("   ").valid


def test_valid_actions_are_sorted_combinations(env: ScienceWorldEnv) -> None:
    """valid_actions lists concrete commands of the current state, including 'look around'."""
    env.reset(env.tasks("train")[0])
    actions = env.valid_actions()
    assert "look around" in actions and actions == sorted(actions) and "reset task" not in actions


def test_horizon_ends_the_episode(cache_dir: Path) -> None:
    """After max_steps commands the episode is done."""
    short = ScienceWorldEnv(
        ScienceWorldConfig(task_names=TASKS, max_steps=2, cache_dir=str(cache_dir / "scienceworld"))
    )
    try:
        short.reset(short.tasks("train")[0])
        assert not short.step("look around").done
        t = short.step("inventory")
        assert t.done and not t.success and "Step limit" in t.feedback
    finally:
        short.close()


def test_bad_ids_and_excluded_tasks_raise(env: ScienceWorldEnv) -> None:
    """Malformed ids, variations of another split and unknown tasks are EnvErrors."""
    train_var = env.tasks("train")[0].rsplit("/", 1)[1]
    for bad in [
        "scienceworld/test/find-plant",
        f"scienceworld/test/find-plant/{train_var}",
        "sokoban/test/0",
    ]:
        with pytest.raises(EnvError):
            env.reset(bad)
    with pytest.raises(EnvError):
        ScienceWorldEnv(ScienceWorldConfig(task_names=["no-such-task"])).task_names()


def test_excluded_tasks_are_kept_out_and_refused(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    """A task listed in EXCLUDED_TASKS is left out of the catalogue, and asking for it by name is an
    EnvError that gives the reason (today the list is empty: every task replays exactly)."""
    monkeypatch.setitem(EXCLUDED_TASKS, "find-plant", "replay diverges (test)")
    with pytest.raises(EnvError, match=r"replay diverges \(test\)"):
        ScienceWorldEnv(ScienceWorldConfig(task_names=["find-plant"])).task_names()
    everything = ScienceWorldEnv(ScienceWorldConfig(cache_dir=str(cache_dir / "scienceworld")))
    try:
        names = everything.task_names()
    finally:
        everything.close()
    assert "find-plant" not in names and len(names) == 29


def test_close_stops_the_jvm(cache_dir: Path) -> None:
    """close() leaves no Java process behind, and the env can start a new one afterwards."""
    e = ScienceWorldEnv(
        ScienceWorldConfig(task_names=TASKS, cache_dir=str(cache_dir / "scienceworld"))
    )
    e.reset(e.tasks("train")[0])
    backend = e._backend
    assert backend is not None
    e.close()
    assert backend.proc.poll() is not None
    assert e.reset(e.tasks("train")[0]).observation
    e.close()
