"""Unit tests of learner/weight_store.py: version names and pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from leafe.learner.weight_store import (
    in_use_versions,
    mark_in_use,
    prune_versions,
    version_index,
    version_name,
)


def test_version_names_round_trip_and_base_is_zero() -> None:
    """v000012 <-> 12; 'default' is the base (0); foreign names are unknown (None)."""
    assert version_name(12) == "v000012"
    assert version_index("v000012") == 12
    assert version_index("default") == 0
    assert version_index("step-3") is None
    with pytest.raises(ValueError, match="must be >= 1"):
        version_name(0)


def _store(tmp_path: Path, n: int) -> Path:
    for i in range(1, n + 1):
        (tmp_path / version_name(i)).mkdir()
        (tmp_path / version_name(i) / "model.safetensors").write_bytes(b"x")
    (tmp_path / "notes").mkdir()
    return tmp_path


def test_prune_keeps_the_newest_and_in_use_versions(tmp_path: Path) -> None:
    """Beyond `keep`, old versions go, except protected and in-use ones; other dirs are
    untouched."""
    store = _store(tmp_path, 6)
    mark_in_use(store, "http://a:30000", "v000002")
    assert in_use_versions(store) == {"v000002"}
    gone = prune_versions(store, keep=2, protect={"v000003"})
    assert gone == ["v000001", "v000004"]
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == [
        "notes",
        "v000002",
        "v000003",
        "v000005",
        "v000006",
    ]


def test_prune_never_deletes_the_newest_even_with_keep_zero(tmp_path: Path) -> None:
    """keep is at least 1: the newest version always survives."""
    store = _store(tmp_path, 3)
    assert prune_versions(store, keep=0) == ["v000001", "v000002"]
    assert (store / "v000003").is_dir()


def test_in_use_marker_is_replaced_per_server(tmp_path: Path) -> None:
    """A server's marker holds its latest version only."""
    mark_in_use(tmp_path, "http://a", "v000001")
    mark_in_use(tmp_path, "http://a", "v000004")
    mark_in_use(tmp_path, "http://b", "v000003")
    assert in_use_versions(tmp_path) == {"v000004", "v000003"}


def test_a_stale_marker_no_longer_protects_its_version(tmp_path: Path) -> None:
    """A marker not rewritten within the TTL (its weight-sync is gone) stops protecting its version;
    a fresh one keeps protecting."""
    import os

    store = _store(tmp_path, 4)
    gone = mark_in_use(store, "pod-a|http://127.0.0.1:30000", "v000001")
    mark_in_use(store, "pod-b|http://127.0.0.1:30000", "v000002")
    old = gone.stat().st_mtime - 3600
    os.utime(gone, (old, old))
    assert in_use_versions(store, max_age_s=600) == {"v000002"}
    assert prune_versions(store, keep=1) == ["v000001", "v000003"]
