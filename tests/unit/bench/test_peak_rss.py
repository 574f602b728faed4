"""A memory bench's child reports its own peak resident set, not its parent's.

Linux keeps the old memory map's high-water mark across ``execve`` (``ru_maxrss`` of an exec'd child
starts at the forking parent's resident set), so ``bench/learner.py``'s memory part, forked from a
parent that had just trained seven throughput variants (15.3 GB), read 15.29 GB for every variant.
The children read ``VmHWM``, the high-water mark of their own map."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BALLAST_GIB = 4

PARENT = f"""
import subprocess, sys
ballast = bytearray(b"\\x01") * ({BALLAST_GIB} * 2**30)  # written, so resident
child = [sys.executable, "-m", "bench.learner_memory", "--child", "after", "--model", "tiny",
         "--samples", "4", "--prompt", "20,80"]
run = subprocess.run(child, capture_output=True, text=True, check=False)
sys.stderr.write(run.stderr[-3000:])
print(run.stdout.strip().splitlines()[-1] if run.returncode == 0 else "child failed")
"""


def test_a_learner_memory_child_of_a_big_parent_reports_its_own_peak() -> None:
    """The tiny model's child (1.6 GB when it first builds the model), forked from a parent holding
    4 GiB, reports its own peak."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", PARENT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert row["variant"] == "after" and len(row["steps"]) == 2
    assert 0.05 < row["peak_rss_gb"] < 0.6 * BALLAST_GIB * 2**30 / 1e9, row["peak_rss_gb"]


def test_peak_rss_is_the_process_own_high_water_mark() -> None:
    """``peak_rss_kib`` grows with what a fresh process touches (a fresh one: the test process's own
    mark may already stand above anything a test allocates)."""
    code = (
        "from bench.host import peak_rss_kib\n"
        "before = peak_rss_kib()\n"
        "block = bytearray(b'\\x01') * (64 * 2**20)\n"
        "print(before, peak_rss_kib(), len(block))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    before, after, size = map(int, run.stdout.split())
    assert after - before >= 60 * 2**10 and size == 64 * 2**20
