"""Service plumbing of ``bench/paper_table.py``: collect episodes through the actor service, rebuild
datasets with ``leafe replay``, train with ``leafe train``, evaluate Pass@k through the inference server.

Every phase writes ``<work>/<phase>/done.json`` when it finishes; :func:`phase_done` reads it back, so a
rerun skips finished phases (resumable). Episodes live in the embedded nats-server's store under
``<work>/nats``: each collection phase is its own run id, so ``leafe replay --from <nats> --run <id>``
rebuilds its dataset at any time.

Not meant to be run directly; see ``bench/paper_table.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

__all__ = [
    "Ctx",
    "collect",
    "evaluate_model",
    "filter_kind",
    "load_weights",
    "phase_done",
    "replay",
    "save_phase",
    "server_stats",
    "set_threads",
    "train",
    "tree_stats",
]

log = structlog.get_logger(__name__)
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Ctx:
    """What the phases share: work dir, NATS, the engine client, tokenizer, base model dir, settings."""

    work: Path
    nats_url: str
    js: Any
    engine: Any
    tokenizer: Any
    base_model: Path
    env: str
    env_options: dict[str, Any]
    concurrency: int
    threads: int
    served: str = "base"


def phase_done(ctx: Ctx, phase: str) -> dict[str, Any] | None:
    """The recorded result of ``phase`` if it finished in an earlier (or this) invocation."""
    path = ctx.work / phase / "done.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def save_phase(ctx: Ctx, phase: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """Record ``phase`` as finished with ``result`` (plus nothing else); returns it."""
    out = ctx.work / phase
    out.mkdir(parents=True, exist_ok=True)
    (out / "done.json").write_text(json.dumps(dict(result), indent=1, default=str) + "\n", encoding="utf-8")
    log.info("paper.phase.done", phase=phase, **{k: v for k, v in result.items() if not isinstance(v, dict)})
    return dict(result)


async def load_weights(ctx: Ctx, model_dir: Path, version: str) -> None:
    """Make the inference server serve ``model_dir`` (no-op if it already does)."""
    if ctx.served == version:
        return
    results = await ctx.engine.update_weights_from_disk(str(model_dir), version)
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"update_weights_from_disk({model_dir}) failed: {bad}")
    ctx.served = version


async def _episodes(ctx: Ctx, run_id: str) -> dict[str, dict[str, Any]]:
    """Task key -> {task_id, success, actions, replay_steps} of every finished episode of ``run_id``."""
    from protocol.events import EpisodeFinished, EpisodeStarted
    from services.eventlog.transfer import iter_stream_events

    started: dict[str, EpisodeStarted] = {}
    out: dict[str, dict[str, Any]] = {}
    async for ev in iter_stream_events(ctx.js, run_id):
        if isinstance(ev, EpisodeStarted):
            started[ev.episode_id] = ev
        elif isinstance(ev, EpisodeFinished) and ev.episode_id in started:
            st = started[ev.episode_id]
            out[st.task_key] = {
                "task_id": st.task_id,
                "success": bool(ev.success),
                "actions": int(ev.actions),
                "replay_steps": int(ev.replay_steps),
            }
    return out


async def collect(
    ctx: Ctx,
    *,
    run_id: str,
    mode: str,
    task_ids: Sequence[str],
    samples: int,
    seed: int,
    actor_overrides: Mapping[str, Any],
    timeout_s: float,
) -> dict[str, Any]:
    """Submit ``samples`` assignments per train task to ``run_id`` and run an in-process actor service on
    them until every one finished (or ``timeout_s``); returns budget and success figures from the log."""
    from actors.config import ActorServiceConfig
    from services.actor import run_actor
    from services.tasks import make_assignments, submit

    batch = make_assignments(
        run_id=run_id,
        env=ctx.env,
        task_ids=task_ids,
        mode=mode,
        split="train",  # type: ignore[arg-type]
        samples=samples,
        seed=seed,
        env_options=ctx.env_options,
    )
    keys = {a.task_key for a in batch}
    done = await _episodes(ctx, run_id)
    n = await submit(ctx.js, batch, skip=set(done))
    t0 = time.monotonic()
    if n:
        config = msgspec.convert({"concurrency": ctx.concurrency, **actor_overrides}, ActorServiceConfig)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout_s, stop.set)
        try:
            await run_actor(
                nats=ctx.nats_url,
                run_id=run_id,
                tokenizer=ctx.tokenizer,
                engine=ctx.engine,
                config=config,
                actor_id=f"{run_id}-actor",
                stop=stop,
                max_tasks=n,
            )
        finally:
            timer.cancel()
    eps = {k: v for k, v in (await _episodes(ctx, run_id)).items() if k in keys}
    per_task: dict[str, list[bool]] = {}
    for v in eps.values():
        per_task.setdefault(v["task_id"], []).append(v["success"])
    return {
        "run_id": run_id,
        "mode": mode,
        "tasks": len(task_ids),
        "samples_per_task": samples,
        "episodes": len(eps),
        "episodes_expected": len(keys),
        "actions": sum(v["actions"] for v in eps.values()),
        "replay_steps": sum(v["replay_steps"] for v in eps.values()),
        "successful_episodes": sum(v["success"] for v in eps.values()),
        "tasks_solved": sum(any(s) for s in per_task.values()),
        "per_task": per_task,
        "wall_s": time.monotonic() - t0,
    }


def _leafe(args: Sequence[str], log_file: Path) -> None:
    """Run ``leafe <args>`` (niced) with its output in ``log_file``; errors name the command and log."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(ctx_threads()), "TOKENIZERS_PARALLELISM": "false"}
    cmd = ["nice", "-n", "5", sys.executable, "-m", "services.cli", *args]
    with log_file.open("w", encoding="utf-8") as f:
        code = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = log_file.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(cmd[3:6])} exited {code}; log {log_file}:\n{tail}")


_THREADS = {"n": 2}


def set_threads(n: int) -> None:
    """Torch threads of the ``leafe`` child processes."""
    _THREADS["n"] = max(1, n)


def ctx_threads() -> int:
    """Torch threads of the ``leafe`` child processes."""
    return _THREADS["n"]


async def replay(ctx: Ctx, *, run_id: str, materializer: str, out: Path, options: Mapping[str, Any]) -> int:
    """``leafe replay`` of ``run_id`` into ``out``; returns the sample count."""
    import tomli_w

    out.parent.mkdir(parents=True, exist_ok=True)
    conf = out.parent / f"{out.name}.replay.toml"
    conf.write_text(tomli_w.dumps({"options": dict(options)}), encoding="utf-8")
    args = [
        "replay",
        "--from",
        ctx.nats_url,
        "--run",
        run_id,
        "--materializer",
        materializer,
        "--model",
        str(ctx.base_model),
        "--out",
        str(out),
        "--config",
        str(conf),
        "--no-progress",
    ]
    await asyncio.to_thread(_leafe, args, out.parent / f"{out.name}.replay.log")
    return await asyncio.to_thread(_count_lines, out)


def _count_lines(data: Path) -> int:
    """Non-empty lines of every shard under ``data`` (= samples)."""
    n = 0
    for path in data.rglob("*.jsonl"):
        with path.open("rb") as f:
            n += sum(1 for line in f if line.strip())
    return n


def filter_kind(src: Path, dst: Path, kinds: Sequence[str]) -> int:
    """Copy the samples of ``kinds`` from dataset ``src`` into hand-made shards under ``dst``."""
    from learner.offline import iter_shard_samples

    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    with (dst / "part-0.jsonl").open("wb") as f:
        for s in iter_shard_samples(src):
            if s.kind in kinds:
                f.write(msgspec.json.encode(s) + b"\n")
                n += 1
    return n


async def train(
    ctx: Ctx, *, data: Path, model: Path, out: Path, train_args: Sequence[str], preset: str = "cpu"
) -> dict[str, Any]:
    """``leafe train --preset <preset>`` of ``model`` on ``data`` into ``out``; returns its result + wall."""
    t0 = time.monotonic()
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
        "--push-every",
        "0",
        *train_args,
    ]
    await asyncio.to_thread(_leafe, args, out.parent / f"{out.name}.train.log")
    metrics = out / "metrics.jsonl"  # written by the finished child process
    losses = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {
        "final": str(out / "final"),
        "steps": len(losses),
        "losses": losses,
        "wall_s": time.monotonic() - t0,
    }


async def evaluate_model(
    ctx: Ctx,
    *,
    label: str,
    model: Path,
    version: str,
    run_id: str,
    task_ids: Sequence[str],
    samples: int,
    ks: Sequence[int],
    seed: int,
    rollout_overrides: Mapping[str, Any],
) -> dict[str, Any]:
    """Pass@k of ``model`` on the test tasks through the server; episodes go to ``run_id``'s log."""
    from actors.evaluate import EvalRequest, evaluate
    from services.actor_service import PublisherSink
    from services.bus import Publisher

    await load_weights(ctx, model, version)
    request = EvalRequest(
        env=ctx.env,
        env_options=dict(ctx.env_options),
        task_ids=list(task_ids),
        split="test",
        samples=samples,
        ks=list(ks),
        run_id=run_id,
        label=label,
        concurrency=ctx.concurrency,
        seed=seed,
        rollout_overrides=dict(rollout_overrides),
    )
    async with Publisher(ctx.js) as pub:
        result = await evaluate(request, engine=ctx.engine, tokenizer=ctx.tokenizer, sink=PublisherSink(pub))
        await pub.flush()
    return msgspec.to_builtins(result)


async def server_stats(url: str) -> dict[str, Any]:
    """The inference server's own counters (``/get_server_info`` ``internal_states``) for the report."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/get_server_info") as resp:
            info = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    states = info.get("internal_states") or [{}]
    return dict(states[0]) if isinstance(states[0], dict) else {}


async def tree_stats(ctx: Ctx, run_id: str, examples: int = 3) -> dict[str, Any]:
    """What Stage 1 did in ``run_id``: branches, reflections, how many rolled-back branches succeeded,
    parse failures, and the first few experiences the policy wrote (to show their quality)."""
    from protocol.events import Branch, EpisodeFinished, Outcome
    from services.eventlog.transfer import iter_stream_events

    branched: set[str] = set()
    out: dict[str, Any] = {
        "episodes": 0,
        "branches": 0,
        "reflections": 0,
        "parse_failures": 0,
        "branch_outcomes": 0,
        "branch_successes": 0,
        "experiences": [],
    }
    async for ev in iter_stream_events(ctx.js, run_id):
        if isinstance(ev, Branch):
            branched.add(ev.branch_id)
            if len(out["experiences"]) < examples:
                out["experiences"].append(
                    {"tau": ev.tau, "depth": ev.depth, "experience": ev.experience[:300]}
                )
        elif isinstance(ev, Outcome) and ev.branch_id in branched:
            out["branch_outcomes"] += 1
            out["branch_successes"] += int(ev.success)
        elif isinstance(ev, EpisodeFinished):
            out["episodes"] += 1
            out["branches"] += ev.branches
            out["reflections"] += ev.reflections
            out["parse_failures"] += ev.parse_failures
    return out
