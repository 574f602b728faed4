"""The ``leafe replay`` and ``leafe train`` children of the paper table, and dataset filtering.

Each runs as ``python -m leafe.services.cli <verb>`` from the repository root (niced,
``OMP_NUM_THREADS`` = ``training.threads``), inheriting ``PYTHONPATH``: started from a worktree with
``PYTHONPATH=<worktree>`` they run that worktree's code. The datasets are rebuilt from the exported
log files (not from the live store), which proves on every run that the committed logs rebuild the
training sets.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "REPO",
    "combine",
    "epoch_weights",
    "filter_samples",
    "global_batch",
    "kind_counts",
    "replay",
    "run_logged",
    "step_records",
    "train",
]

REPO = Path(__file__).resolve().parents[2]


async def run_logged(
    cmd: Sequence[str], log_file: Path, env: Mapping[str, str], grace_s: float = 10.0
) -> int:
    """Run ``cmd`` from the repository root with its output in ``log_file``; returns its exit code.
    The child never outlives this process (``leafe.services.lifetime``); cancelled, it is sent
    SIGTERM, then SIGKILL after ``grace_s``, and waited for before the cancellation goes on."""
    from leafe.services.lifetime import die_with_parent

    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w", encoding="utf-8") as f:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=dict(env),
            preexec_fn=die_with_parent,
        )
    try:
        return await proc.wait()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(proc.wait())
            except TimeoutError:
                proc.kill()
                await asyncio.shield(proc.wait())


TRAIN_GRACE_S = 300.0
"""How long a cancelled ``leafe train`` child gets to finish its step and checkpoint it (SIGTERM
stops it there: ``services/learner/train.py``) before SIGKILL; a CPU step of the paper's trainings
takes up to ~40 s."""


async def _leafe(args: Sequence[str], log_file: Path, threads: int, grace_s: float = 10.0) -> None:
    """Run ``leafe <args>`` with its output in ``log_file``; errors name the command and the log."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = ["nice", "-n", "5", sys.executable, "-m", "leafe.services.cli", *args]
    code = await run_logged(cmd, log_file, env, grace_s=grace_s)
    if code != 0:
        tail = (await asyncio.to_thread(log_file.read_text, encoding="utf-8", errors="replace"))[
            -2000:
        ]
        raise RuntimeError(
            f"leafe {' '.join(args[:1])} {exit_description(code)}; log {log_file}:\n{tail}"
        )


def exit_description(code: int) -> str:
    """``exited N``, or the signal that killed the process (SIGKILL: perhaps the kernel's OOM
    killer)."""
    from leafe.services.learner.train import EXIT_STOPPED

    if code == EXIT_STOPPED:
        return (
            f"exited {code} (stopped by a signal after checkpointing its last step: "
            "run again to resume)"
        )
    if code >= 0:
        return f"exited {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    oom = (
        " (the kernel's out-of-memory killer sends it: see `dmesg`)"
        if -code == signal.SIGKILL
        else ""
    )
    return f"was killed by {name}{oom}"


def replay_command(
    source: Path, materializer: str, model: str, out: Path, config: Path
) -> list[str]:
    """The ``leafe replay`` arguments that rebuild a dataset from an exported log file."""
    return [
        "replay",
        "--from",
        str(source),
        "--materializer",
        materializer,
        "--model",
        model,
        "--out",
        str(out),
        "--config",
        str(config),
        "--no-progress",
    ]


async def replay(
    *,
    source: Path,
    materializer: str,
    model: Path,
    out: Path,
    options: Mapping[str, Any],
    threads: int,
) -> int:
    """``leafe replay --from <source>`` into ``out``; returns the sample count."""
    import tomli_w

    out.parent.mkdir(parents=True, exist_ok=True)
    conf = out.parent / f"{out.name}.replay.toml"
    conf.write_text(tomli_w.dumps({"options": dict(options)}), encoding="utf-8")
    args = replay_command(source, materializer, str(model), out, conf)
    await _leafe(args, out.parent / f"{out.name}.replay.log", threads)
    return sum(1 for _ in _iter(out))


def _iter(data: Path) -> Any:
    from leafe.learner.offline import iter_shard_samples

    return iter_shard_samples(data)


def filter_samples(
    src: Path, dst: Path, *, kinds: Sequence[str] = (), task_ids: Sequence[str] = ()
) -> int:
    """Copy the samples of ``kinds`` (all if empty) from tasks ``task_ids`` (all if empty) from
    dataset ``src`` into one shard under ``dst``; returns how many."""
    dst.mkdir(parents=True, exist_ok=True)
    keep_tasks = set(task_ids)
    n = 0
    with (dst / "part-0.jsonl").open("wb") as f:
        for s in _iter(src):
            if (not kinds or s.kind in kinds) and (not keep_tasks or s.task_id in keep_tasks):
                f.write(msgspec.json.encode(s) + b"\n")
                n += 1
    return n


def combine(parts: Sequence[Path], dst: Path) -> int:
    """Every sample of the datasets ``parts``, in order, into one shard under ``dst``; returns how
    many."""
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    with (dst / "part-0.jsonl").open("wb") as f:
        for part in parts:
            for s in _iter(part):
                f.write(msgspec.json.encode(s) + b"\n")
                n += 1
    return n


def global_batch(preset: str, trainer: Mapping[str, Any]) -> int:
    """Samples per optimizer step of a training with this preset and ``[trainer]`` table."""
    from leafe.learner.config import train_preset

    return int(
        trainer.get("batch", {}).get("global_batch")
        or train_preset(preset).trainer.batch.global_batch
    )


def kind_counts(data: Path) -> dict[str, int]:
    """Samples per kind in a dataset."""
    out: dict[str, int] = {}
    for s in _iter(data):
        out[s.kind] = out.get(s.kind, 0) + 1
    return out


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def epoch_weights(
    out: Path, samples: int, global_batch: int, epoch: int, epochs: int, max_steps: int = 0
) -> Path:
    """Where a training of ``epochs`` epochs (at most ``max_steps`` steps, 0 = no cap) left the
    weights after ``epoch``: ``final`` for the last epoch and for any epoch the cap cut."""
    from leafe.learner.weight_store import version_name

    step = epoch * math.ceil(samples / global_batch)
    if epoch == epochs or (max_steps and step >= max_steps):
        return out / "final"
    return out / "weights" / version_name(step)


def step_records(metrics: Path) -> list[dict[str, Any]]:
    """The optimizer steps ``leafe train`` logged to ``metrics`` (appended to by every attempt), one
    per step: an attempt cut short and resumed (or restarted) logs some steps twice, and the last
    record of a step is the one the final weights descend from."""
    if not metrics.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in metrics.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


async def train(
    *,
    data: Path,
    model: Path,
    out: Path,
    preset: str,
    lr: float,
    epochs: int,
    beta: float | None,
    samples: int,
    trainer: Mapping[str, Any],
    export_epochs: bool,
    threads: int,
    keep_checkpoints: bool,
    max_steps: int = 0,
    checkpoint_every: int = 0,
) -> dict[str, Any]:
    """``leafe train`` of ``model`` on ``data`` into ``out``; returns steps, losses, wall and the
    weights (``final`` and, with ``export_epochs``, one directory per epoch). ``leafe train``
    resumes from the latest checkpoint under ``out`` (one every ``checkpoint_every`` steps), so a
    phase cut short goes on where it was; the step records are :func:`step_records` (the attempt
    that made the weights)."""
    import tomli_w

    t0 = time.monotonic()
    batch = global_batch(preset, trainer)
    resumable = {"checkpoint_every": checkpoint_every, "keep_checkpoints": 1}
    table: dict[str, Any] = {"trainer": {**trainer, **resumable, "push_every": 0}}
    if export_epochs:
        table["trainer"].update(push_every=math.ceil(samples / batch), retain_versions=epochs + 1)
    table.update({"max_steps": max_steps} if max_steps else {})
    conf = _write(out / "train.toml", tomli_w.dumps(table))
    args = [
        "train",
        "--data",
        str(data),
        "--model",
        str(model),
        "--out",
        str(out),
        "--preset",
        preset,
    ]
    args += ["--config", str(conf), "--lr", str(lr), "--epochs", str(epochs)]
    args += ["--beta", str(beta)] if beta is not None else []
    await _leafe(args, out / "train.log", threads, grace_s=TRAIN_GRACE_S)
    rows = step_records(out / "metrics.jsonl")
    if not keep_checkpoints:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    weights = {
        str(e): str(epoch_weights(out, samples, batch, e, epochs, max_steps))
        for e in range(1, epochs + 1)
    }
    if not export_epochs:
        weights = {str(epochs): str(out / "final")}
    missing = [w for w in weights.values() if not (Path(w) / "manifest.json").is_file()]
    if missing:
        raise RuntimeError(f"leafe train left no weights at {missing}; log {out / 'train.log'}")
    return {
        "final": str(out / "final"),
        "epoch_weights": weights,
        "steps": len(rows),
        "losses": [r["loss"] for r in rows],
        "tokens": sum(int(r.get("real_tokens", 0)) for r in rows),
        "trained_samples": sum(int(r.get("samples", 0)) for r in rows),
        "train_wall_s": time.monotonic() - t0,
        "config": table,
        "global_batch": batch,
    }
