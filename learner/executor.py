"""Run trainer operations on every rank when only rank 0 knows what to do next (the online learner).

Rank 0 owns the samples stream; the other ranks wait in :meth:`Executor.follow`. Each operation is a
small msgspec command that rank 0 broadcasts (``broadcast_object_list`` of its msgpack bytes) before
executing it itself, so every rank enters the same collectives in the same order:

    rank 0:   stats = executor.submit(TrainCmd(samples=batch))      # broadcast, then train
    rank k:   executor.follow()                                     # until StopCmd

With one rank nothing is broadcast. Idle leaders send :class:`NoopCmd` now and then so followers
never reach the process group's timeout while the stream is quiet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch.distributed as dist

from leafe.learner.checkpoint import Progress, save_checkpoint
from leafe.learner.trainer import StepStats, Trainer
from leafe.protocol.samples import Sample

__all__ = ["CheckpointCmd", "Command", "Executor", "ExportCmd", "NoopCmd", "StopCmd", "TrainCmd"]


class TrainCmd(msgspec.Struct, frozen=True, kw_only=True, tag="train"):
    """One optimizer step on a global batch."""

    samples: list[Sample]


class CheckpointCmd(msgspec.Struct, frozen=True, kw_only=True, tag="checkpoint"):
    """Write a DCP checkpoint recording ``progress``."""

    progress: Progress


class ExportCmd(msgspec.Struct, frozen=True, kw_only=True, tag="export"):
    """Gather and export the weights as ``version`` into ``out_dir``."""

    out_dir: str
    version: str
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class NoopCmd(msgspec.Struct, frozen=True, kw_only=True, tag="noop"):
    """Keep followers' collectives alive while the leader waits for data."""


class StopCmd(msgspec.Struct, frozen=True, kw_only=True, tag="stop"):
    """Followers return from :meth:`Executor.follow`."""


Command = TrainCmd | CheckpointCmd | ExportCmd | NoopCmd | StopCmd
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


class Executor:
    """Broadcasts commands from rank 0 and applies them to the local :class:`Trainer` on every
    rank."""

    def __init__(
        self, trainer: Trainer, checkpoint_dir: Path, *, keep_checkpoints: int = 2
    ) -> None:
        self.trainer = trainer
        self.checkpoint_dir = Path(checkpoint_dir)
        self.keep = keep_checkpoints

    def _broadcast(self, cmd: Command | None) -> Command:
        payload = [_encoder.encode(cmd) if cmd is not None else None]
        dist.broadcast_object_list(payload, src=0)
        data = payload[0]
        if not isinstance(data, bytes):
            raise RuntimeError(
                f"rank {self.trainer.env.rank} received a non-command broadcast: {type(data)}"
            )
        return _decoder.decode(data)

    def submit(self, cmd: Command) -> StepStats | Path | str | None:
        """Rank 0: broadcast ``cmd`` to the followers, then apply it here; returns the local
        result."""
        if not self.trainer.env.is_main:
            raise RuntimeError("Executor.submit is for rank 0; other ranks call follow()")
        if self.trainer.env.world_size > 1:
            self._broadcast(cmd)
        return self.apply(cmd)

    def follow(self) -> None:
        """Ranks > 0: apply broadcast commands until :class:`StopCmd`."""
        while True:
            cmd = self._broadcast(None)
            if isinstance(cmd, StopCmd):
                return
            self.apply(cmd)

    def apply(self, cmd: Command) -> StepStats | Path | str | None:
        """Run one command on this rank."""
        match cmd:
            case TrainCmd(samples=samples):
                return self.trainer.train_step(samples)
            case CheckpointCmd(progress=progress):
                return save_checkpoint(self.checkpoint_dir, self.trainer, progress, keep=self.keep)
            case ExportCmd(out_dir=out_dir, version=version, extra=extra):
                return self.trainer.export(Path(out_dir), version=version, extra=extra)
            case NoopCmd() | StopCmd():
                return None
        raise TypeError(f"unknown command {cmd!r}")
