"""The submission's side of judging one HumanEval submission (stdlib only): load it, answer calls
with values.

``leafe.envs.humaneval.judge`` runs this file in the sandbox as ``main.py``, followed by one line
``serve(<program json>)`` holding the problem's prompt (its imports and helpers), the submission and
the entry point. Nothing else reaches this process: no test, no expected value, no secret, no
verdict channel. It loads the code (each part under an alarm), answers ``{"ready": true}`` or
``{"load_error": ...}``, then for each request line ``{"args", "kwargs", "unit", "timeout"}`` on
stdin calls the function under an alarm (reseeding ``random`` with the unit's index when the unit
changes, as the tests expect) and answers one line on stdout: ``{"value": <wire value>}``,
``{"error": "<exception> (line n of your code)"}`` or ``{"timeout": true}``.

The code's own prints go to a bounded sink and file descriptor 1 is pointed at stderr, so output
cannot garble the replies by accident. A submission that writes replies itself gains nothing: a
reply is only ever a value, which the judge compares with what the test expects.

:func:`to_wire` and :func:`from_wire` are the value codec of both sides (the judge imports them):
JSON with tagged containers, so a tuple stays a tuple and a set a set, and :func:`from_wire`
rebuilds only exact builtin types (no object of the submission's can reach the judge's comparisons).
"""

import io
import json
import os
import random
import signal
import sys
import traceback

MAX_DEPTH = 32
"""Deepest nesting of a value on the wire."""
MAX_SAME_HASH = 16
"""Most distinct members (or keys) of one set or dict that may share a hash. Distinct values with
one hash make every insert compare with all earlier ones: 40k of them (1 MiB of multiples of 2**61 -
1) held the GIL for 15-30 s while the judge rebuilt them. Real values collide rarely (-1 and -2); 16
is generous."""
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes")
_PLAIN = "return int, float, str, bool, bytes, None, or lists, tuples, dicts and sets of those"


class _UnitTimeout(BaseException):
    """Raised by the alarm; BaseException so a bare ``except Exception`` in the code cannot swallow
    it."""


class _BoundedSink(io.StringIO):
    def write(self, s: str) -> int:
        if self.tell() < 10_000:
            super().write(s[:10_000])
        return len(s)


def to_wire(value, depth=0):
    """``value`` as JSON-ready data; TypeError for anything that is not plain data."""
    if depth > MAX_DEPTH:
        raise TypeError(f"a value nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):  # subclasses (IntEnum, ...) travel as their base type
        return int(int.__repr__(value))
    if isinstance(value, float):
        return float(float.__repr__(value))
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list):
        return [to_wire(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {
            "dict": [[to_wire(k, depth + 1), to_wire(v, depth + 1)] for k, v in dict.items(value)]
        }
    for container, tag in ((tuple, "tuple"), (frozenset, "frozenset"), (set, "set")):
        if isinstance(value, container):
            return {tag: [to_wire(v, depth + 1) for v in value]}
    raise TypeError(f"a value of type {type(value).__name__}, which is not plain data")


def from_wire(data, depth=0):
    """Rebuild a value from :func:`to_wire`'s form with exact builtin types; ValueError for anything
    else."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [from_wire(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1 or next(iter(data)) not in _TAGS:
        raise ValueError(f"not a wire value: a {kind.__name__}")
    tag, body = next(iter(data.items()))
    if tag == "bytes":
        if type(body) is not str:
            raise ValueError("bytes must be hex text")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"{tag} must hold a list")
    items = [from_wire(v, depth + 1) for v in body]
    try:
        if tag == "dict":
            if not all(type(p) is list and len(p) == 2 for p in items):
                raise ValueError("dict items must be [key, value] pairs")
            _few_collisions((k for k, _ in items), tag)
            return {k: v for k, v in items}
        if tag != "tuple":
            _few_collisions(items, tag)
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    except TypeError as e:  # an unhashable key or member
        raise ValueError(f"bad {tag}: {e}") from None


def _few_collisions(members, tag):
    """ValueError when more than :data:`MAX_SAME_HASH` distinct ``members`` share a hash, checked
    before the set or dict is built: at most that many comparisons per member here, so the cost
    stays linear.

    The groups are keyed by the hash itself, an int whose own hash is itself: they cannot
    collide."""
    groups: dict[int, list] = {}
    for member in members:
        seen = groups.setdefault(hash(member), [])
        if any(member == other for other in seen):
            continue  # a repeat (or an equal value of another type: 1 and 1.0) adds nothing
        if len(seen) == MAX_SAME_HASH:
            raise ValueError(
                f"a {tag} whose members share one hash more than {MAX_SAME_HASH} times"
            )
        seen.append(member)


def _on_alarm(signum, frame):
    raise _UnitTimeout


def _error(exc):
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    line = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == "<submission>":
            line = f" (line {frame.lineno} of your code)"
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # an exception whose str() fails still names its type
        text = type(exc).__name__
    return (text + line)[:500]


def _timed(fn, timeout):
    signal.setitimer(signal.ITIMER_REAL, max(timeout, 0.001))
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _load(program, ns):
    """None when the prompt and submission ran and define the entry point, else what went wrong."""
    for code, filename in (
        (program["prompt"], "<prompt>"),
        (program["submission"], "<submission>"),
    ):
        try:
            _timed(lambda c=code, f=filename: exec(compile(c, f, "exec"), ns), program["timeout"])
        except _UnitTimeout:
            return "timed out while loading (infinite loop at the top level?)"
        except BaseException as e:  # any failure of the code is the answer we report
            return _error(e)
    if not callable(ns.get(program["entry_point"])):
        return f"your code does not define the function {program['entry_point']}()"
    return None


def _call(fn, request):
    try:
        args = from_wire(request["args"])
        kwargs = {k: from_wire(v) for k, v in request["kwargs"].items()}
        value = _timed(lambda: fn(*args, **kwargs), request["timeout"])
    except _UnitTimeout:
        return {"timeout": True}
    except BaseException as e:  # the function's failure is the answer
        return {"error": _error(e)}
    try:
        return {"value": to_wire(value)}
    except (TypeError, ValueError, RecursionError) as e:
        return {"error": f"your function returned {e}; {_PLAIN}"}


def serve(program_json):
    """Load the program, then answer call requests until stdin closes (see the module docstring)."""
    program = json.loads(program_json)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)
    sys.stdout = sys.stderr = _BoundedSink()
    signal.signal(signal.SIGALRM, _on_alarm)

    def reply(message):
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    ns = {"__name__": "__submission__"}
    error = _load(program, ns)
    reply({"load_error": error} if error else {"ready": True})
    if error:
        return
    fn, unit = ns[program["entry_point"]], None
    for line in requests:
        request = json.loads(line)
        if request["unit"] != unit:
            unit = request["unit"]
            random.seed(unit)
        reply(_call(fn, request))
