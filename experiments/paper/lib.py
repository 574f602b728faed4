"""Service plumbing of the paper table: collect episodes through the actor service, export their
log, evaluate Pass@k through the inference server, read back what the log says.

Every collection is its own run in the embedded nats-server's log (``<work>/nats``) and is exported
compressed (``leafe log export`` format) right after it finishes, so every dataset can be rebuilt
from the repository alone: ``leafe replay --from <file> --materializer ...`` (the training phases do
exactly that, ``experiments/paper/children.py``). Evaluations stay in the store only (they are not
training data).
"""

from __future__ import annotations

import asyncio
import json
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
    "load_weights",
    "phase_done",
    "run_stats",
    "save_phase",
    "server_stats",
]

log = structlog.get_logger(__name__)


@dataclass
class Ctx:
    """What the phases share: work dir, NATS, the engine client, tokenizer, base model, settings."""

    work: Path
    """``runs/paper/<name>``: one directory per phase."""
    logs: Path
    """Where collection logs are exported (``experiments/results/paper_logs/<name>``)."""
    nats_url: str
    js: Any
    engine: Any
    tokenizer: Any
    base_model: Path
    env: str
    concurrency: int
    served: str = "base"
    """Weight version the servers serve now (reloads are skipped when it already matches)."""


def phase_done(work: Path, phase: str) -> dict[str, Any] | None:
    """The recorded result of ``phase`` if it finished in an earlier (or this) invocation."""
    path = work / phase / "done.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def save_phase(work: Path, phase: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """Record ``phase`` as finished with ``result``; returns it."""
    out = work / phase
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "done.json.tmp"
    tmp.write_text(json.dumps(dict(result), indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(
        out / "done.json"
    )  # atomic: a half-written done.json would skip an unfinished phase
    scalars = {k: v for k, v in result.items() if isinstance(v, int | float | str)}
    log.info("paper.phase.done", phase=phase, **scalars)
    return dict(result)


async def load_weights(ctx: Ctx, model_dir: Path, version: str) -> None:
    """Make the inference servers serve ``model_dir`` as ``version`` (no-op if they already do)."""
    if ctx.served == version:
        return
    results = await ctx.engine.update_weights_from_disk(str(model_dir), version)
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"update_weights_from_disk({model_dir}) failed: {bad}")
    ctx.served = version


async def run_stats(
    ctx: Ctx, run_id: str, keys: set[str] | None = None, examples: int = 3
) -> dict[str, Any]:
    """What the log of ``run_id`` holds: episodes by task, actions, successes, what the trees did
    (branches, reflections, rolled-back branches that solved their task, a few experiences), and the
    engine requests by kind with their prefix-cache share (``leafe log inspect``'s)."""
    from leafe.protocol.events import (
        Branch,
        EpisodeFinished,
        EpisodeStarted,
        Outcome,
        Reflection,
        Step,
    )
    from leafe.services.eventlog.inspect import EngineUsage, request_kind

    started: dict[str, EpisodeStarted] = {}
    branched: set[str] = set()
    eps: dict[str, dict[str, Any]] = {}
    tree = {
        "branches": 0,
        "reflections": 0,
        "parse_failures": 0,
        "branch_outcomes": 0,
        "branch_successes": 0,
    }
    texts: list[dict[str, Any]] = []
    engine: dict[str, EngineUsage] = {}
    async for ev in _events(ctx, run_id):
        mode = started[ev.episode_id].mode if ev.episode_id in started else ""
        if isinstance(ev, Step | Reflection) and (request := request_kind(ev, mode)) is not None:
            engine.setdefault(request, EngineUsage()).add(ev)
        if isinstance(ev, EpisodeStarted):
            started[ev.episode_id] = ev
        elif isinstance(ev, Reflection) and ev.experience and len(texts) < examples:
            texts.append({"tau": ev.tau, "source": ev.source, "experience": ev.experience[:300]})
        elif isinstance(ev, Branch):
            branched.add(ev.branch_id + "@" + ev.episode_id)
        elif isinstance(ev, Outcome) and ev.branch_id + "@" + ev.episode_id in branched:
            tree["branch_outcomes"] += 1
            tree["branch_successes"] += int(ev.success)
        elif isinstance(ev, EpisodeFinished) and ev.episode_id in started:
            st = started[ev.episode_id]
            if keys is not None and st.task_key not in keys:
                continue
            eps[st.task_key] = {
                "task_id": st.task_id,
                "success": bool(ev.success),
                "actions": int(ev.actions),
            }
            eps[st.task_key]["replay_steps"] = int(ev.replay_steps)
            tree["branches"] += ev.branches - 1
            tree["reflections"] += ev.reflections
            tree["parse_failures"] += ev.parse_failures
    per_task: dict[str, list[bool]] = {}
    for v in eps.values():
        per_task.setdefault(v["task_id"], []).append(v["success"])
    return {
        "episodes": len(eps),
        "actions": sum(v["actions"] for v in eps.values()),
        "replay_steps": sum(v["replay_steps"] for v in eps.values()),
        "successful_episodes": sum(v["success"] for v in eps.values()),
        "tasks_solved": sum(any(s) for s in per_task.values()),
        "per_task": per_task,
        "tree": {**tree, "experiences": texts},
        "engine": {kind: usage.as_dict() for kind, usage in engine.items()},
    }


async def _events(ctx: Ctx, run_id: str) -> Any:
    from leafe.services.eventlog.transfer import iter_stream_events

    async for ev in iter_stream_events(ctx.js, run_id):
        yield ev


async def collect(
    ctx: Ctx,
    *,
    name: str,
    run_id: str,
    mode: str,
    task_ids: Sequence[str],
    samples: int,
    seed: int,
    env_options: Mapping[str, Any],
    actor_overrides: Mapping[str, Any],
    timeout_s: float,
) -> dict[str, Any]:
    """Submit ``samples`` assignments per train task to ``run_id``, run an in-process actor service
    on them until every one finished (or ``timeout_s``), export the run's log to
    ``<logs>/<name>.leafelog.gz``; returns budget, success and tree figures from the log."""
    from leafe.actors.config import ActorServiceConfig
    from leafe.services.actor.main import run_actor
    from leafe.services.admin.tasks import make_assignments, submit
    from leafe.services.eventlog.transfer import export_run

    batch = make_assignments(
        run_id=run_id,
        env=ctx.env,
        task_ids=task_ids,
        mode=mode,  # type: ignore[arg-type]
        split="train",
        samples=samples,
        seed=seed,
        env_options=env_options,
    )
    keys = {a.task_key for a in batch}
    # a resumed collection submits only what an earlier invocation did not finish
    n = await submit(ctx.js, batch, skip=await _finished_keys(ctx, run_id) & keys)
    t0 = time.monotonic()
    if n:
        config = msgspec.convert(
            {"concurrency": ctx.concurrency, **actor_overrides}, ActorServiceConfig
        )
        stop = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(timeout_s, stop.set)
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
    wall = time.monotonic() - t0
    stats = await run_stats(ctx, run_id, keys)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    out = ctx.logs / f"{name}.leafelog.gz"
    events = await export_run(ctx.js, run_id, out)
    return {
        "run_id": run_id,
        "mode": mode,
        "tasks": len(task_ids),
        "task_range": [task_ids[0], task_ids[-1]],
        "samples_per_task": samples,
        "episodes_expected": len(keys),
        "submitted": n,
        "env_options": dict(env_options),
        "actor_overrides": dict(actor_overrides),
        "log_file": str(out),
        "log_events": events,
        "log_bytes": out.stat().st_size,
        "collect_wall_s": wall,
        **stats,
    }


async def _finished_keys(ctx: Ctx, run_id: str) -> set[str]:
    from leafe.protocol.events import EpisodeFinished, EpisodeStarted

    started: dict[str, str] = {}
    out: set[str] = set()
    async for ev in _events(ctx, run_id):
        if isinstance(ev, EpisodeStarted):
            started[ev.episode_id] = ev.task_key
        elif isinstance(ev, EpisodeFinished) and ev.episode_id in started:
            out.add(started[ev.episode_id])
    return out


async def evaluate_model(
    ctx: Ctx,
    *,
    label: str,
    model: Path,
    version: str,
    run_id: str,
    task_ids: Sequence[str],
    split: str,
    samples: int,
    ks: Sequence[int],
    seed: int,
    env_options: Mapping[str, Any],
    rollout_overrides: Mapping[str, Any],
    env: str = "",
) -> dict[str, Any]:
    """Pass@k of ``model`` on ``task_ids`` through the servers; the episodes go to ``run_id``'s
    log."""
    from leafe.actors.evaluate import EvalRequest, evaluate
    from leafe.services.actor.service import PublisherSink
    from leafe.services.bus import Publisher

    await load_weights(ctx, model, version)
    request = EvalRequest(
        env=env or ctx.env,
        env_options=dict(env_options),
        task_ids=list(task_ids),
        split=split,
        samples=samples,
        ks=[k for k in ks if k <= samples],
        run_id=run_id,
        label=label,
        concurrency=ctx.concurrency,
        seed=seed,
        rollout_overrides=dict(rollout_overrides),
    )
    async with Publisher(ctx.js) as pub:
        result = await evaluate(
            request, engine=ctx.engine, tokenizer=ctx.tokenizer, sink=PublisherSink(pub)
        )
        await pub.flush()
    out = msgspec.to_builtins(result)
    out["passk"] = {str(k): v for k, v in result.passk.items()}
    out.update(seed=seed, env_options=dict(env_options), rollout_overrides=dict(rollout_overrides))
    return out


async def server_stats(url: str, api_key_file: str = "") -> dict[str, Any]:
    """The inference server's own counters (``/get_server_info`` ``internal_states``) for the
    report."""
    import aiohttp

    from leafe.services.inference.auth import read_api_key

    headers = {"Authorization": f"Bearer {read_api_key(api_key_file)}"} if api_key_file else {}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/get_server_info", headers=headers) as resp,
        ):
            info = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    states = info.get("internal_states") or [{}]
    return dict(states[0]) if isinstance(states[0], dict) else {}
