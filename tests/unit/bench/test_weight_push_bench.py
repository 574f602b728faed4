"""``python -m bench.weight_push --quick`` runs as ``make bench`` would start it (from the
repository root, writing to a temporary file, never the committed results): both transports and
the floor are timed for 1 and 2 tiny engines, and the record says where it was measured. The
figures are not measurements; only their presence and sanity are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.bench.test_bench_smoke import ROOT, positive, where

pytestmark = pytest.mark.integration  # inference servers and gloo processes


def test_quick_mode_times_both_transports_and_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "weight_push.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.weight_push", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["quick"] is True and r["model"] == "tiny"
    assert [row["engines"] for row in r["rows"]] + [int(n) for n in r["skipped"]] == [1, 2]
    for row in r["rows"]:
        positive(row["seconds"], "disk", "distributed", "floor", "group_formation")
        positive(row, "ratio_to_floor.disk", "ratio_to_floor.distributed", "disk_over_distributed")
    where(r)
