"""``leafe train``: offline Stage-2 training on rebuilt dataset shards (``leafe replay`` output).

    leafe train --data runs/r1/dataset --model smollm2-135m-instruct --out runs/r1/train --preset cpu
    torchrun --nproc_per_node=2 -m services.train --data DIR --model DIR --out DIR     # FSDP2 over 2 ranks

Writes under ``--out``: ``checkpoints/`` (DCP; a rerun resumes from the latest unless ``--no-resume``),
``weights/v<N>/`` every ``push_every`` steps, ``final/`` (HF safetensors + manifest) at the end,
``metrics.jsonl`` (one :class:`learner.trainer.StepStats` per step) and ``config.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

if TYPE_CHECKING:
    from learner.checkpoint import Progress
    from learner.config import TrainConfig
    from learner.distributed import DistEnv
    from learner.trainer import Trainer

__all__ = ["TrainResult", "build_parser", "main", "train"]

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


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``leafe train``."""
    p = argparse.ArgumentParser(prog="leafe train", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory of *.jsonl sample shards")
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="HF model dir, 'tiny' or the default name"
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (checkpoints, weights, metrics)")
    p.add_argument("--preset", default="paper", help="config preset: paper (lr 1e-6, batch 128) or cpu")
    p.add_argument("--config", type=Path, default=None, help="TOML file overriding the preset (TrainConfig)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step (all ranks)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--beta", type=float, default=None, help="weight of the rehearsal loss")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--push-every", type=int, default=None, help="export weights every N steps (0 = end only)")
    p.add_argument("--export-dtype", choices=["bf16", "fp32"], default=None)
    p.add_argument("--bucketing", choices=["length", "none"], default=None)
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints under --out")
    p.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    p.add_argument("--log-level", default="info")
    p.add_argument("--console", action="store_true", help="readable console logs instead of JSON")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "trainer.optim.lr": args.lr,
        "trainer.batch.global_batch": args.global_batch,
        "trainer.batch.bucketing": args.bucketing,
        "trainer.loss.beta": args.beta,
        "trainer.checkpoint_every": args.checkpoint_every,
        "trainer.push_every": args.push_every,
        "trainer.export_dtype": args.export_dtype,
    }


def _with_schedule_length(cfg: TrainConfig, n_samples: int) -> TrainConfig:
    from learner.offline import steps_per_epoch

    total = cfg.epochs * steps_per_epoch(n_samples, cfg.trainer.batch.global_batch, cfg.drop_last)
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    if cfg.trainer.optim.total_steps:
        return cfg
    optim = msgspec.structs.replace(cfg.trainer.optim, total_steps=total)
    return msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, optim=optim))


def _after_step(trainer: Trainer, cfg: TrainConfig, out: Path, progress: Progress) -> None:
    from learner.checkpoint import save_checkpoint
    from learner.weight_store import prune_versions, version_name

    tc = cfg.trainer
    if tc.checkpoint_every and trainer.step % tc.checkpoint_every == 0:
        save_checkpoint(out / "checkpoints", trainer, progress, keep=tc.keep_checkpoints)
    if tc.push_every and trainer.step % tc.push_every == 0:
        version = version_name(trainer.step)
        trainer.export(out / "weights" / version, version=version, extra={"learner_step": trainer.step})
        if trainer.env.is_main:
            prune_versions(out / "weights", tc.retain_versions)


def train(
    cfg: TrainConfig, data_dir: Path, model: str, out: Path, env: DistEnv, *, resume: bool = True
) -> TrainResult:
    """Train on every sample under ``data_dir``; resumable from ``out/checkpoints``. All ranks call it."""
    from learner.checkpoint import Progress, latest_checkpoint, load_checkpoint, save_checkpoint
    from learner.model_io import resolve_model
    from learner.offline import iter_batches, read_samples
    from learner.trainer import Trainer

    samples = read_samples(data_dir)
    cfg = _with_schedule_length(cfg, len(samples))
    model_dir = resolve_model(model)
    out = Path(out)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg), indent=1))
    log.info("train.start", samples=len(samples), model=str(model_dir), world_size=env.world_size,
             config=msgspec.to_builtins(cfg))  # fmt: skip
    trainer = Trainer(cfg.trainer, model_dir, env)
    ckpt = latest_checkpoint(out / "checkpoints") if resume else None
    progress = load_checkpoint(ckpt, trainer) if ckpt is not None else Progress()
    last_loss: float | None = None
    metrics = (out / "metrics.jsonl").open("a", encoding="utf-8") if env.is_main else None
    try:
        for batch in iter_batches(samples, cfg, start_epoch=progress.epoch, start_position=progress.position):
            if cfg.max_steps and trainer.step >= cfg.max_steps:
                break
            stats = trainer.train_step(batch.samples)
            last_loss = stats.loss
            progress = Progress(step=trainer.step, epoch=batch.epoch, position=batch.position,
                                samples_trained=progress.samples_trained + stats.samples)  # fmt: skip
            if metrics is not None:
                metrics.write(json.dumps({"epoch": batch.epoch, **msgspec.to_builtins(stats)}) + "\n")
                metrics.flush()
            log.info("train.step", epoch=batch.epoch, **msgspec.to_builtins(stats))
            _after_step(trainer, cfg, out, progress)
    finally:
        if metrics is not None:
            metrics.close()
    latest = latest_checkpoint(out / "checkpoints")
    if latest is None or latest.name != f"step_{trainer.step:08d}":
        save_checkpoint(out / "checkpoints", trainer, progress, keep=cfg.trainer.keep_checkpoints)
    digest = trainer.export(
        out / "final", version=f"final-step{trainer.step}", extra={"learner_step": trainer.step}
    )
    log.info("train.finished", steps=trainer.step, final=str(out / "final"), sha256=digest)
    return TrainResult(
        steps=trainer.step, final_dir=str(out / "final"), final_sha256=digest, last_loss=last_loss
    )


def main(argv: list[str]) -> int:
    """Entry point of ``leafe train``."""
    args = build_parser().parse_args(argv)
    from learner.config import resolve_train_config
    from learner.distributed import distributed_env
    from services.logsetup import configure_logging

    configure_logging(json=not args.console, level=args.log_level)
    cfg = resolve_train_config(args.preset, args.config, **_overrides(args))
    with distributed_env(args.backend) as env:
        structlog.contextvars.bind_contextvars(rank=env.rank)
        result = train(cfg, args.data, args.model, args.out, env, resume=not args.no_resume)
    if env.is_main:
        print(msgspec.json.encode(result).decode())
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
