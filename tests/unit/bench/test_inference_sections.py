"""bench/inference.py's full run rewrites ``inference.json`` with what it measured; the peer comparison
(``--peer``, measured separately against vLLM CPU) is kept as it was, host and all, instead of dropped."""

from __future__ import annotations

import json
from pathlib import Path

from bench.inference_peer import keep_merged_sections


def test_a_full_run_keeps_the_peer_section_and_replaces_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "inference.json"
    peer = {"measured_at": "2026-12-02", "host": {"cpu_model": "AMD EPYC"}, "ratio": 0.88}
    out.write_text(json.dumps({"peer": peer, "throughput": {"old": 1}, "stale": 1}))
    new = {"host": {"cpu_model": "Intel"}, "throughput": {"new": 2}}
    merged = keep_merged_sections(out, new)
    assert merged == {"host": {"cpu_model": "Intel"}, "throughput": {"new": 2}, "peer": peer}


def test_a_measured_peer_section_and_a_missing_file_are_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "inference.json"
    assert keep_merged_sections(out, {"a": 1}) == {"a": 1}
    out.write_text(json.dumps({"peer": {"ratio": 0.5}}))
    assert keep_merged_sections(out, {"peer": {"ratio": 1.1}}) == {"peer": {"ratio": 1.1}}
