"""What ``leafe learner`` clears on start: the temporary directories a killed checkpoint or export
left on the weight volume (nothing else ever removes them, and each can be as large as a checkpoint
or an export)."""

from __future__ import annotations

from pathlib import Path

from leafe.learner.checkpoint import LATEST
from leafe.services.learner.main import clear_interrupted_writes


def _dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "shard").write_bytes(b"x" * 16)
    return path


def test_a_start_removes_what_a_killed_checkpoint_or_export_left(tmp_path: Path) -> None:
    """A stale ``.step_<N>.tmp`` (DCP checkpoint killed mid-write), a ``.latest.tmp`` pointer and
    ``.v<N>.<suffix>`` export directories are removed; finished checkpoints, the ``latest`` pointer,
    finished versions, the in-use markers and anything not named like ours stay."""
    store, checkpoints = tmp_path / "weights" / "store", tmp_path / "weights" / "learner"
    stale = [
        _dir(checkpoints / ".step_00000007.tmp"),
        _dir(store / ".v000003.partial"),
        _dir(store / ".v000004.k2j3h4"),
    ]
    (checkpoints / f".{LATEST}.tmp").write_text("step_00000007")
    stale.append(checkpoints / f".{LATEST}.tmp")
    kept = [
        _dir(checkpoints / "step_00000006"),
        _dir(store / "v000002"),
        _dir(store / ".in_use"),
        _dir(store / ".vendor"),
        _dir(checkpoints / ".step_notes"),
    ]
    (checkpoints / LATEST).write_text("step_00000006")
    kept.append(checkpoints / LATEST)

    removed = clear_interrupted_writes(store, checkpoints)

    assert sorted(removed) == sorted(str(p) for p in stale)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)


def test_a_first_start_has_nothing_to_clear(tmp_path: Path) -> None:
    """Neither directory exists yet (a fresh volume): nothing is removed and nothing is created."""
    assert clear_interrupted_writes(tmp_path / "store", tmp_path / "learner") == []
    assert not (tmp_path / "store").exists() and not (tmp_path / "learner").exists()
