"""The engine gives glibc's free heap pages back to the OS: between steps and once idle after work,
at most every ``trim_every_s``; and :func:`leafe.learner.memory.return_free_memory` really does give
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
    """The engine's trims: when (``time.monotonic()``) and after how many forward passes and
    swaps."""

    def __init__(self) -> None:
        self.engine: GenerationEngine | None = None
        self.times: list[float] = []
        self.work: list[int] = []

    def done(self) -> int:
        assert self.engine is not None
        s = self.engine.stats
        return s.prefill_calls + s.decode_steps + s.swaps


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> Trims:
    """Records the engine's trims (the real trim is done too)."""
    real, record = engine_module.return_free_memory, Trims()

    def spy() -> bool:
        record.times.append(time.monotonic())
        record.work.append(record.done())
        return real()

    monkeypatch.setattr(engine_module, "return_free_memory", spy)
    return record


def test_an_engine_trims_after_its_last_step_and_not_while_idle(
    make_engine: EngineFactory, trims: Trims
) -> None:
    """However a request's steps fall against ``trim_every_s``, once the engine is idle its last
    trim came after its last forward pass (nothing it freed stays kept), and an idle engine does not
    trim again."""
    trims.engine = engine = make_engine(trim_every_s=0.2)
    time.sleep(0.4)
    assert trims.times == []  # no work yet: nothing to give back
    for prompt, tokens in (([1, 2, 3, 4], 4), ([5, 6, 7], 40), ([8, 9], 1)):
        generate(engine, [prompt], new_tokens=tokens)
        time.sleep(0.2 + 0.5)
        assert trims.work and trims.work[-1] == trims.done(), (trims.work, trims.done())
        n = len(trims.times)
        time.sleep(0.5)
        assert len(trims.times) == n, "idle without new work: no more trims"
    assert engine.stats.trims == len(trims.times) and engine.stats.trim_s > 0
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(trims.times))


def test_a_busy_engine_trims_between_steps(make_engine: EngineFactory, trims: Trims) -> None:
    trims.engine = engine = make_engine(trim_every_s=0.02)
    start = time.monotonic()
    future = submit(engine, [1, 2, 3], new_tokens=400)
    future.result(timeout=120)
    done = time.monotonic()
    during = [t for t in trims.times if start < t < done]
    assert len(during) >= 2, f"{len(during)} trims in {done - start:.2f} s of decoding"
    assert all(b - a >= 0.02 for a, b in itertools.pairwise(during))


def test_trimming_off_never_trims(make_engine: EngineFactory, trims: Trims) -> None:
    trims.engine = engine = make_engine(trim_every_s=0.0)
    generate(engine, [[1, 2, 3, 4]], new_tokens=50)
    time.sleep(0.3)
    assert trims.times == [] and engine.stats.trims == 0


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
