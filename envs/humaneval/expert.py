"""The HumanEval expert: demonstrations from the canonical solutions, and a reflection oracle from
feedback.

Kept apart from ``envs/humaneval/env.py`` and built on its public surface only
(``HumanEvalEnv.problem``, ``Problem``); ``leafe.envs.registry.demonstrator`` /
``reflection_oracle`` wrap a ``HumanEvalEnv`` in :class:`HumanEvalExpert`.

- Demonstration: one submission, the complete function as the policy must answer it (the env's
  instructions): the problem's prompt code with the canonical body, *without the entry point's
  docstring* (the agent already sees it in the observation; dropping it halves the answer: median 69
  instead of 178 SmolLM2 tokens, at most 336, so every answer fits the rollout's 384-token cap,
  which 7 problems with the docstring would exceed). Imports and helper functions of the prompt stay
  verbatim. The env action is the bare code; ``actors/demo.py`` writes it in a fenced ``python``
  block.
- Oracle (an ablation of Stage 1): tau is the first submission that did not pass, e its first
  failing *visible* test and what went wrong, read from that step's observation (the env's feedback
  to the agent), never from the hidden tests.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from leafe.envs.base import EnvError, OracleReflection, require_train_split
from leafe.envs.humaneval.env import HumanEvalEnv, Problem
from leafe.protocol.prompt import HistoryEntry

__all__ = ["HumanEvalExpert", "expert_code"]

_PASSED = "All tests passed."
_LINE = re.compile(r"^(Failed test|Error|Your function returned): (.*)$", re.MULTILINE)
_DETAIL_CHARS = 160


def expert_code(problem: Problem) -> str:
    """The canonical solution as a complete function: the prompt's code minus the entry point's
    docstring."""
    code = problem.prompt + problem.canonical_solution
    tree = ast.parse(code)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == problem.entry_point]
    if len(fns) != 1:
        raise EnvError(
            f"HumanEval/{problem.number}: expected one def {problem.entry_point} in the prompt"
        )
    lines = code.splitlines()
    first = fns[0].body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and len(fns[0].body) > 1
    ):
        assert first.end_lineno is not None
        del lines[first.lineno - 1 : first.end_lineno]
    return "\n".join(lines).strip("\n") + "\n"


class HumanEvalExpert:
    """Demonstrations and oracle reflections for one :class:`HumanEvalEnv` (see the module
    docstring)."""

    def __init__(self, env: HumanEvalEnv) -> None:
        self.env = env

    def demonstration(self, task_id: str) -> list[str]:
        """One submission: the canonical solution of train problem ``task_id``."""
        problem = self.env.problem(task_id)  # validates the id and its split membership
        require_train_split(task_id, task_id.split("/")[1])
        return [expert_code(problem)]

    def oracle_reflection(self, task_id: str, history: Sequence[HistoryEntry]) -> OracleReflection:
        """The first submission that did not pass, and its first failing visible test as the fix to
        make."""
        if not history:
            raise ValueError("an oracle reflection needs a history of at least one step")
        self.env.problem(task_id)
        for t, entry in enumerate(history):
            if _PASSED not in entry.observation:
                return OracleReflection(tau=t, experience=_experience(t, entry))
        return OracleReflection(tau=len(history) - 1, experience="")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 3] + "..."


def _experience(t: int, entry: HistoryEntry) -> str:
    text = entry.observation
    found = dict((k, v) for k, v in _LINE.findall(text))
    if "Failed test" in found:
        detail = found.get("Error") or (
            f"your function returned {found['Your function returned']}"
            if "Your function returned" in found
            else ""
        )
        what = f"failed the visible test `{_short(found['Failed test'])}`"
        what += f" ({_short(detail)})" if detail else ""
        return (
            f"Submission {t} {what}. Fix the function so that this test passes and submit it again."
        )
    if "did not run:" in text:
        error = text.split("did not run:", 1)[1].split("\n", 1)[0]
        return (
            f"Submission {t} did not run ({_short(error)}). "
            "Fix that error and submit the function again."
        )
    if "no Python code found" in text or "invalid action" in entry.feedback:
        return (
            f"Submission {t} held no code. "
            "Reply with the complete function in one ```python code block."
        )
    if "hidden tests failed" in text:
        return (
            f"Submission {t} passed the visible tests but failed hidden ones. Handle the edge "
            "cases the docstring's examples do not show (empty inputs, negatives, ties) and submit "
            "it again."
        )
    return (
        f"Submission {t} did not pass: {_short(entry.feedback or text)}. "
        "Fix it and submit it again."
    )
