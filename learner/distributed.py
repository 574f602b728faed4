"""Process-group setup for the learner: torchrun ranks, or one plain-python rank through the same
code.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set)
every rank joins a gloo (CPU) or NCCL (GPU) group from the environment. Started as plain ``python``
the process creates a *one-rank* group on an in-process store, so FSDP2, DCP and the collectives in
the trainer run the identical code path with ``world_size == 1``.

    with distributed_env() as env:      # init, and destroy the group on exit if we created it
        trainer = Trainer(config, model_dir, env)
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

__all__ = [
    "DistEnv",
    "all_reduce_sum",
    "barrier",
    "distributed_env",
    "init_distributed",
    "shutdown",
]

Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    """Global rank (0 is the coordinator: exports weights, writes metadata, publishes)."""
    world_size: int
    """Number of ranks."""
    local_rank: int
    """Rank on this host (selects the GPU)."""
    device: torch.device
    """``cuda:<local_rank>`` with NCCL, else ``cpu``."""
    backend: Backend
    """Collective backend of the default group."""
    owns_group: bool
    """True when :func:`init_distributed` created the group (so :func:`shutdown` destroys it)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _pick_backend(requested: str | None) -> Backend:
    if requested in (None, "", "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {requested!r}; use auto, gloo or nccl")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' requested but no CUDA device is available; use gloo")
    return requested  # type: ignore[return-value]


def init_distributed(backend: str | None = None, *, timeout_s: float = 1800.0) -> DistEnv:
    """Join (or create) the default process group; idempotent when a group already exists."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_initialized():
        chosen: Backend = "nccl" if dist.get_backend() == "nccl" else "gloo"
        owns = False
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        chosen = _pick_backend(backend)
        if chosen == "nccl":
            torch.cuda.set_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        if world_size > 1 and not faulthandler.is_enabled():
            # a rank killed by a signal (SIGABRT, SIGSEGV) prints where each thread was
            faulthandler.enable()
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            # One plain-python rank: an in-process store, no ports, same collectives.
            dist.init_process_group(
                chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(chosen, rank=rank, world_size=world_size, timeout=timeout)
        owns = True
    device = torch.device(f"cuda:{local_rank}") if chosen == "nccl" else torch.device("cpu")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=chosen,
        owns_group=owns,
    )


def shutdown(env: DistEnv, *, clean: bool = True) -> None:
    """Destroy the default group if :func:`init_distributed` created it.

    On a ``clean`` exit every rank first meets at a barrier, so no rank tears its group down while
    another still works after the last collective (rank 0 writing the export): a gloo rank of
    ``leafe train`` that destroyed its group early aborted once in CI at exit ("terminate called
    without an active exception", SIGABRT after ``train.finished``). After an error there is no
    barrier: the other ranks may never come.
    """
    if env.owns_group and dist.is_initialized():
        if clean:
            barrier(env)
        dist.destroy_process_group()


@contextmanager
def distributed_env(backend: str | None = None) -> Iterator[DistEnv]:
    """``init_distributed`` for the duration of a ``with`` block."""
    env = init_distributed(backend)
    clean = False
    try:
        yield env
        clean = True
    finally:
        shutdown(env, clean=clean)


def barrier(env: DistEnv) -> None:
    """Wait for every rank (a no-op cost on one rank)."""
    if env.world_size > 1:
        dist.barrier()


def all_reduce_sum(env: DistEnv, values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks (float64 on the group's device)."""
    if env.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.tolist()]
