"""Resumable learner checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory ``<root>/step_<N:08d>/`` holds, sharded as FSDP holds them: the model and
AdamW state, the LR scheduler, each rank's torch RNG state, and :class:`Progress` (optimizer step,
the last samples-stream sequence trained, the offline epoch and position, the weight versions
pushed). It is written to ``.step_<N>.tmp`` and renamed when every rank has finished, then
``<root>/latest`` names it: a crash mid-write leaves the previous checkpoint as the latest. Older
checkpoints beyond ``keep`` are deleted. A process killed mid-write leaves its ``.step_<N>.tmp``
(as large as a checkpoint): :func:`remove_interrupted` deletes those on the next start. Resuming
restores everything, so the next step is the one an uninterrupted run would take.

    progress = load_latest(root, trainer)         # None on a fresh start
    save_checkpoint(root, trainer, Progress(step=trainer.step, samples_seq=seq), keep=2)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import msgspec
import structlog
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from leafe.learner.distributed import barrier
from leafe.learner.trainer import Trainer

__all__ = [
    "CheckpointError",
    "Progress",
    "latest_checkpoint",
    "load_checkpoint",
    "load_latest",
    "remove_interrupted",
    "save_checkpoint",
]

log = structlog.get_logger(__name__)
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (the message names the directory)."""


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    """Optimizer steps taken."""
    samples_seq: int = 0
    """Online: highest ``LEAFE_SAMPLES`` stream sequence consumed (trained or dropped); resume after
    it."""
    epoch: int = 0
    """Offline: current epoch (0-based)."""
    position: int = 0
    """Offline: samples of the current epoch's order already trained."""
    version_index: int = 0
    """Weight versions pushed so far (the latest is ``v<version_index:06d>``)."""
    samples_trained: int = 0
    """Samples trained in total."""
    samples_dropped: int = 0
    """Online: samples dropped as stale or unusable."""


def _name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The directory ``<root>/latest`` points to, or ``None`` when there is none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text(encoding="utf-8").strip()
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{pointer} names {path.name}, which is not a complete DCP checkpoint"
        )
    return path


def _state(trainer: Trainer, progress: Progress) -> dict[str, object]:
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": trainer.scheduler.state_dict(),
        "progress": msgspec.json.encode(progress).decode(),
        f"rng_rank{trainer.env.rank}": torch.get_rng_state(),
    }


def save_checkpoint(root: Path, trainer: Trainer, progress: Progress, *, keep: int = 2) -> Path:
    """Write a checkpoint of ``trainer`` + ``progress`` (every rank calls); returns its
    directory."""
    root = Path(root)
    final = root / _name(progress.step)
    tmp = root / f".{final.name}.tmp"
    if trainer.env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(trainer.env)
    dcp.save(_state(trainer, progress), checkpoint_id=tmp)
    barrier(trainer.env)
    if trainer.env.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        pointer_tmp = root / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name, encoding="utf-8")
        pointer_tmp.replace(root / LATEST)
        _prune(root, keep=max(1, keep), newest=final.name)
    barrier(trainer.env)
    log.info(
        "leafe.learner.checkpoint.saved",
        path=str(final),
        step=progress.step,
        samples_seq=progress.samples_seq,
    )
    return final


def remove_interrupted(root: Path) -> list[str]:
    """Delete what a checkpoint killed mid-write left under ``root`` (``.step_<N>.tmp``, the
    ``.latest.tmp`` pointer); returns the paths removed. Only for a start, before any rank saves:
    it would delete a checkpoint being written."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        if p.name == f".{LATEST}.tmp" and not p.is_dir():
            p.unlink()
        elif p.is_dir() and re.fullmatch(r"\.step_\d+\.tmp", p.name):
            shutil.rmtree(p)
        else:
            continue
        removed.append(str(p))
    return removed


def _prune(root: Path, *, keep: int, newest: str) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / ".metadata").is_file())
    for old in done[:-keep]:
        if old.name != newest:
            shutil.rmtree(old)


def load_latest(root: Path, trainer: Trainer) -> Progress | None:
    """Restore the latest checkpoint under ``root`` into ``trainer``; ``None`` if there is none."""
    path = latest_checkpoint(Path(root))
    if path is None:
        return None
    return load_checkpoint(path, trainer)


def load_checkpoint(path: Path, trainer: Trainer) -> Progress:
    """Restore model, optimizer, scheduler, RNG and progress from the DCP checkpoint at ``path``."""
    state = _state(trainer, Progress())
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    rng_key = f"rng_rank{trainer.env.rank}"
    if rng_key not in keys:  # resumed on more ranks than saved: keep this rank's seeded RNG
        state.pop(rng_key)
    try:
        dcp.load(state, checkpoint_id=path)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot load checkpoint {path}: {e}") from e
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],  # type: ignore[arg-type]
        optim_state_dict=state["optim"],  # type: ignore[arg-type]
    )
    trainer.scheduler.load_state_dict(state["scheduler"])  # type: ignore[arg-type]
    if rng_key in state:
        torch.set_rng_state(state[rng_key])  # type: ignore[arg-type]
    progress = msgspec.json.decode(str(state["progress"]), type=Progress)
    trainer.step = progress.step
    log.info(
        "leafe.learner.checkpoint.loaded",
        path=str(path),
        step=progress.step,
        samples_seq=progress.samples_seq,
    )
    return progress
