"""Offline data for ``leafe train``: read dataset shards, and a resumable epoch/position batch order.

Every rank reads the same shards and computes the same order (a permutation seeded by ``seed`` and the
epoch), so ranks agree on each global batch without communicating. A checkpoint's ``(epoch, position)``
says how many samples of that epoch's order were trained; resuming continues with the next one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec

from learner.config import TrainConfig
from learner.dataset import MANIFEST, iter_samples
from protocol.samples import Sample

__all__ = ["OfflineBatch", "iter_batches", "iter_shard_samples", "read_samples", "steps_per_epoch"]


def iter_shard_samples(data_dir: Path) -> Iterator[Sample]:
    """Samples of a dataset directory: verified through its ``manifest.json`` when it has one (``leafe
    replay`` output, read by ``learner.dataset.iter_samples``), else every ``*.jsonl`` file under it (one
    msgspec-JSON Sample per line, sorted path order) for hand-made data."""
    if (Path(data_dir) / MANIFEST).is_file():
        yield from iter_samples(Path(data_dir))
        return
    decoder = msgspec.json.Decoder(Sample)
    for path in sorted(Path(data_dir).rglob("*.jsonl")):
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise ValueError(f"{path}:{lineno}: not a Sample: {e}") from None


def read_samples(data_dir: Path) -> list[Sample]:
    """All samples of the dataset shards under ``data_dir``; raises if there are none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"dataset directory not found: {data_dir}")
    samples = list(iter_shard_samples(data_dir))
    if not samples:
        raise ValueError(f"no samples found under {data_dir}")
    return samples


def steps_per_epoch(n: int, global_batch: int, drop_last: bool) -> int:
    """Optimizer steps in one epoch of ``n`` samples."""
    return n // global_batch if drop_last else math.ceil(n / global_batch)


class OfflineBatch:
    """A global batch and where the order stands after it."""

    __slots__ = ("epoch", "position", "samples")

    def __init__(self, epoch: int, position: int, samples: list[Sample]) -> None:
        self.epoch = epoch
        """Epoch of this batch."""
        self.position = position
        """Samples of the epoch's order consumed once this batch is trained."""
        self.samples = samples
        """The global batch."""


def _order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def iter_batches(
    samples: list[Sample], cfg: TrainConfig, *, start_epoch: int = 0, start_position: int = 0
) -> Iterator[OfflineBatch]:
    """Global batches from ``(start_epoch, start_position)`` to the end of the last epoch."""
    gb = cfg.trainer.batch.global_batch
    n = len(samples)
    for epoch in range(start_epoch, cfg.epochs):
        order = _order(n, epoch, cfg.trainer.seed, cfg.shuffle)
        pos = start_position if epoch == start_epoch else 0
        while pos < n:
            idx = order[pos : pos + gb]
            if len(idx) < gb and cfg.drop_last:
                break
            pos += len(idx)
            yield OfflineBatch(epoch, pos, [samples[i] for i in idx])
