"""bench/compute_floor.py: the floor times exactly the work a run's counters record, and refuses
counters it cannot time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.compute_floor import LinearStack, engine_floor
from leafe.learner.model_io import tiny_model_dir

ROOT = Path(__file__).resolve().parents[3]

COUNTERS = {
    "prefill_calls": 4,
    "prefilled_tokens": 40,
    "decode_steps": 5,
    "batch_sizes": {"1": 2, "3": 3},  # JSON keys, as /get_server_info sends them
    "prefill_cpu_s": 2.0,
    "decode_cpu_s": 1.0,
}


def test_the_floor_counts_the_runs_own_passes_steps_and_flops() -> None:
    floor = engine_floor(tiny_model_dir(), "float32", COUNTERS, requests=6, min_seconds=0.01)
    assert floor["prefill"]["passes"] == 4 and floor["prefill"]["rows_per_pass"] == 10
    assert floor["decode"]["steps"] == 5 and floor["decode"]["rows_per_step"] == pytest.approx(2.2)
    assert floor["floor_s"] == pytest.approx(
        floor["prefill"]["floor_s"] + floor["decode"]["floor_s"], abs=2e-3
    )
    assert floor["cpu_s"] == 3.0 and floor["over_floor"] == pytest.approx(
        3.0 / floor["floor_s"], rel=1e-2
    )
    cfg = json.loads((tiny_model_dir() / "config.json").read_text())
    stack = LinearStack(tiny_model_dir(), torch.float32)
    per_row = stack.flops_per_row + stack.head_flops_per_row
    # 40 prefilled tokens through the layers, 6 last tokens through the head, 11 decoded rows
    # through both
    want = 40 * stack.flops_per_row + 6 * stack.head_flops_per_row + 11 * per_row
    assert floor["tflop"] == pytest.approx(want / 1e12, abs=1e-3)
    assert stack.head.out_features == cfg["vocab_size"]
    assert len(stack.layers) == 7 * cfg["num_hidden_layers"]


def test_runs_floored_with_one_stack_share_its_timings() -> None:
    """Two servers' work floored with one stack is timed at the same rates: equal work, equal
    floors."""
    stack = LinearStack(tiny_model_dir(), torch.float32)
    first, second = (
        engine_floor(
            tiny_model_dir(), "float32", COUNTERS, requests=6, min_seconds=0.01, stack=stack
        )
        for _ in range(2)
    )
    assert first["floor_s"] == second["floor_s"] > 0


def test_counters_without_decode_row_counts_are_refused() -> None:
    counters = {k: v for k, v in COUNTERS.items() if k != "batch_sizes"}
    with pytest.raises(ValueError, match="batch_sizes"):
        engine_floor(tiny_model_dir(), "float32", counters, requests=6, min_seconds=0.01)


@pytest.mark.integration  # two inference server processes
def test_eval_floor_smoke_times_each_servers_own_work(tmp_path: Path) -> None:
    """``bench/eval_floor.py --smoke``: the evaluation runs through a real fleet and each server's
    floor times that server's own prefill passes and decode steps."""
    out = tmp_path / "inference.json"
    (tmp_path / "inference.json").write_text(json.dumps({"peer": {"kept": True}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "bench.eval_floor", "--smoke", "--out", str(out)]
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["peer"] == {"kept": True}  # merged, not overwritten
    row = record["eval_floor"]
    assert row["episodes"] == 4 and row["servers"] == 2 and row["host"]["cpu_model"]
    assert len(row["per_server"]) == 2 and any(s["decode"]["steps"] > 0 for s in row["per_server"])
    assert row["floor_s"] == max(s["floor_s"] for s in row["per_server"])
    assert row["wall_over_floor"] == pytest.approx(row["wall_s"] / row["floor_s"], rel=1e-2)
