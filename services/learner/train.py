"""``leafe train``: offline Stage-2 training on rebuilt dataset shards (``leafe replay`` output).

    leafe train --data runs/r1/dataset --model smollm2-135m-instruct --out runs/r1/train \\
        --preset cpu
    # FSDP2 over 2 ranks:
    torchrun --nproc_per_node=2 -m leafe.services.learner.train --data DIR --model DIR --out DIR

Writes under ``--out``: ``checkpoints/`` (DCP; a rerun resumes from the latest unless
``--no-resume``), ``weights/v<N>/`` every ``push_every`` steps, ``final/`` (HF safetensors +
manifest) at the end, ``metrics.jsonl`` (one :class:`leafe.learner.trainer.StepStats` per step),
``config.json`` and, when the ``tensorboard`` package is installed (extra ``tb``), TensorBoard
scalars in ``tensorboard/`` (``--tensorboard-dir`` to put them elsewhere; ``tensorboard --logdir
DIR`` shows them).

SIGTERM or Ctrl-C (a preempted node, a scheduler's time limit, ``kubectl delete``) stops the run
after the step it is in, with a checkpoint of it: exit code 75 (``EX_TEMPFAIL``: run the same
command again to resume); a second one ends it at once. Give the process a grace period of a step
and a checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

import msgspec
import structlog

from leafe.learner.config import TrainConfig, train_preset
from leafe.services.config import load_config
from leafe.services.logsetup import configure_logging

__all__ = ["EXIT_STOPPED", "build_parser", "main", "stop_on_signals"]

EXIT_STOPPED = 75
"""Exit code of a run stopped by a signal after checkpointing (sysexits' ``EX_TEMPFAIL``)."""

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``leafe train``."""
    p = argparse.ArgumentParser(prog="leafe train", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory of *.jsonl sample shards")
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="HF model dir, 'tiny' or the default name"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="output directory (checkpoints, weights, metrics)"
    )
    p.add_argument(
        "--preset", default="paper", help="config preset: paper (lr 1e-6, batch 128) or cpu"
    )
    p.add_argument(
        "--config", type=Path, default=None, help="TOML file overriding the preset (TrainConfig)"
    )
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument(
        "--global-batch", type=int, default=None, help="samples per optimizer step (all ranks)"
    )
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--beta", type=float, default=None, help="weight of the rehearsal loss")
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument(
        "--push-every", type=int, default=None, help="export weights every N steps (0 = end only)"
    )
    p.add_argument("--export-dtype", choices=["bf16", "fp32"], default=None)
    p.add_argument("--bucketing", choices=["pack", "length", "none"], default=None)
    p.add_argument(
        "--no-resume", action="store_true", help="ignore existing checkpoints under --out"
    )
    p.add_argument(
        "--tensorboard-dir",
        type=Path,
        default=None,
        help="TensorBoard scalars (default <out>/tensorboard)",
    )
    p.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = the free cores, see services/threads.py)",
    )
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


def resolve(args: argparse.Namespace) -> TrainConfig:
    """Preset, then ``--config``, then flags (``leafe.services.config.load_config``)."""
    return load_config(
        TrainConfig,
        preset=train_preset(args.preset),
        files=[args.config],
        overrides=_overrides(args),
    )


def torch_threads(threads: int) -> None:
    """Set torch's intra-op threads (imported here: ``--help`` stays instant)."""
    import torch

    torch.set_num_threads(threads)


def stop_on_signals() -> threading.Event:
    """An event the first SIGTERM or SIGINT sets (the training loop asks it before each step); the
    handler then steps aside, so a second signal acts as it would without it."""
    requested = threading.Event()

    def _request(signum: int, _frame: object) -> None:
        requested.set()
        signal.signal(
            signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler
        )

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _request)
    return requested


def main(argv: list[str]) -> int:
    """Entry point of ``leafe train``."""
    p = build_parser()
    args = p.parse_args(argv)
    configure_logging(json=not args.console, level=args.log_level)
    try:
        cfg = resolve(args)
    except ValueError as e:
        p.error(str(e))
    from leafe.learner.distributed import distributed_env  # torch: only once the flags are good
    from leafe.learner.offline import train
    from leafe.services.threads import default_threads

    threads, why = default_threads(args.threads)
    torch_threads(threads)
    log.info("train.threads", threads=threads, why=why)

    requested = stop_on_signals()
    with distributed_env(args.backend) as env:
        structlog.contextvars.bind_contextvars(rank=env.rank)
        tensorboard_dir = args.tensorboard_dir or args.out / "tensorboard"
        result = train(
            cfg,
            args.data,
            args.model,
            args.out,
            env,
            resume=not args.no_resume,
            tensorboard_dir=tensorboard_dir,
            stop=requested.is_set,
        )
    if env.is_main:
        print(msgspec.json.encode(result).decode())
    if result.stopped:
        log.warning(
            "train.stopped_by_signal", steps=result.steps, out=str(args.out), exit_code=EXIT_STOPPED
        )
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
