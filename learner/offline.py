"""Offline Stage-2 training (``leafe train``): dataset shards, a resumable batch order, and the
loop.

Every rank reads the same shards and computes the same order (a permutation seeded by ``seed`` and
the epoch), so ranks agree on each global batch without communicating. A checkpoint's ``(epoch,
position)`` says how many samples of that epoch's order were trained; resuming continues with the
next one.

A run asked to stop (``stop``: ``leafe train`` asks on SIGTERM or Ctrl-C, as a preempted node or a
scheduler's time limit sends them) finishes the step it is in, checkpoints it and returns without an
export: the rerun resumes there and loses no step.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import structlog

from leafe.learner.checkpoint import Progress, latest_checkpoint, load_checkpoint, save_checkpoint
from leafe.learner.config import TrainConfig
from leafe.learner.dataset import MANIFEST, iter_samples
from leafe.learner.distributed import DistEnv, all_reduce_sum
from leafe.learner.model_io import resolve_model
from leafe.learner.scalars import (
    NullScalarWriter,
    ScalarWriter,
    open_scalar_writer,
    write_step_scalars,
)
from leafe.learner.trainer import Trainer
from leafe.learner.weight_store import prune_versions, version_name
from leafe.protocol.samples import Sample

__all__ = [
    "OfflineBatch",
    "TrainResult",
    "iter_batches",
    "iter_shard_samples",
    "read_samples",
    "steps_per_epoch",
    "train",
]


def iter_shard_samples(data_dir: Path) -> Iterator[Sample]:
    """Samples of a dataset directory: verified through its ``manifest.json`` when it has one
    (``leafe replay`` output, read by ``leafe.learner.dataset.iter_samples``), else every
    ``*.jsonl`` file under it (one msgspec-JSON Sample per line, sorted path order) for hand-made
    data."""
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


log = structlog.get_logger(__name__)


class TrainResult(msgspec.Struct, frozen=True, kw_only=True):
    """What an offline run produced."""

    steps: int
    """Optimizer steps taken in total (resumed ones included)."""
    final_dir: str
    """HF export of the final weights."""
    final_sha256: str
    """sha256 of the final export's manifest (rank 0; empty on other ranks)."""
    last_loss: float | None
    """Loss of the last step of this process (None if it took none)."""
    stopped: bool = False
    """Asked to stop before its last step: the latest checkpoint holds every step taken,
    ``final_dir`` is empty (nothing exported), and a rerun on the same ``out`` resumes."""


def _with_schedule_length(cfg: TrainConfig, n_samples: int) -> TrainConfig:
    total = cfg.epochs * steps_per_epoch(n_samples, cfg.trainer.batch.global_batch, cfg.drop_last)
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    if cfg.trainer.optim.total_steps:
        return cfg
    optim = msgspec.structs.replace(cfg.trainer.optim, total_steps=total)
    return msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, optim=optim))


def _after_step(trainer: Trainer, cfg: TrainConfig, out: Path, progress: Progress) -> None:
    tc = cfg.trainer
    if tc.checkpoint_every and trainer.step % tc.checkpoint_every == 0:
        save_checkpoint(out / "checkpoints", trainer, progress, keep=tc.keep_checkpoints)
    if tc.push_every and trainer.step % tc.push_every == 0:
        version = version_name(trainer.step)
        trainer.export(
            out / "weights" / version, version=version, extra={"learner_step": trainer.step}
        )
        if trainer.env.is_main:
            prune_versions(out / "weights", tc.retain_versions)


def _any_rank(env: DistEnv, flag: bool) -> bool:
    """Whether any rank's ``flag`` is set (one small all-reduce a step; none on one rank)."""
    return all_reduce_sum(env, [1.0 if flag else 0.0])[0] > 0


def train(
    cfg: TrainConfig,
    data_dir: Path,
    model: str,
    out: Path,
    env: DistEnv,
    *,
    resume: bool = True,
    tensorboard_dir: Path | None = None,
    stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train on every sample under ``data_dir``; resumable from ``out/checkpoints``. All ranks call
    it. With ``tensorboard_dir``, rank 0 writes every step's scalars there (``learner/scalars.py``).
    ``stop`` is asked before every step (all ranks pass one or none; the ranks stop together when
    any asks)."""
    samples = read_samples(data_dir)
    cfg = _with_schedule_length(cfg, len(samples))
    model_dir = resolve_model(model)
    out = Path(out)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg), indent=1))
    log.info(
        "train.start",
        samples=len(samples),
        model=str(model_dir),
        world_size=env.world_size,
        config=msgspec.to_builtins(cfg),
    )
    trainer = Trainer(cfg.trainer, model_dir, env)
    ckpt = latest_checkpoint(out / "checkpoints") if resume else None
    progress = load_checkpoint(ckpt, trainer) if ckpt is not None else Progress()
    last_loss: float | None = None
    stopped = False
    metrics = (out / "metrics.jsonl").open("a", encoding="utf-8") if env.is_main else None
    scalars: ScalarWriter = (
        open_scalar_writer(tensorboard_dir) if env.is_main else NullScalarWriter()
    )
    try:
        for batch in iter_batches(
            samples, cfg, start_epoch=progress.epoch, start_position=progress.position
        ):
            if cfg.max_steps and trainer.step >= cfg.max_steps:
                break
            if stop is not None and _any_rank(
                env, stop()
            ):  # before a step: the last one still exports
                stopped = True
                break
            stats = trainer.train_step(batch.samples)
            last_loss = stats.loss
            progress = Progress(
                step=trainer.step,
                epoch=batch.epoch,
                position=batch.position,
                samples_trained=progress.samples_trained + stats.samples,
            )
            if metrics is not None:
                metrics.write(
                    json.dumps({"epoch": batch.epoch, **msgspec.to_builtins(stats)}) + "\n"
                )
                metrics.flush()
            log.info("train.step", epoch=batch.epoch, **msgspec.to_builtins(stats))
            write_step_scalars(scalars, stats, epoch=batch.epoch)
            _after_step(trainer, cfg, out, progress)
    finally:
        scalars.close()
        if metrics is not None:
            metrics.close()
    latest = latest_checkpoint(out / "checkpoints")
    if latest is None or latest.name != f"step_{trainer.step:08d}":
        save_checkpoint(out / "checkpoints", trainer, progress, keep=cfg.trainer.keep_checkpoints)
    if stopped:
        log.info(
            "train.stopped", steps=trainer.step, checkpoint=str(out / "checkpoints"), resumable=True
        )
        return TrainResult(
            steps=trainer.step, final_dir="", final_sha256="", last_loss=last_loss, stopped=True
        )
    digest = trainer.export(
        out / "final", version=f"final-step{trainer.step}", extra={"learner_step": trainer.step}
    )
    log.info("train.finished", steps=trainer.step, final=str(out / "final"), sha256=digest)
    return TrainResult(
        steps=trainer.step, final_dir=str(out / "final"), final_sha256=digest, last_loss=last_loss
    )
