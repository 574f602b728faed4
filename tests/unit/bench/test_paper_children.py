"""Dataset filtering and per-epoch weights of the paper table's training children (``bench/paper/children.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.paper.children import epoch_weights, filter_samples, kind_counts
from tests.support.learner import make_samples, write_shards


def test_filter_keeps_the_asked_kinds_of_the_asked_tasks(tmp_path: Path) -> None:
    """L_reh only keeps ``reh``; an SFT candidate keeps the samples of its first n demonstration tasks."""
    src = write_shards(tmp_path / "src", make_samples(28, kinds=("cf", "reh")))
    assert filter_samples(src, tmp_path / "reh", kinds=["reh"]) == 14
    assert kind_counts(tmp_path / "reh") == {"reh": 14}
    n = filter_samples(src, tmp_path / "two", task_ids=["toy/0", "toy/1"])
    assert n == 8 and kind_counts(tmp_path / "two") == {"cf": 4, "reh": 4}
    assert filter_samples(src, tmp_path / "none", kinds=["cf"], task_ids=["toy/9"]) == 0


def test_epoch_weights_name_the_export_after_each_epoch(tmp_path: Path) -> None:
    """20 samples at batch 8 = 3 steps per epoch: epoch 1 is v000003, epoch 2 v000006, the last ``final``;
    a step cap that ends the training earlier makes every later epoch the final weights."""
    assert epoch_weights(tmp_path, 20, 8, 1, 3) == tmp_path / "weights" / "v000003"
    assert epoch_weights(tmp_path, 20, 8, 2, 3) == tmp_path / "weights" / "v000006"
    assert epoch_weights(tmp_path, 20, 8, 3, 3) == tmp_path / "final"
    assert epoch_weights(tmp_path, 20, 8, 2, 3, max_steps=5) == tmp_path / "final"
