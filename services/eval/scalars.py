"""TensorBoard scalars of evaluations: the Pass@k curve of one result and the learning curve over
versions."""

from __future__ import annotations

from pathlib import Path

from leafe.actors.evaluate import EvalResult
from leafe.learner.scalars import open_scalar_writer
from leafe.learner.weight_store import version_index

__all__ = ["write_curve_scalars", "write_passk_scalars"]


def write_passk_scalars(log_dir: Path, result: EvalResult) -> None:
    """TensorBoard scalars of one result in ``log_dir``: the Pass@k curve as ``pass@k`` at step k,
    and each ``pass@<k>`` at the step of the evaluated weight version's index (0 for the base
    model), so evaluations of successive versions written to one directory form a curve over
    training. A no-op without tensorboard."""
    writer = open_scalar_writer(log_dir)
    try:
        index = version_index(result.weight_version) or 0
        for k, value in sorted(result.passk.items()):
            writer.scalar("pass@k", value, k)
            writer.scalar(f"pass@{k}", value, index)
    finally:
        writer.close()


def write_curve_scalars(log_dir: Path, result: EvalResult, learner_step: int) -> None:
    """One learning-curve point in ``log_dir``: ``pass@<k>`` and ``unparseable`` at ``learner_step``
    (a no-op without tensorboard)."""
    writer = open_scalar_writer(log_dir)
    try:
        for k, value in sorted(result.passk.items()):
            writer.scalar(f"pass@{k}", value, learner_step)
        writer.scalar("unparseable", result.parse_failure_rate, learner_step)
    finally:
        writer.close()
