"""Test harness that runs *inside* the sandbox for one HumanEval submission (stdlib only).

``envs.humaneval`` writes this file as the sandbox's ``main.py`` followed by one line,
``main(<payload json>)``, and sends a random nonce on stdin. The harness reads the nonce, closes stdin,
executes the prompt (imports and helpers), the submission and the test module's preamble, then runs
every test unit (an ``assert``, or a loop holding asserts, from ``check``'s body; other statements are
setup) with a per-unit alarm and a fixed random seed, and prints one ``<nonce> <json>`` line per unit
to the real stdout. The code's own prints go to a bounded buffer, so they cannot flood or forge
results. Not meant to be imported by LEAFE itself.
"""

from __future__ import annotations

import io
import json
import random
import signal
import sys
import traceback
from typing import Any

__all__ = ["main"]

_REPR_LIMIT = 200


class _UnitTimeout(BaseException):
    """Raised by the alarm; BaseException so a bare ``except Exception`` in the code cannot swallow it."""


class _BoundedSink(io.StringIO):
    def write(self, s: str) -> int:
        if self.tell() < 10_000:
            super().write(s[:10_000])
        return len(s)


def _on_alarm(signum: int, frame: Any) -> None:
    raise _UnitTimeout


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def _error(exc: BaseException, filename: str) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    if isinstance(exc, _UnitTimeout):
        return "timed out (infinite loop or far too slow)"
    line = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == filename:
            line = f" (line {frame.lineno} of your code)"
    return f"{type(exc).__name__}: {exc}{line}"[:500]


def _run(code: str, filename: str, ns: dict, timeout: float) -> None:
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(compile(code, filename, "exec"), ns)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _emit(out: Any, nonce: str, record: dict) -> None:
    out.write(f"{nonce} {json.dumps(record)}\n")
    out.flush()


def main(payload_json: str) -> None:
    """Run one submission against its test units (see the module docstring)."""
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    payload = json.loads(payload_json)
    out = sys.__stdout__
    signal.signal(signal.SIGALRM, _on_alarm)
    sys.stdout = sys.stderr = _BoundedSink()
    timeout = float(payload["unit_timeout_s"])
    ns: dict = {"__name__": "__submission__"}
    for code, filename in ((payload["prompt"], "<prompt>"), (payload["submission"], "<submission>")):
        try:
            _run(code, filename, ns, timeout)
        except BaseException as e:  # any failure of the code is the result we report
            _emit(out, nonce, {"stage": "load", "error": _error(e, "<submission>")})
            return
    try:
        _run(payload["preamble"], "<tests>", ns, timeout)
        ns["candidate"] = ns[payload["entry_point"]]
    except BaseException as e:  # a broken preamble or a missing function fails every test
        _emit(out, nonce, {"stage": "load", "error": _error(e, "<submission>")})
        return
    for i, unit in enumerate(payload["units"]):
        random.seed(i)
        record: dict = {"stage": "unit", "i": i, "test": unit["test"], "ok": True}
        try:
            _run(unit["src"], "<tests>", ns, timeout)
        except BaseException as e:  # a failing test is data, not a crash of the harness
            record["ok"] = False
            record["error"] = (
                "" if isinstance(e, AssertionError) and not str(e) else _error(e, "<submission>")
            )
            if isinstance(e, AssertionError) and unit.get("left"):
                record["got"] = _left_value(unit["left"], ns, timeout)
        _emit(out, nonce, record)
    _emit(out, nonce, {"stage": "done"})


def _left_value(left: str, ns: dict, timeout: float) -> str | None:
    """Re-evaluate the left side of a failed ``assert a == b`` to show what the function returned."""
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return _short(eval(left, ns))
    except BaseException as e:  # showing the value is best-effort; the failure itself is already recorded
        return f"<raised {type(e).__name__}: {e}>"[:_REPR_LIMIT]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
