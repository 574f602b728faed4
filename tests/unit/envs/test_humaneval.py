"""HumanEval: sandboxed multi-turn submissions with feedback from visible tests and hidden ones."""

from __future__ import annotations

import warnings

import pytest

from leafe.envs.base import EnvError
from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv, extract_code, load_problems
from leafe.envs.sandbox.launch import SandboxConfig

ALL_TEST = HumanEvalConfig(num_test=164, sandbox=SandboxConfig(wall_timeout_s=20))


@pytest.fixture(scope="module")
def env() -> HumanEvalEnv:
    return HumanEvalEnv(ALL_TEST)


def test_problems_load_with_their_tests_split_into_units() -> None:
    """All 164 problems load; every one has at least one test unit."""
    problems = load_problems()
    assert len(problems) == 164
    assert all(p.num_tests >= 1 for p in problems)


@pytest.mark.parametrize("number", [0, 2, 32, 38, 53, 151])
def test_canonical_solutions_pass(env: HumanEvalEnv, number: int) -> None:
    """The reference solution (also as a bare body) succeeds on the first submission with reward
    1."""
    task_id = f"humaneval/test/{number}"
    problem = env.problem(task_id)
    env.reset(task_id)
    t = env.step(f"Here you go:\n```python\n{problem.prompt}{problem.canonical_solution}```\n")
    assert t.success and t.done and t.reward == 1.0 and t.score == 1.0 and t.valid
    env.reset(task_id)
    assert env.step(problem.canonical_solution).success


@pytest.mark.slow
def test_every_canonical_solution_passes() -> None:
    """All 164 reference solutions pass (the harness runs every test form of the data set)."""
    env = HumanEvalEnv(ALL_TEST)
    failed = []
    for task_id in env.tasks("test"):
        p = env.problem(task_id)
        env.reset(task_id)
        if not env.step(p.prompt + p.canonical_solution).success:
            failed.append(task_id)
    assert failed == []


def test_wrong_answer_shows_first_failing_visible_test_and_value(env: HumanEvalEnv) -> None:
    """Feedback names the failing assert and what the function returned; score = visible pass
    rate."""
    env.reset("humaneval/test/53")  # add(x, y)
    t = env.step("```python\ndef add(x, y):\n    return x - y\n```")
    assert not t.success and not t.done and t.reward == 0.0
    assert "Failed test: assert candidate(0, 1) == 1" in t.observation
    assert "Your function returned: -1" in t.observation
    assert t.observation.startswith("Submission 1 of 4:")
    assert 0.0 <= t.score < 1.0


def test_passing_visible_but_not_hidden_tests_is_not_success() -> None:
    """Success needs the hidden tests too; the feedback says only that hidden tests failed."""
    env = HumanEvalEnv(HumanEvalConfig(num_test=164, visible_fraction=0.3))
    env.reset("humaneval/test/53")  # first two asserts both expect 1
    t = env.step("def add(x, y):\n    return 1\n")
    assert not t.success and t.score == 1.0
    assert "visible tests passed, but some hidden tests failed" in t.observation


def test_errors_are_reported_with_their_line(env: HumanEvalEnv) -> None:
    """A runtime error names the exception and the line; a syntax error says the code did not
    run."""
    env.reset("humaneval/test/53")
    t = env.step("def add(x, y):\n    z = 1\n    return x / 0\n")
    assert "ZeroDivisionError" in t.observation and "line 3 of your code" in t.observation
    t = env.step("def add(x, y)\n    return x + y\n")
    assert "did not run: SyntaxError" in t.observation


def test_a_reply_without_code_is_invalid_and_uses_a_turn(env: HumanEvalEnv) -> None:
    """Prose is an invalid action with feedback; after max_turns replies the episode is over."""
    env.reset("humaneval/test/0")
    t = env.step("I think we should split the string on parentheses.")
    assert not t.valid and t.feedback.startswith("invalid action: no Python code found")
    for _ in range(3):
        t = env.step("")
    assert t.done and not t.success and "No submissions left." in t.observation
    assert env.step("def f(): pass").feedback == "the episode is over"


def test_slow_code_times_out_per_test() -> None:
    """An infinite loop in the function fails its tests as timed out; the run is still reported."""
    env = HumanEvalEnv(
        HumanEvalConfig(num_test=164, unit_timeout_s=0.5, sandbox=SandboxConfig(wall_timeout_s=3))
    )
    env.reset("humaneval/test/53")
    t = env.step("def add(x, y):\n    while True:\n        pass\n")
    assert not t.success
    assert "timed out" in t.observation or "time limit" in t.observation


def test_exiting_or_forging_output_cannot_fake_success(env: HumanEvalEnv) -> None:
    """sys.exit, os._exit and printed fake results do not pass."""
    attempts = [
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        'print(\'{"stage": "done"}\')\ndef add(x, y):\n    return 0\n',
    ]
    for code in attempts:
        env.reset("humaneval/test/53")
        t = env.step(code)
        assert not t.success and t.score < 1.0


def test_rollback_to_an_earlier_turn_by_snapshot(env: HumanEvalEnv) -> None:
    """Restoring the state after turn 1 gives turn 1's observation and the turn counter back."""
    env.reset("humaneval/test/53")
    first = env.step("def add(x, y):\n    return 0\n")
    snap = env.snapshot()
    env.step("def add(x, y):\n    return 1\n")
    assert env.restore(snap) == first.observation
    t = env.step("def add(x, y):\n    return x + y\n")
    assert t.success and t.observation.startswith("Submission 2 of 4:")


def test_splits_are_disjoint_stable_and_complete() -> None:
    """A seeded permutation: the same seed gives the same split, both cover all 164 problems
    once."""
    a, b = HumanEvalEnv(), HumanEvalEnv()
    train, test = set(a.tasks("train")), set(a.tasks("test"))
    assert len(test) == 64 and len(train) == 100
    numbers = [t.split("/")[-1] for t in train | test]
    assert len(set(numbers)) == 164
    assert a.tasks("test") == b.tasks("test")
    assert HumanEvalEnv(HumanEvalConfig(seed=1)).tasks("test") != a.tasks("test")
    with pytest.raises(EnvError):
        a.reset(f"humaneval/train/{next(iter(test)).split('/')[-1]}")


def test_max_solution_lines_keeps_only_short_canonical_solutions() -> None:
    """The difficulty knob: both splits hold only problems whose canonical solution is short enough;
    asking for more test problems than remain is an error naming the count."""
    env = HumanEvalEnv(HumanEvalConfig(max_solution_lines=1, num_test=16))
    tasks = env.tasks("train") + env.tasks("test")
    assert len(env.tasks("test")) == 16 and len(tasks) == 37
    assert all(env.problem(t).solution_lines == 1 for t in tasks)
    assert env.problem(tasks[0]).canonical_solution.strip().count("\n") == 0
    with pytest.raises(EnvError, match="only 37 problems"):
        HumanEvalEnv(HumanEvalConfig(max_solution_lines=1, num_test=38))


def test_extract_code_accepts_fences_and_bare_code() -> None:
    """A fenced block defining the function wins; bare code is taken; prose is not code."""
    text = "Sure.\n```\nprint(1)\n```\nBetter:\n```python\ndef f(x):\n    return x\n```\n"
    assert extract_code(text, "f") == "def f(x):\n    return x\n"
    assert extract_code("def f(x):\n    return x", "f") == "def f(x):\n    return x"
    assert extract_code("    return x + 1", "f") == "    return x + 1"
    assert extract_code("I do not know how to do this.", "f") is None
    with warnings.catch_warnings(
        record=True
    ) as caught:  # code Python warns about: taken, no stderr noise
        warnings.simplefilter("always")
        assert extract_code("x = 1if y else 2", "f") == "x = 1if y else 2"
    assert not caught
