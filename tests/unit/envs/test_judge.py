"""The judge: values cross the process boundary as plain data only; timeouts, crashes and
determinism.

The codec tests pin what may reach a comparison in the judge (exact builtin types, bounded depth);
the judging tests run real submissions of ``HumanEval/53`` (``add``) and ``HumanEval/8``
(``sum_product``, which returns a tuple) through the sandbox.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest

from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv
from leafe.envs.humaneval.harness import MAX_DEPTH, from_wire, to_wire
from leafe.envs.humaneval.judge import judge
from leafe.envs.sandbox.launch import SandboxConfig

PLAIN = [
    None,
    True,
    -3,
    10**40,
    2.5,
    "ünï\n",
    b"\x00\xff",
    [1, [2, (3, "x")]],
    (1,),
    (),
    {1, 2},
    frozenset({"a"}),
    {"k": [1], 2: (3,), (4, 5): None},
]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_round_trip_with_their_exact_types(value: object) -> None:
    """A tuple stays a tuple, a set a set, bytes bytes: equal value and equal type all the way
    down."""
    back = from_wire(to_wire(value))
    assert back == value and repr(back) == repr(value)


def test_nan_and_infinities_survive() -> None:
    """Floats that JSON has no literal for still cross (the tests compare them with math.isclose and
    such)."""
    back = from_wire(to_wire([math.inf, -math.inf, math.nan]))
    assert back[:2] == [math.inf, -math.inf] and math.isnan(back[2])


def test_subclasses_cross_as_their_base_type() -> None:
    """An int subclass with an always-true __eq__ arrives as a plain int, so it compares
    honestly."""

    class Liar(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    back = from_wire(to_wire(Liar(-1)))
    assert type(back) is int and back == -1 and back != 5


@pytest.mark.parametrize(
    "wire",
    [
        {"object": []},
        {"tuple": [1], "set": [2]},
        {"set": [[1]]},  # unhashable member
        {"dict": [[1]]},
        {"bytes": 3},
        {"tuple": "ab"},
    ],
    ids=repr,
)
def test_anything_but_the_tagged_forms_is_refused(wire: object) -> None:
    """Unknown tags, several tags, unhashable members, malformed pairs: refused, never rebuilt."""
    with pytest.raises(ValueError):
        from_wire(wire)


def test_nesting_is_bounded() -> None:
    """Values nested past MAX_DEPTH are refused on both sides."""
    deep: list = []
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(TypeError):
        to_wire(deep)
    wire: object = []
    for _ in range(MAX_DEPTH + 2):
        wire = [wire]
    with pytest.raises(ValueError):
        from_wire(wire)


def test_objects_are_not_plain_data() -> None:
    """Functions, generators and arbitrary objects have no wire form."""
    for value in (len, (i for i in range(3)), object()):
        with pytest.raises(TypeError, match="not plain data"):
            to_wire(value)


@pytest.fixture(scope="module")
def env() -> HumanEvalEnv:
    return HumanEvalEnv(
        HumanEvalConfig(num_test=164, unit_timeout_s=0.5, sandbox=SandboxConfig(wall_timeout_s=8))
    )


def test_a_list_is_not_a_tuple(env: HumanEvalEnv) -> None:
    """sum_product must return a tuple: the same numbers in a list fail, with the list shown."""
    problem = env.problem("humaneval/test/8")
    verdict = judge(
        problem,
        "def sum_product(numbers):\n    import math\n    return [sum(numbers), "
        "math.prod(numbers)]\n",
        unit_timeout_s=1.0,
        sandbox=SandboxConfig(),
    )
    first = min(i for i, u in enumerate(problem.units) if u["test"])
    assert not verdict.units[first].ok and verdict.units[first].got == "[0, 1]"


def test_the_same_submission_gets_the_same_verdict(env: HumanEvalEnv) -> None:
    """A submission that draws random numbers is judged identically twice (seeded per unit on both
    sides)."""
    code = "import random\ndef add(x, y):\n    return x + y if random.random() < 0.97 else -1\n"
    observations = []
    for _ in range(2):
        env.reset("humaneval/test/53")
        t = env.step(code)
        observations.append((t.observation, t.score, t.success))
    assert observations[0] == observations[1]


def test_a_function_that_swallows_its_alarm_is_killed_and_fails(env: HumanEvalEnv) -> None:
    """Catching the sandbox's own timeout does not help: the judge gives up after the unit's time
    plus a grace period, kills the process, and the unit fails as timed out."""
    env.reset("humaneval/test/53")
    code = (
        "def add(x, y):\n    while True:\n        try:\n            while True:\n                "
        "pass\n"
        "        except BaseException:\n            pass\n"
    )
    t = env.step(code)
    assert not t.success and t.score == 0.0
    assert "timed out" in t.observation
    assert env.last_run is not None and env.last_run.wall_s < 8


def test_a_crash_of_the_process_fails_the_unit_with_its_cause(env: HumanEvalEnv) -> None:
    """A function that kills its own process fails the test, and the feedback says how it ended."""
    env.reset("humaneval/test/53")
    t = env.step(
        "def add(x, y):\n    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert not t.success and t.score == 0.0
    assert "Error: your code's process ended (exit code -9)" in t.observation


def test_test_code_that_catches_exceptions_cannot_turn_a_failure_into_a_pass() -> None:
    """The judge's call failures are not Exceptions: a test's ``except Exception`` cannot swallow
    them."""
    problem = HumanEvalEnv(HumanEvalConfig(num_test=164)).problem("humaneval/test/53")
    lenient = [
        {
            "src": "try:\n    candidate(1, 2)\nexcept Exception:\n    pass",
            "test": True,
            "left": None,
        }
    ]
    verdict = judge(
        msgspec.structs.replace(problem, units=lenient),
        "def add(x, y):\n    raise ValueError('no')\n",
        unit_timeout_s=1.0,
        sandbox=SandboxConfig(),
    )
    assert verdict.units[0].ok is False and "ValueError: no" in verdict.units[0].error


def test_judging_in_threads_gives_the_sequential_verdicts_and_leaves_global_random_alone() -> None:
    """Actors judge in worker threads: concurrent judging of random-driven tests (HumanEval/38, 53)
    gives the same feedback as one at a time, and the process's global ``random`` stream is
    untouched."""
    config = HumanEvalConfig(num_test=164)
    jobs = [
        ("humaneval/test/53", "def add(x, y):\n    return x + y if x % 7 else 0\n"),
        ("humaneval/test/38", "def decode_cyclic(s):\n    return s[::-1]\n"),
    ] * 2

    def run(job: tuple[str, str]) -> str:
        env = HumanEvalEnv(config)
        env.reset(job[0])
        return env.step(job[1]).observation

    random.seed(7)
    expected_stream = [random.random() for _ in range(3)]
    random.seed(7)
    sequential = [run(job) for job in jobs]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(run, jobs))
    assert concurrent == sequential and sequential[0] == sequential[2]
    assert [random.random() for _ in range(3)] == expected_stream


def test_a_forged_reply_that_is_not_plain_data_stops_the_run(env: HumanEvalEnv) -> None:
    """A function that writes its own reply line, holding something the codec does not know, fails
    its test and the run stops there (the reply stream no longer lines up with the calls)."""
    code = """import gc, io
def add(x, y):
    for o in gc.get_objects():
        if isinstance(o, io.TextIOWrapper) and o.mode == "w" and o.fileno() > 2:
            o.write('{"value": {"object": []}}\\n')
            o.flush()
    return x + y
"""
    env.reset("humaneval/test/53")
    t = env.step(code)
    assert not t.success and t.score == 0.0
    assert "sent a value that is not plain data" in t.observation


COLLIDING_REPLY = """import gc, io
def add(x, y):
    # A reply written by hand: a set of ~40k distinct ints that all hash to 0 \
(multiples of 2**61 - 1).
    # Rebuilt naively, every insert compares with every earlier member: 15-30 s holding the GIL.
    body = ",".join(str(k * (2**61 - 1)) for k in range(1, 40_000))
    for o in gc.get_objects():
        if isinstance(o, io.TextIOWrapper) and o.mode == "w" and o.fileno() > 2:
            o.write('{"value": {"%s": [' + body + ']}}\\n')
            o.flush()
    return x + y
"""


@pytest.mark.parametrize("tag", ["set", "dict"])
def test_a_reply_of_hash_colliding_values_does_not_stall_the_actor(
    env: HumanEvalEnv, tag: str
) -> None:
    """The judge runs in the actor's process (in a thread beside its event loop): a reply whose
    members all share one hash is refused before it is rebuilt, so the loop's heartbeat never stops
    for a second."""
    code = COLLIDING_REPLY % tag
    if tag == "dict":  # [key, value] pairs
        code = code.replace("str(k * (2**61 - 1))", '"[%d,0]" % (k * (2**61 - 1))').replace(
            "40_000", "36_000"
        )
    env.reset("humaneval/test/53")

    async def judged_beside_a_heartbeat() -> tuple[float, Any]:
        gaps, last = [0.0], time.monotonic()

        async def beat() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(0.05)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(beat())
        try:
            t = await asyncio.to_thread(env.step, code)
        finally:
            ticker.cancel()
        return max(gaps), t

    longest, t = asyncio.run(judged_beside_a_heartbeat())
    assert not t.success and t.reward == 0.0 and t.score == 0.0
    assert longest < 1.0, f"the event loop stalled for {longest:.1f} s"
    assert "share one hash" in t.observation


@pytest.mark.parametrize(
    "wire",
    [
        {"set": [k * (2**61 - 1) for k in range(1, 200)]},
        {"frozenset": [k * (2**61 - 1) for k in range(1, 200)]},
        {"dict": [[k * (2**61 - 1), 0] for k in range(1, 200)]},
        [{"set": [{"tuple": [k * (2**61 - 1)]} for k in range(1, 200)]}],
    ],
    ids=["set", "frozenset", "dict", "nested-tuples"],
)
def test_hash_colliding_members_are_refused(wire: object) -> None:
    with pytest.raises(ValueError, match="share one hash"):
        from_wire(wire)


def test_few_colliding_members_and_duplicates_still_round_trip() -> None:
    """Legitimate sets whose members happen to collide (-1 and -2) or repeat on the wire still
    rebuild."""
    assert from_wire({"set": [-1, -2, 2**61 - 1, 0]}) == {-1, -2, 2**61 - 1, 0}
    assert from_wire({"set": [7] * 1000}) == {7}
    assert from_wire({"dict": [[1, "a"], [1.0, "b"]]}) == {1: "b"}
