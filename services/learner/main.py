"""``leafe learner``: online continual learning from ``LEAFE_SAMPLES`` with FSDP2, checkpoints,
pushes.

    leafe learner --nats nats://127.0.0.1:4222 --run r1 --model smollm2-135m-instruct \\
        --store runs/r1/weights --checkpoint-dir runs/r1/learner [--preset cpu] \\
        [--config learner.toml] [--metrics-port 9464] \\
        [--tensorboard-dir runs/r1/tensorboard/learner]
    # rank 0 reads the stream, all train:
    torchrun --nproc_per_node=2 -m leafe.services.learner.main --run-id r1 ...

(Under torchrun spell the run ``--run-id``: torchrun's own parser would take ``--run`` as an
abbreviation of its ``--run-path``.)

The loop itself (ordering, acks, exactly-once relative to checkpoints, pushes) is described in
``services/learner/service.py``. SIGTERM/SIGINT stop it gracefully: the current step finishes, a
final checkpoint is written and everything it covers is acked.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from leafe.learner.config import LearnerConfig, learner_preset
from leafe.protocol.subjects import validate_run_id
from leafe.services.bus import NatsOptions, add_nats_arguments, nats_options
from leafe.services.config import dump_config, load_config
from leafe.services.logsetup import configure_logging
from leafe.services.metrics import LearnerMetrics, add_metrics_arguments, serve_metrics

if TYPE_CHECKING:
    from leafe.learner.checkpoint import Progress
    from leafe.learner.distributed import DistEnv

__all__ = ["build_parser", "main", "run_learner"]

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``leafe learner``."""
    p = argparse.ArgumentParser(prog="leafe learner", description=__doc__.split("\n\n")[0])
    add_nats_arguments(p)
    p.add_argument(
        "--run", "--run-id", dest="run", required=True, help="run id (--run-id under torchrun)"
    )
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="HF model dir, 'tiny' or the default name"
    )
    p.add_argument(
        "--store",
        type=Path,
        required=True,
        help="weight store directory (versions are written here)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="DCP checkpoints (default: <store>/../learner)",
    )
    p.add_argument("--preset", default="cpu", help="trainer preset: cpu or paper")
    p.add_argument("--config", type=Path, default=None, help="TOML file with LearnerConfig fields")
    p.add_argument(
        "--kinds", default=None, help="comma-separated sample kinds to train (default cf,reh)"
    )
    p.add_argument("--stop-after-steps", type=int, default=None)
    p.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    p.add_argument("--log-level", default="info")
    p.add_argument("--console", action="store_true", help="readable console logs instead of JSON")
    p.add_argument(
        "--tensorboard-dir",
        type=Path,
        default=None,
        help="write TensorBoard scalars here (rank 0; needs [tb])",
    )
    p.add_argument(
        "--control",
        type=Path,
        default=None,
        help="JSON file leafe run writes: threads, and a phased run's released samples "
        "(control.py)",
    )
    add_metrics_arguments(p)
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    return {"kinds": kinds, "stop_after_steps": args.stop_after_steps}


def resolve(args: argparse.Namespace) -> LearnerConfig:
    """Preset, then ``--config``, then flags (``leafe.services.config.load_config``)."""
    return load_config(
        LearnerConfig,
        preset=learner_preset(args.preset),
        files=[args.config],
        overrides=_overrides(args),
    )


async def _serve(learner: Any) -> Progress:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await learner.run(stop)  # type: ignore[no-any-return]


def clear_interrupted_writes(store: Path, checkpoint_dir: Path) -> list[str]:
    """Remove the temporary directories a killed checkpoint (``.step_<N>.tmp``) or export
    (``.v<N>.<suffix>``) left; nothing else ever would, and each is as large as what it was
    writing. Rank 0 only, before any rank writes (the learner is the only writer of both)."""
    from leafe.learner.checkpoint import remove_interrupted
    from leafe.learner.weight_store import remove_partial_exports

    return remove_interrupted(checkpoint_dir) + remove_partial_exports(store)


def run_learner(
    cfg: LearnerConfig,
    env: DistEnv,
    *,
    run_id: str,
    nats: NatsOptions,
    model: str,
    store: Path,
    checkpoint_dir: Path,
    metrics: LearnerMetrics | None = None,
    tensorboard_dir: Path | None = None,
    control: Path | None = None,
) -> Progress:
    """Build the trainer on every rank, resume from the latest checkpoint, then lead (rank 0) or
    follow."""
    from leafe.learner.checkpoint import Progress, load_latest
    from leafe.learner.executor import Executor, StopCmd
    from leafe.learner.model_io import resolve_model
    from leafe.learner.scalars import open_scalar_writer
    from leafe.learner.trainer import Trainer
    from leafe.services.learner.control import ControlFile
    from leafe.services.learner.service import OnlineLearner

    if env.is_main:
        removed = clear_interrupted_writes(store, checkpoint_dir)
        if removed:
            log.warning("learner.start.removed_interrupted_writes", paths=removed)
    model_dir = resolve_model(model)
    trainer = Trainer(cfg.trainer, model_dir, env)
    progress = load_latest(checkpoint_dir, trainer) or Progress()
    executor = Executor(trainer, checkpoint_dir, keep_checkpoints=cfg.trainer.keep_checkpoints)
    if not env.is_main:
        executor.follow()
        return progress
    scalars = open_scalar_writer(tensorboard_dir)
    learner = OnlineLearner(
        cfg,
        executor,
        progress,
        run_id=run_id,
        nats=nats,
        store=store,
        base_model=str(model),
        metrics=metrics,
        scalars=scalars,
        control=ControlFile(control),
    )
    try:
        return asyncio.run(_serve(learner))
    finally:
        scalars.close()
        if env.world_size > 1:
            executor.submit(StopCmd())


def main(argv: list[str]) -> int:
    """Entry point of ``leafe learner``."""
    p = build_parser()
    args = p.parse_args(argv)
    configure_logging(json=not args.console, level=args.log_level)
    try:
        nats = nats_options(args)
        validate_run_id(args.run)
        cfg = resolve(args)
    except ValueError as e:
        p.error(str(e))
    if not nats.url:
        p.error("give --nats URL or set LEAFE_NATS_URL")
    from leafe.learner.distributed import distributed_env  # torch: only once the flags are good

    checkpoint_dir = args.checkpoint_dir or (args.store.resolve().parent / "learner")
    structlog.contextvars.bind_contextvars(run_id=args.run)
    log.info(
        "leafe.learner.config",
        config=dump_config(cfg),
        store=str(args.store),
        checkpoints=str(checkpoint_dir),
    )
    metrics = LearnerMetrics()
    serve_metrics(args.metrics_port, metrics.registry, args.metrics_host)  # LOCAL_RANK 0 only
    with distributed_env(args.backend) as env:
        structlog.contextvars.bind_contextvars(rank=env.rank)
        progress = run_learner(
            cfg,
            env,
            run_id=args.run,
            nats=nats,
            model=args.model,
            store=args.store,
            checkpoint_dir=checkpoint_dir,
            metrics=metrics,
            tensorboard_dir=args.tensorboard_dir,
            control=args.control,
        )
    if env.is_main:
        log.info("learner.stopped", **dump_config(progress))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
