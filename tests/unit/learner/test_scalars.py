"""TensorBoard scalars (learner/scalars.py): a step's loss terms land in event files TensorBoard
reads, and without the tensorboard package (or a directory) the writer is a no-op instead of an
error."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from leafe.learner.scalars import (
    NullScalarWriter,
    TensorBoardWriter,
    open_scalar_writer,
    write_step_scalars,
)


def _stats(step: int, loss: float) -> SimpleNamespace:
    return SimpleNamespace(
        step=step,
        loss=loss,
        loss_cf=loss + 1,
        loss_reh=None,
        loss_rft=None,
        loss_grpo=None,
        kl=None,
        clip_frac=None,
        samples=4,
        skipped=0,
        target_tokens=10,
        padded_tokens=64,
    )


def test_step_scalars_are_readable_by_tensorboard(tmp_path: Path) -> None:
    """Each step's present loss terms and the extras are written at the step; absent terms are
    not."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = open_scalar_writer(tmp_path / "tb")
    assert isinstance(writer, TensorBoardWriter)
    for step, loss in [(1, 2.5), (2, 2.0)]:
        write_step_scalars(
            writer, _stats(step, loss), tokens_per_second=100.0 * step, policy_lag=None
        )
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/total", "loss/cf", "batch/samples", "train/tokens_per_second"} <= tags
    assert not tags & {"loss/reh", "loss/kl", "train/policy_lag"}
    assert [(e.step, e.value) for e in acc.Scalars("loss/total")] == [(1, 2.5), (2, 2.0)]
    assert [e.value for e in acc.Scalars("train/tokens_per_second")] == [100.0, 200.0]


def test_without_tensorboard_or_directory_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No directory, or no tensorboard package: a NullScalarWriter that accepts every call."""
    assert isinstance(open_scalar_writer(None), NullScalarWriter)
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", None
    )  # import now raises ImportError
    writer = open_scalar_writer(tmp_path / "tb")
    assert isinstance(writer, NullScalarWriter)
    write_step_scalars(writer, _stats(1, 1.0))
    writer.close()
    assert not (tmp_path / "tb").exists()
