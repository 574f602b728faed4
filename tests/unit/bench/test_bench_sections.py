"""A bench's full run rewrites its results file with what it measured; the sections another mode of
it measures and merges separately (bench/inference.py's ``peer`` against vLLM CPU, bench/actor.py's
``tree_cost``) are kept as they were, host and all, instead of dropped."""

from __future__ import annotations

import json
from pathlib import Path

from bench.host import keep_sections


def test_a_full_run_keeps_the_peer_section_and_replaces_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "inference.json"
    peer = {"measured_at": "2026-12-02", "host": {"cpu_model": "AMD EPYC"}, "ratio": 0.88}
    out.write_text(json.dumps({"peer": peer, "throughput": {"old": 1}, "stale": 1}))
    new = {"host": {"cpu_model": "Intel"}, "throughput": {"new": 2}}
    merged = keep_sections(out, new, ("peer",))
    assert merged == {"host": {"cpu_model": "Intel"}, "throughput": {"new": 2}, "peer": peer}


def test_a_measured_peer_section_and_a_missing_file_are_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "inference.json"
    assert keep_sections(out, {"a": 1}, ("peer",)) == {"a": 1}
    out.write_text(json.dumps({"peer": {"ratio": 0.5}}))
    assert keep_sections(out, {"peer": {"ratio": 1.1}}, ("peer",)) == {"peer": {"ratio": 1.1}}
    assert keep_sections(out, {"a": 1}, ("tree_cost",)) == {"a": 1}
