"""Results file handling of ``bench/learner.py``: a clean clone has no
``bench/results/learner.json``."""

from __future__ import annotations

import json
from pathlib import Path

from bench.learner import load_saved, save_result


def test_a_missing_results_file_is_created_and_the_other_mode_is_kept(tmp_path: Path) -> None:
    """Without a results file there is nothing saved (the bench once crashed there, after a full
    run, on a name bound only when the file existed); saving creates it, and saving one mode keeps
    the other."""
    path = tmp_path / "results" / "learner.json"
    assert load_saved(path, "full") is None
    save_result(path, "full", {"mode": "full", "x": 1})
    assert load_saved(path, "full") == {"mode": "full", "x": 1}
    assert load_saved(path, "quick") is None
    save_result(path, "quick", {"mode": "quick", "x": 2})
    assert json.loads(path.read_text()) == {
        "full": {"mode": "full", "x": 1},
        "quick": {"mode": "quick", "x": 2},
    }
