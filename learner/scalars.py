"""TensorBoard scalars of training and evaluation: a tiny writer interface that is a no-op when the
``tensorboard`` package (the ``tb`` extra: ``pip install -e .[tb]``) is missing.

    # a NullScalarWriter without tensorboard
    writer = open_scalar_writer(Path("runs/r1/tensorboard/learner"))
    # loss/total, loss/cf, ... at stats.step
    write_step_scalars(writer, stats, tokens_per_second=812.0)
    writer.close()

``leafe learner --tensorboard-dir`` and ``leafe train`` write one event file per process (rank 0
only); ``tensorboard --logdir runs/r1/tensorboard`` shows them (``leafe run`` prints that line when
it starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import structlog

__all__ = [
    "STEP_SCALARS",
    "NullScalarWriter",
    "ScalarWriter",
    "TensorBoardWriter",
    "open_scalar_writer",
    "write_step_scalars",
]

log = structlog.get_logger(__name__)

STEP_SCALARS = {
    "loss/total": "loss",
    "loss/cf": "loss_cf",
    "loss/reh": "loss_reh",
    "loss/rft": "loss_rft",
    "loss/grpo": "loss_grpo",
    "loss/kl": "kl",
    "grpo/clip_frac": "clip_frac",
    "batch/samples": "samples",
    "batch/skipped": "skipped",
    "batch/target_tokens": "target_tokens",
    "batch/padded_tokens": "padded_tokens",
}
"""Tag -> ``leafe.learner.trainer.StepStats`` field written after every step (fields that are
``None`` are not)."""


class ScalarWriter(Protocol):
    """Where scalars go."""

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Record ``value`` under ``tag`` at ``step``."""
        ...

    def flush(self) -> None:
        """Write what is buffered."""
        ...

    def close(self) -> None:
        """Flush and release the file."""
        ...


class NullScalarWriter:
    """Drops everything (no directory given, or tensorboard is not installed)."""

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Nothing."""

    def flush(self) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""


class TensorBoardWriter:
    """``torch.utils.tensorboard.SummaryWriter`` behind :class:`ScalarWriter`."""

    def __init__(self, log_dir: Path, *, flush_secs: int = 10) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = Path(log_dir)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """``add_scalar``."""
        self._writer.add_scalar(tag, float(value), global_step=step)

    def flush(self) -> None:
        """Write the pending events."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def open_scalar_writer(log_dir: Path | None, *, flush_secs: int = 10) -> ScalarWriter:
    """A TensorBoard writer on ``log_dir``; a :class:`NullScalarWriter` when ``log_dir`` is ``None``
    or the tensorboard package is missing (said once in the log). ``flush_secs`` bounds what a crash
    loses."""
    if log_dir is None:
        return NullScalarWriter()
    try:
        return TensorBoardWriter(log_dir, flush_secs=flush_secs)
    except ImportError as e:
        log.warning(
            "tensorboard.unavailable",
            log_dir=str(log_dir),
            error=str(e),
            fix="pip install -e .[tb]",
        )
        return NullScalarWriter()


def write_step_scalars(writer: ScalarWriter, stats: Any, **extra: float | None) -> None:
    """The :data:`STEP_SCALARS` of one ``StepStats`` at ``stats.step``, plus ``extra`` (e.g.
    ``tokens_per_second``, written as ``train/tokens_per_second``; ``None`` values are skipped)."""
    for tag, field in STEP_SCALARS.items():
        value = getattr(stats, field)
        if value is not None:
            writer.scalar(tag, value, stats.step)
    for name, value in extra.items():
        if value is not None:
            writer.scalar(f"train/{name}", value, stats.step)
