"""Issue 62's two benchmarks run in their ``--quick`` modes (the tiny random model), as ``python
-m bench.<area>`` from the repository root, writing to a temporary file: their JSON holds the
figures they promise. Quick figures are not measurements; only what must hold on any machine is
checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _bench(area: str, out: Path, timeout_s: float) -> dict:
    subprocess.run(
        [sys.executable, "-m", f"bench.{area}", "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=timeout_s,
    )
    return json.loads(out.read_text())


def test_online_equals_offline_quick(tmp_path: Path) -> None:
    """With the default batch floor the online learner takes ``leafe train``'s batches and ends at
    its weights bit for bit; with ``min_batch = 1`` and samples trickling in it does not."""
    data = _bench("online_equals_offline", tmp_path / "oeo.json", 600)
    floor, old = data["online"]["floor_default"], data["online"]["min_batch_1"]
    assert floor["identical"] and floor["max_abs_diff"] == 0.0
    assert len(floor["step_samples"]) == data["offline"]["steps"]
    assert not old["identical"] and len(old["step_samples"]) > data["offline"]["steps"]
    assert data["host"]["cpu_model"]


def test_online_backpressure_quick(tmp_path: Path) -> None:
    """Both arms ran and report their stale share and trained samples a minute; the gate is off in
    the first arm (it never waits) and set in the second."""
    data = _bench("online_backpressure", tmp_path / "bp.json", 1200)
    before, after = data["before"], data["after"]
    assert not before["backpressure"] and after["backpressure"]
    assert before["gate_wait_s"] == 0.0
    for arm in (before, after):
        assert 0.0 <= arm["stale_share"] <= 1.0
        assert arm["samples_made"] > 0 and arm["trained_per_minute"] >= 0.0
    assert data["host"]["cpu_model"]
