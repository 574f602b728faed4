"""Continual rounds of ``leafe run``: the task pool flows round after round while the learner
trains.

```
 warm start (explore.demos > 0): demonstrations ──► sft samples ──► learner; wait until trained
           then (eval.after_warm_start) Pass@k of its weights on the held-out tasks
 round r:  submit pool (seed + r * seed_stride) ──► actors (newest weights their engine serves)
           wait until every task of round r finished
             (continuous: learner trains and pushes all along;
              phased: then it trains the round, services/run/phases.py)
           every N rounds: Pass@k of the served version on the validation slice ──► a curve point
           stop: explore.rounds reached | max_learner_steps reached | budget_minutes (if set)
                 | Ctrl-C
```

Round r's task keys carry ``-r<r>`` (round 0 keeps the one-pass keys, so older run directories
resume), so JetStream's dedupe never swallows a later round, and a resumed run skips every task
whose episode already finished. The evaluator runs between rounds on the run's own engine while the
actors wait, so it never competes with them for the engine; its wall time is its cost and is
reported with each point.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from leafe.actors.evaluate import EvalResult
from leafe.envs.registry import make_env
from leafe.protocol.events import EpisodeFinished, EpisodeStarted
from leafe.protocol.tasks import TaskAssignment
from leafe.services.admin.tasks import make_assignments, submit
from leafe.services.eventlog.transfer import iter_stream_events
from leafe.services.run.context import RunContext
from leafe.services.run.launch import engine_threads
from leafe.services.run.phases import learner_cores, train_phase
from leafe.services.run.presets import RunConfig
from leafe.services.run.waits import wait_trained, watch

__all__ = [
    "CurvePoint",
    "RoundRecord",
    "budget_deadline",
    "demo_assignments",
    "explore_rounds",
    "task_ids",
]

log = structlog.get_logger(__name__)
Evaluate = Callable[[str, list[str], int, list[int], int], Awaitable[EvalResult]]
"""``(label, task ids, samples, ks, seed) -> result`` on the run's engine."""
HeldOut = Callable[[str], Awaitable[None]]
"""``(label) -> None``: Pass@k on the held-out tasks (``[eval]``), kept in ``ctx.evals``."""


class RoundRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One round of the explore pool."""

    round: int
    tasks: int
    """Assignments submitted (tasks x samples)."""
    finished: bool
    """Every assignment of the round finished (False: cut by the budget or a stop)."""
    wall_s: float
    episodes: int
    """Training episodes that finished during the round."""
    successes: int
    learner_step: int
    """The learner's step when the round ended."""
    weights_version: str
    """The newest version pushed when the round ended."""


class CurvePoint(msgspec.Struct, frozen=True, kw_only=True):
    """One point of the learning curve: the served version scored on the validation slice."""

    round: int
    """The round just finished (-1: after the warm start, before round 0)."""
    wall_s: float
    """Seconds since the run started, when the point was measured."""
    learner_step: int
    weight_version: str
    """Version the engine served at the evaluation's start."""
    policy_versions: list[str]
    """Every version stamped on the evaluation's steps (more than one: it changed
    mid-evaluation)."""
    passk: dict[int, float]
    parse_failure_rate: float
    eval_wall_s: float
    """What the point cost."""


def task_ids(cfg: RunConfig, split: str, offset: int, count: int) -> list[str]:
    """``count`` task ids of ``split`` from ``offset`` (an error if the split is shorter)."""
    env = make_env(cfg.env.name, **cfg.env.options)
    try:
        chosen = env.tasks(split)[offset : offset + count]
    finally:
        env.close()
    if len(chosen) < count:
        raise ValueError(f"{cfg.env.name} split {split!r} has no {count} tasks from {offset}")
    return chosen


async def finished_task_keys(ctx: RunContext) -> set[str]:
    """Task keys whose episode finished (read from the log: a resumed run skips them)."""
    keys: dict[str, str] = {}
    done: set[str] = set()
    async for ev in iter_stream_events(ctx.jetstream, ctx.config.run_id):
        if isinstance(ev, EpisodeStarted):
            keys[ev.episode_id] = ev.task_key
        elif isinstance(ev, EpisodeFinished) and ev.episode_id in keys:
            done.add(keys[ev.episode_id])
    return done


def demo_assignments(cfg: RunConfig) -> list[TaskAssignment]:
    """The warm start's demonstrations, ``explore.demo_epochs`` passes under distinct keys (pass 0
    keeps the one-pass keys, so older run directories resume)."""
    ex = cfg.explore
    demo_tasks = task_ids(cfg, "train", ex.demo_offset, ex.demos)
    return [
        a
        for e in range(ex.demo_epochs)
        for a in make_assignments(
            run_id=cfg.run_id,
            env=cfg.env.name,
            task_ids=demo_tasks,
            mode="demo",
            split="train",
            prefix="demo" if e == 0 else f"demo-e{e}",
            env_options=cfg.env.options,
        )
    ]


def budget_deadline(cfg: RunConfig) -> float:
    """``time.monotonic()`` at which the budget ends (infinity without one: work bounds the run)."""
    return time.monotonic() + 60 * cfg.budget_minutes if cfg.budget_minutes > 0 else math.inf


async def _warm_start(
    ctx: RunContext, read_learner: Callable[[], Awaitable[None]], deadline: float
) -> None:
    """The expert's demonstrations through the log, then wait until the learner trained them (every
    free core on the learner: the demonstrations need no engine). Phased: one pass at a time, each
    trained before the next is submitted."""
    cfg = ctx.config
    batch = demo_assignments(cfg)
    phased = cfg.explore.schedule == "phased"
    passes = cfg.explore.demo_epochs if phased else 1
    size = len(batch) // passes
    t0 = time.monotonic()
    await learner_cores(ctx, alone=True)
    for e in range(passes):
        ctx.enter("warm start")
        part = batch[e * size : (e + 1) * size]
        keys = [a.task_key for a in part]
        done = await finished_task_keys(ctx)
        n = await submit(ctx.jetstream, part, skip=done)
        ctx.console.print(
            f"warm start: submitted {n} demonstrations ({len(done & set(keys))} already done)"
        )
        if not await _wait(ctx, set(keys), deadline, f"warm start pass {e}"):
            break
        if phased:
            await train_phase(ctx, read_learner, f"warm start pass {e}")
        else:
            await wait_trained(ctx, read_learner)
    await engine_threads(ctx, shared=False)  # trained: the evaluations after it get every core
    ctx.timings["warm_start"] = time.monotonic() - t0
    assert ctx.progress is not None
    ctx.console.print(
        f"warm start trained: learner step {ctx.progress.learner_step}, weights "
        f"{ctx.progress.weights_version}"
    )


async def submit_round(ctx: RunContext, r: int) -> list[str]:
    """Submit round ``r`` of the pool (fresh seeds); returns its task keys."""
    cfg, ex = ctx.config, ctx.config.explore
    batch = make_assignments(
        run_id=cfg.run_id,
        env=cfg.env.name,
        task_ids=task_ids(cfg, "train", ex.offset, ex.tasks),
        mode=ex.mode,
        split="train",
        samples=ex.samples,
        seed=ex.seed + r * ex.seed_stride,
        prefix=ex.mode if r == 0 else f"{ex.mode}-r{r}",
        env_options=cfg.env.options,
    )
    keys = [a.task_key for a in batch]
    done = await finished_task_keys(ctx)
    n = await submit(ctx.jetstream, batch, skip=done)
    ctx.console.print(
        f"round {r}: submitted {n} {ex.mode} tasks ({len(done & set(keys))} already done)"
    )
    return keys


def _last_round(ctx: RunContext, r: int, finished: bool, deadline: float) -> bool:
    ex, p = ctx.config.explore, ctx.progress
    assert p is not None
    return (
        not finished
        or ctx.stop.is_set()
        or (ex.rounds > 0 and r + 1 >= ex.rounds)
        or (ex.max_learner_steps > 0 and p.learner_step >= ex.max_learner_steps)
        or time.monotonic() >= deadline
    )


async def _wait(ctx: RunContext, keys: set[str], deadline: float, what: str) -> bool:
    """Until every key finished (True), or the budget or a stop (False; a budget cut is recorded in
    ``ctx.cuts`` for the report)."""
    assert ctx.progress is not None
    while not keys <= ctx.progress.finished_keys:
        if ctx.stop.is_set():
            return False
        if time.monotonic() > deadline:
            cut = f"{what}: {len(keys & ctx.progress.finished_keys)} of {len(keys)} tasks finished"
            ctx.cuts.append(cut)
            ctx.console.print(f"[yellow]budget reached ({cut}): draining with tasks left[/yellow]")
            return False
        await watch(ctx)
        await asyncio.sleep(1.0)
    return True


async def _curve_point(ctx: RunContext, r: int, evaluate: Evaluate, started: float) -> None:
    cfg, ov = ctx.config, ctx.config.online_eval
    offset, count = cfg.validation_slice()
    assert ctx.progress is not None
    step = ctx.progress.learner_step
    label = "val-warm" if r < 0 else f"val-r{r}"
    result = await evaluate(
        label, task_ids(cfg, "train", offset, count), ov.samples, ov.ks, ov.seed
    )
    point = CurvePoint(
        round=r,
        wall_s=round(time.monotonic() - started, 1),
        learner_step=step,
        weight_version=result.weight_version,
        policy_versions=result.policy_versions,
        passk=result.passk,
        parse_failure_rate=result.parse_failure_rate,
        eval_wall_s=round(result.wall_s, 1),
    )
    ctx.curve.append(point)
    ctx.run_metrics.point(point.passk, point.parse_failure_rate, step)
    scores = ", ".join(f"pass@{k} {100 * v:.1f}%" for k, v in point.passk.items())
    ctx.console.print(
        f"validation after round {r} (learner step {step}, {point.weight_version}): {scores}, "
        f"unparseable {100 * point.parse_failure_rate:.0f}% ({point.eval_wall_s:.0f} s)"
    )
    log.info("run.curve.point", **msgspec.to_builtins(point))


async def explore_rounds(
    ctx: RunContext,
    evaluate: Evaluate,
    heldout: HeldOut,
    read_learner: Callable[[], Awaitable[None]],
    *,
    started: float,
) -> None:
    """The warm start (if any) and its evaluations, then the pool round after round until a stop
    condition (see the module docstring)."""
    cfg, ex, ov = ctx.config, ctx.config.explore, ctx.config.online_eval
    p = ctx.progress
    assert p is not None
    ctx.enter("exploring")
    deadline = budget_deadline(cfg)
    if ex.demos:
        await _warm_start(ctx, read_learner, deadline)
        if cfg.eval.after_warm_start and p.weights_version != "default" and not ctx.stop.is_set():
            await heldout(f"warm-{p.weights_version}")
        if ov.every_rounds and not ctx.stop.is_set():
            ctx.enter("validation after the warm start")
            await _curve_point(ctx, -1, evaluate, started)
        await learner_cores(ctx, alone=False)  # the actors' turn
    await _rounds(ctx, evaluate, read_learner, deadline, started)


async def _rounds(
    ctx: RunContext,
    evaluate: Evaluate,
    read_learner: Callable[[], Awaitable[None]],
    deadline: float,
    started: float,
) -> None:
    ex, ov = ctx.config.explore, ctx.config.online_eval
    p = ctx.progress
    assert p is not None
    r = 0
    while True:
        t0, episodes, wins = (
            time.monotonic(),
            p.episodes_finished.get(ex.mode, 0),
            p.successes.get(ex.mode, 0),
        )
        keys = await submit_round(ctx, r)
        ctx.explore_keys += keys
        ctx.enter(f"exploring round {r}")
        finished = await _wait(ctx, set(keys), deadline, f"round {r}")
        if finished and ex.schedule == "phased":
            await train_phase(ctx, read_learner, f"round {r}")
        record = RoundRecord(
            round=r,
            tasks=len(keys),
            finished=finished,
            wall_s=round(time.monotonic() - t0, 1),
            episodes=p.episodes_finished.get(ex.mode, 0) - episodes,
            successes=p.successes.get(ex.mode, 0) - wins,
            learner_step=p.learner_step,
            weights_version=p.weights_version,
        )
        ctx.rounds.append(record)
        log.info("run.round.finished", **msgspec.to_builtins(record))
        last = _last_round(ctx, r, finished, deadline)
        if ov.every_rounds and ((r + 1) % ov.every_rounds == 0 or last) and not ctx.stop.is_set():
            ctx.enter(f"validation after round {r}")
            await _curve_point(ctx, r, evaluate, started)
        if last:
            return
        r += 1
