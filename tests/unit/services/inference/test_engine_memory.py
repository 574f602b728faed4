"""The engine gives glibc's free heap pages back to the OS once idle after work
(``trim_idle_s``), and between steps only once its resident set grew (``trim_growth_bytes``) or on
a clock (``trim_every_s``); and :func:`leafe.learner.memory.return_free_memory` really does give
them back."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leafe.services.inference import engine as engine_module
from leafe.services.inference.engine import GenerationEngine
from tests.unit.services.inference.conftest import EngineFactory, generate, submit

ROOT = Path(__file__).resolve().parents[4]


class Trims:
    """The engine's trims: when (``time.monotonic()``), after how many forward passes and swaps, and
    how many rows were running and waiting at the time."""

    def __init__(self) -> None:
        self.engine: GenerationEngine | None = None
        self.times: list[float] = []
        self.work: list[int] = []
        self.running: list[int] = []

    def done(self) -> int:
        assert self.engine is not None
        s = self.engine.stats
        return s.prefill_calls + s.decode_steps + s.swaps


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> Trims:
    """Records the engine's trims (the real trim is done too)."""
    real, record = engine_module.return_free_memory, Trims()

    def spy() -> bool:
        assert record.engine is not None
        record.times.append(time.monotonic())
        record.work.append(record.done())
        record.running.append(len(record.engine._batch))  # the worker's own thread: exact
        return real()

    monkeypatch.setattr(engine_module, "return_free_memory", spy)
    return record


def test_an_idle_engine_trims_once_after_its_last_step(
    make_engine: EngineFactory, trims: Trims
) -> None:
    """Once the engine has been idle ``trim_idle_s`` after work it trims once, after its last
    forward pass (nothing it freed stays kept), and an idle engine does not trim again."""
    trims.engine = engine = make_engine(trim_idle_s=0.2)
    time.sleep(0.4)
    assert trims.times == []  # no work yet: nothing to give back
    for prompt, tokens in (([1, 2, 3, 4], 4), ([5, 6, 7], 40), ([8, 9], 1)):
        n = len(trims.times)
        generate(engine, [prompt], new_tokens=tokens)
        time.sleep(0.2 + 0.5)
        assert len(trims.times) == n + 1, trims.times
        assert trims.work[-1] == trims.done(), (trims.work, trims.done())
        time.sleep(0.5)
        assert len(trims.times) == n + 1, "idle without new work: no more trims"
    assert engine.stats.trims == len(trims.times) == 3 and engine.stats.trim_s > 0
    assert engine.stats.busy_trims == 0 and trims.running == [0, 0, 0]


def test_an_idle_trim_never_interrupts_a_busy_batch(
    make_engine: EngineFactory, trims: Trims
) -> None:
    """Requests that arrive closer together than ``trim_idle_s`` keep the engine busy: it never
    trims while rows are running or between them, only once they are all done and it idled."""
    trims.engine = engine = make_engine(trim_idle_s=0.15)
    futures = [submit(engine, [1, 2, 3], new_tokens=200)]
    for k in range(6):  # each joins a running batch, or follows the last within 0.05 s
        time.sleep(0.05)
        futures.append(submit(engine, [4 + k, 5, 6], new_tokens=20 + 10 * k))
    for f in futures:
        f.result(timeout=120)
    time.sleep(0.15 + 0.4)
    # one trim in all: none while rows ran or between requests, one once idle after the last step
    assert trims.running == [0], "a trim while requests were running or arriving"
    assert trims.work == [trims.done()] and engine.stats.busy_trims == 0


def test_a_busy_engine_trims_between_steps_once_grown(
    make_engine: EngineFactory, trims: Trims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trim_growth_bytes``: a busy engine trims between steps when its resident set has grown by
    more than that since the last trim, and not before."""
    resident = [10**9]
    monkeypatch.setattr(engine_module, "resident_bytes", lambda: resident[0])
    trims.engine = engine = make_engine(trim_growth_bytes=100 * 2**20)
    future = submit(engine, [1, 2, 3], new_tokens=1500)
    while engine.stats.decode_steps < 50:
        time.sleep(0.01)
    assert trims.times == [] and not future.done()  # running, not grown: no trim
    resident[0] += 101 * 2**20
    while not trims.times and not future.done():
        time.sleep(0.01)
    future.result(timeout=120)
    assert len(trims.times) == 1 and trims.running[0] >= 1 and engine.stats.busy_trims == 1


def test_a_periodic_engine_trims_between_steps(make_engine: EngineFactory, trims: Trims) -> None:
    """``trim_every_s`` (the periodic policy) trims a busy engine at most that often."""
    trims.engine = engine = make_engine(trim_every_s=0.02)
    start = time.monotonic()
    future = submit(engine, [1, 2, 3], new_tokens=400)
    future.result(timeout=120)
    done = time.monotonic()
    during = [t for t in trims.times if start < t < done]
    assert len(during) >= 2, f"{len(during)} trims in {done - start:.2f} s of decoding"
    assert all(b - a >= 0.02 for a, b in itertools.pairwise(during))


def test_trimming_off_never_trims(make_engine: EngineFactory, trims: Trims) -> None:
    trims.engine = engine = make_engine()
    generate(engine, [[1, 2, 3, 4]], new_tokens=50)
    time.sleep(0.3)
    assert trims.times == [] and engine.stats.trims == 0


def test_negative_trim_settings_are_refused(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="trim_idle_s"):
        make_engine(trim_idle_s=-1.0)


_HOLES = """
import ctypes, json
from leafe.learner.memory import return_free_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
size, n = 100 * 1024, 2000  # below glibc's mmap threshold: from the heap
blocks = [libc.malloc(size) for _ in range(n)]
for b in blocks:
    ctypes.memset(b, 1, size)
full = rss()
for b in blocks[::2]:  # every other block: holes between live blocks, none at the heap's top
    libc.free(ctypes.c_void_p(b))
freed = rss()
assert return_free_memory()
print(json.dumps({"full": full, "freed": freed, "trimmed": rss()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")
def test_free_holes_in_the_heap_go_back_to_the_os() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _HOLES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rss = json.loads(run.stdout)
    holes = 1000 * 100 * 1024
    assert rss["full"] - rss["freed"] < holes // 10, rss  # freeing alone keeps the holes resident
    assert rss["freed"] - rss["trimmed"] > holes * 8 // 10, rss
