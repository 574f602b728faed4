"""What Stage 1 costs: LEAFE trees per CPU-minute with a real model behind real server processes, and what
the engine did for them; a part of ``bench/actor.py`` (row ``tree_cost``, issue #35 item 3).

The trees are the ``effect-hard`` experiment's (its explorer: reflect every 4 steps, depth 3, 8 branches,
120 actions, on after the first success up to 3 corrections; its rooms: 7x7, 5-12-move solutions, 30
steps, the last 2 steps in the prompt), grown by a model from the wheel (no warm start in a fresh clone)
on the first train rooms, seeded sampling, ``concurrency`` trees at a time, on a fleet of one-thread
server processes (one per free core, as the paper table serves). Figures:

- ``trees_per_cpu_minute``: trees over the CPU time of the servers and of this process (the actors)
  together, read from ``/proc``: the cost, whatever else the machine runs; ``trees_per_minute`` is wall.
- ``engine``: requests, prompt tokens, the share of them served from the prefix cache, and output tokens,
  per request kind (``root_step``, ``branch_step``, ``reflection``), summed from the events
  (``services/eventlog/inspect.py``), so the same figures come from any shipped log;
  ``servers``: each server's own counters (prefill and decode seconds and tokens).
- ``tree_digest``: sha256 of what the trees did (every step's and reflection's text, in episode order):
  a change meant to make trees cheaper must grow the same trees (same digest) to compare per tree.

    .venv/bin/python -m bench.actor_trees --trees 32            # ~10 min on 2 cores, prints and writes JSON
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from actors.config import ExplorerConfig
from actors.episode import EpisodeSpec, ListSink
from actors.explorer import Explorer
from bench.host import host_record
from envs.sokoban import SokobanConfig, SokobanEnv
from protocol.events import EpisodeEvent, Reflection, Step
from services.eventlog.inspect import EngineUsage, request_kind

__all__ = ["EXPLORER", "ROOMS", "tree_cost", "tree_digest"]

ROOMS = {
    "height": 7,
    "width": 7,
    "num_boxes": 1,
    "min_solution_len": 5,
    "max_solution_len": 12,
    "max_steps": 30,
}
"""``effect-hard``'s rooms (``7x7-l12-w2`` in ``bench/paper_effect-hard.toml``)."""
EXPLORER: dict[str, Any] = {
    "k": 4,
    "max_depth": 3,
    "max_branches": 8,
    "max_actions": 120,
    "stop_on_first_success": False,
    "max_corrections": 3,
    "experience_scope": "first_step",
    "horizon": 30,
    "history_window": 2,
    "seeded_sampling": True,
}
"""``effect-hard``'s Stage 1 tree (``[effect] explorer`` of ``bench/paper_effect.toml`` and
``bench/paper_effect-hard.toml``, with the rooms' horizon and history window)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_digest(events: list[EpisodeEvent]) -> str:
    """sha256 of the trees' decisions: each episode's steps and reflections (branch, t, text) in order."""
    h = hashlib.sha256()
    for e in sorted(events, key=lambda e: (e.episode_id, e.seq)):
        if isinstance(e, Step):
            h.update(f"{e.episode_id}|{e.branch_id}|{e.t}|{e.raw_text}\n".encode())
        elif isinstance(e, Reflection):
            h.update(f"{e.episode_id}|{e.branch_id}|r{e.at_t}|{e.raw_text}\n".encode())
    return h.hexdigest()


def engine_usage(events: list[EpisodeEvent]) -> dict[str, dict[str, Any]]:
    """Requests and tokens per request kind, as ``leafe log inspect`` sums them."""
    usage: dict[str, EngineUsage] = {}
    for e in events:
        if isinstance(e, Step | Reflection) and (kind := request_kind(e, "explore")) is not None:
            usage.setdefault(kind, EngineUsage()).add(e)
    return {kind: u.as_dict() for kind, u in sorted(usage.items())}


async def _grow(
    client: Any, tokenizer: Any, trees: int, concurrency: int, first_room: int
) -> list[EpisodeEvent]:
    rooms = SokobanConfig(**ROOMS)
    config = ExplorerConfig.for_env("sokoban", EXPLORER)
    tasks = SokobanEnv(rooms).tasks("train")[first_room : first_room + trees]
    if len(tasks) < trees:
        raise ValueError(f"only {len(tasks)} train rooms from {first_room}; asked for {trees} trees")
    sink = ListSink()
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, task_id: str) -> None:
        async with gate:
            spec = EpisodeSpec(
                run_id="bench-trees",
                episode_id=f"tree-{i:04d}.a1",
                actor_id="bench",
                task_key=f"tree-{i:04d}",
                env="sokoban",
                task_id=task_id,
                seed=i,
            )
            env = SokobanEnv(rooms)
            try:
                await Explorer(
                    engine=client, tokenizer=tokenizer, env=env, config=config, sink=sink, spec=spec
                ).run()
            finally:
                env.close()

    await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    return list(sink.events)


async def tree_cost(
    model: str, trees: int, *, concurrency: int = 8, servers: int = 0, dtype: str = "", first_room: int = 0
) -> dict[str, Any]:
    """Grow ``trees`` Stage 1 trees with ``model`` (a name :func:`learner.model_io.resolve_model` knows, or
    a directory) and measure them (see the module docstring)."""
    from actors.client import SGLangClient
    from bench.paper.lib import server_stats
    from learner.fsdp import cpu_has_native_bf16
    from learner.model_io import HFChatTokenizer, resolve_model
    from services.inference.fleet import FleetConfig, ServerFleet
    from services.threads import usable_cores

    model_dir = resolve_model(model)
    servers = servers or max(1, usable_cores())
    dtype = dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    tokenizer = HFChatTokenizer.from_dir(model_dir)
    async with ServerFleet(FleetConfig(model=str(model_dir), servers=servers, dtype=dtype)) as fleet:
        async with SGLangClient(fleet.urls, api_key_file=fleet.api_key_file) as client:
            before = {pid: cpu_seconds(pid) for pid in fleet.pids}
            own, start = time.process_time(), time.perf_counter()
            events = await _grow(client, tokenizer, trees, concurrency, first_room)
            wall = time.perf_counter() - start
            server_cpu = sum(cpu_seconds(pid) - t for pid, t in before.items())
            actor_cpu = time.process_time() - own
            stats = [await server_stats(url, fleet.api_key_file) for url in fleet.urls]
    cpu = server_cpu + actor_cpu
    steps = sum(isinstance(e, Step) for e in events)
    reflections = sum(isinstance(e, Reflection) for e in events)
    return {
        "model": model,
        "dtype": dtype,
        "servers": servers,
        "concurrency": concurrency,
        "trees": trees,
        "rooms": ROOMS,
        "explorer": EXPLORER,
        "steps": steps,
        "reflections": reflections,
        "wall_s": wall,
        "server_cpu_s": server_cpu,
        "actor_cpu_s": actor_cpu,
        "trees_per_cpu_minute": trees / (cpu / 60),
        "trees_per_minute": trees / (wall / 60),
        "engine": engine_usage(events),
        "servers_stats": stats,
        "tree_digest": tree_digest(events),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--trees", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    args = p.parse_args()
    result = {
        "host": host_record(),
        **asyncio.run(tree_cost(args.model, args.trees, concurrency=args.concurrency)),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("servers_stats",)}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
