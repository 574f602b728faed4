"""The learner's allocator setting, in a process of its own (it is process-wide and cannot be
undone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_CHILD = """
import json, resource, sys, torch
from leafe.learner.config import TrainerConfig
from leafe.learner.distributed import init_distributed
from leafe.learner.trainer import Trainer

def faults():  # minor page faults of reallocating a freed 64 MB block, 6 times
    out = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20)  # 64 MB, written, then freed
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out

plain = faults()
Trainer(TrainerConfig(precision="fp32", **json.loads(sys.argv[2])), sys.argv[1], \
init_distributed("gloo"))
print(json.dumps({"before": plain, "after": faults()}))
"""


def _faults(tiny_dir: Path, config: dict[str, bool]) -> dict[str, list[int]]:
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny_dir), json.dumps(config)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")
def test_a_default_trainer_reuses_a_freed_block_without_page_faults(tiny_dir: Path) -> None:
    """glibc serves a 64 MB block with mmap and returns it on free, so each reuse faults in its
    16,384 pages again (~7 us each on these VMs); once a default Trainer exists, the block is reused
    from the heap: the first uses may still fault (the heap grows; another thread's allocation can
    land on the freed block once), the later ones do not. With ``reuse_freed_memory = false`` the
    process keeps glibc's behaviour."""
    pages = 16 * 2**20 * 4 // 4096
    default = _faults(tiny_dir, {})
    assert min(default["before"]) > pages // 2, default  # glibc's default: every reuse faults
    assert max(default["after"][3:]) < pages // 20, default
    kept = _faults(tiny_dir, {"reuse_freed_memory": False})
    assert min(kept["after"]) > pages // 2, kept
