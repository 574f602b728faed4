"""The stages of ``leafe run`` (see ``services/run/main.py`` for the picture): start, evaluate,
explore, drain, evaluate, finish. Each stage is a short coroutine over a shared :class:`RunContext`;
starting is ``services/run/launch.py``, draining ``services/run/drain.py``, the report
``services/run/report.py``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import structlog
from prometheus_client import generate_latest
from rich.live import Live

from leafe.actors.client import SGLangClient
from leafe.actors.evaluate import EvalRequest, EvalResult, evaluate
from leafe.learner.model_io import HFChatTokenizer
from leafe.services.actor.service import PublisherSink
from leafe.services.bus import Publisher
from leafe.services.bus.nats_server import free_port
from leafe.services.eval.scalars import write_curve_scalars, write_passk_scalars
from leafe.services.logsetup import configure_logging
from leafe.services.metrics import serve_metrics
from leafe.services.run.context import RunContext
from leafe.services.run.drain import drain, save_metrics
from leafe.services.run.launch import (
    check_identity,
    engine_threads,
    prepare_run_dir,
    start_infra,
    start_pipeline,
)
from leafe.services.run.orphans import lock_run, reap_orphans
from leafe.services.run.presets import RunConfig
from leafe.services.run.progress import RunProgress
from leafe.services.run.report import finish
from leafe.services.run.rounds import explore_rounds, task_ids

__all__ = ["run_stages"]

log = structlog.get_logger(__name__)
LINE_EVERY_S = 5.0
"""Non-terminal output: how often the progress line is considered (printed only when it changed)."""


def rollout_overrides(cfg: RunConfig) -> dict[str, Any]:
    """The actors' ``[actor.rollout]`` settings for this env ("*" first), so evaluation samples
    exactly as the actors' plain rollouts do."""
    tables = cfg.actor.rollout
    return {**tables.get("*", {}), **tables.get(cfg.env.name, {})}


async def _run_eval(
    ctx: RunContext,
    label: str,
    task_ids: list[str],
    samples: int,
    ks: list[int],
    seed: int,
    split: str,
) -> EvalResult:
    """Pass@k of the served weights on ``task_ids`` (``eval/<label>.json``; a resumed run reuses
    it)."""
    cfg = ctx.config
    path = ctx.run_dir / "eval" / f"{label}.json"
    if path.is_file():  # resumed run: this evaluation already finished
        return msgspec.json.decode(path.read_bytes(), type=EvalResult)
    request = EvalRequest(
        env=cfg.env.name,
        env_options=cfg.env.options,
        task_ids=task_ids,
        split=split,
        samples=samples,
        ks=ks,
        run_id=cfg.run_id,
        label=label,
        concurrency=cfg.eval.concurrency,
        seed=seed,
        rollout_overrides=rollout_overrides(cfg),
    )
    assert ctx.model_dir is not None
    tokenizer = HFChatTokenizer.from_dir(ctx.model_dir)
    engine_cfg = cfg.actor.engine
    if ctx.engine_key_file:
        engine_cfg = msgspec.structs.replace(engine_cfg, api_key_file=ctx.engine_key_file)
    client = SGLangClient.from_config(ctx.client_urls, engine_cfg)
    async with client as engine, Publisher(ctx.jetstream) as pub:
        result = await evaluate(
            request, engine=engine, tokenizer=tokenizer, sink=PublisherSink(pub)
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    return result


async def _evaluate(ctx: RunContext, label: str) -> None:
    """The before/after evaluation on the held-out split."""
    cfg, ev = ctx.config, ctx.config.eval
    ctx.enter(f"evaluating {label}")
    ids = task_ids(cfg, ev.split, 0, ev.tasks)
    fresh = not (ctx.run_dir / "eval" / f"{label}.json").is_file()
    result = await _run_eval(ctx, label, ids, ev.samples, ev.ks, ev.seed, ev.split)
    if fresh:
        await asyncio.to_thread(write_passk_scalars, ctx.tensorboard_dir / f"eval-{label}", result)
    ctx.evals[label] = result
    scores = ", ".join(f"pass@{k} {100 * v:.1f}%" for k, v in result.passk.items())
    ctx.console.print(f"eval {label}: {scores}")


async def _validate(
    ctx: RunContext, label: str, ids: list[str], samples: int, ks: list[int], seed: int
) -> EvalResult:
    """A learning-curve point on the validation slice (train split), with its TensorBoard
    scalars."""
    assert ctx.progress is not None
    step = ctx.progress.learner_step
    result = await _run_eval(ctx, label, ids, samples, ks, seed, "train")
    await asyncio.to_thread(write_curve_scalars, ctx.tensorboard_dir / "validation", result, step)
    return result


async def _explore(ctx: RunContext) -> None:
    async def validate(
        label: str, ids: list[str], samples: int, ks: list[int], seed: int
    ) -> EvalResult:
        return await _validate(ctx, label, ids, samples, ks, seed)

    async def heldout(label: str) -> None:
        await _unless_stopped(ctx, _evaluate(ctx, label))

    await explore_rounds(ctx, validate, heldout, lambda: _read_learner(ctx), started=ctx.started)


async def _read_learner(ctx: RunContext) -> None:
    url = ctx.metrics_urls.get("learner")
    if ctx.progress is not None and url is not None:
        await ctx.progress.read_learner(url)


async def _display(ctx: RunContext) -> None:
    """A live table on a terminal; elsewhere (CI, ``| tee``, a pod log) one line whenever the stage
    or a counter changed, at most every :data:`LINE_EVERY_S` seconds."""
    assert ctx.progress is not None
    started = time.monotonic()
    if ctx.live:
        with Live(ctx.progress.table(ctx.stage), console=ctx.console, refresh_per_second=2) as live:
            while True:
                await _read_learner(ctx)
                ctx.plan.update(ctx.progress)
                live.update(ctx.progress.table(ctx.stage, ctx.plan.line()))
                await asyncio.sleep(1.0)
    last: tuple[str, str] | None = None
    while True:
        await asyncio.sleep(LINE_EVERY_S)
        await _read_learner(ctx)
        ctx.plan.update(ctx.progress)
        now = (ctx.stage, ctx.progress.summary())
        if now != last:
            last = now
            line = ctx.progress.status_line(ctx.stage, time.monotonic() - started, ctx.plan.line())
            ctx.console.print(line, markup=False, highlight=False, soft_wrap=True)


async def _follow(ctx: RunContext, stop: asyncio.Event) -> None:
    """Keep the progress counters fed; if the subscription fails, say so and rebuild them from the
    log."""
    while not stop.is_set():
        old = ctx.progress
        assert old is not None
        try:
            await old.follow(ctx.jetstream, stop)
        except Exception as e:  # any failure of the follower: reported, then rebuilt from the log
            log.warning("run.progress.restart", error=f"{type(e).__name__}: {e}")
            ctx.console.print(
                f"[yellow]progress follower failed ({type(e).__name__}: {e}); rebuilding[/yellow]"
            )
            # Stream-fed counters restart from zero (the new subscription replays the log from its
            # start); the learner's come from its log file and carry over.
            ctx.progress = RunProgress(
                run_id=old.run_id,
                started_at=old.started_at,
                learner_step=old.learner_step,
                learner_loss=old.learner_loss,
                learner_samples_seq=old.learner_samples_seq,
            )
            await asyncio.sleep(1.0)


async def _unless_stopped(ctx: RunContext, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` but cancel it on Ctrl-C/SIGTERM (an unfinished evaluation is redone on
    resume)."""
    work = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(ctx.stop.wait())
    await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        ctx.console.print(
            "[yellow]interrupted: evaluation cancelled (it is redone on resume)[/yellow]"
        )
        return
    work.result()


async def _eval_before(ctx: RunContext) -> None:
    if ctx.config.eval.before and not ctx.stop.is_set():
        await _unless_stopped(ctx, _evaluate(ctx, "before"))


async def _eval_after(ctx: RunContext) -> None:
    assert ctx.progress is not None
    version = ctx.progress.weights_version
    if ctx.config.eval.after and version != "default" and not ctx.stop.is_set():
        await engine_threads(
            ctx, shared=False
        )  # drained: the learner is idle, the engine gets every core
        await _unless_stopped(ctx, _evaluate(ctx, f"after-{version}"))


async def _stages(ctx: RunContext) -> None:
    stages: dict[str, Callable[[], Awaitable[None]]] = {
        "eval_before": lambda: _eval_before(ctx),
        "start": lambda: start_pipeline(ctx),
        "explore": lambda: _explore(ctx),
        "drain": lambda: drain(ctx, lambda: _read_learner(ctx)),
        "eval_after": lambda: _eval_after(ctx),
    }
    for stage, run in stages.items():
        t0 = time.monotonic()
        await run()
        ctx.timings[stage] = time.monotonic() - t0


async def run_stages(ctx: RunContext, *, fresh: bool = False) -> None:
    """All stages, with every child process stopped on the way out (also on Ctrl-C and errors)."""
    cfg = ctx.config
    lock = lock_run(
        Path(cfg.runs_dir), cfg.run_id
    )  # held until this process exits, however it exits
    try:
        await _run_locked(ctx, fresh=fresh)
    finally:
        os.close(lock)


async def _run_locked(ctx: RunContext, *, fresh: bool) -> None:
    cfg = ctx.config
    orphans = reap_orphans(
        ctx.run_dir
    )  # a killed supervisor's children, before anything touches the dir
    if orphans:
        ctx.console.print(f"stopped what a killed supervisor left running: {', '.join(orphans)}")
    check_identity(ctx, fresh=fresh)
    prepare_run_dir(ctx)
    configure_logging(json=True, file=ctx.run_dir / "logs" / "run.jsonl")
    ctx.console.print(f"leafe run {cfg.run_id}: run directory {ctx.run_dir}", markup=False)
    ctx.console.print(
        f"TensorBoard: tensorboard --logdir {ctx.tensorboard_dir}", markup=False, highlight=False
    )
    started = ctx.started = time.monotonic()
    async with AsyncExitStack() as stack:
        await start_infra(ctx, stack)
        server = serve_metrics(free_port(), ctx.run_metrics.registry, host="127.0.0.1")
        if server is not None:
            stack.callback(server.close)
            ctx.metrics_urls["run"] = f"http://127.0.0.1:{server.port}/metrics"
        ctx.progress = RunProgress(run_id=cfg.run_id)
        follow_stop = asyncio.Event()
        follower = asyncio.create_task(_follow(ctx, follow_stop))
        display = asyncio.create_task(_display(ctx))
        try:
            await _stages(ctx)
            for name in [*ctx.engine_services, *(["router"] if ctx.router_url else [])]:
                await save_metrics(ctx, name)  # the other services' were saved as they stopped
            (ctx.run_dir / "metrics").mkdir(exist_ok=True)
            (ctx.run_dir / "metrics" / "run.prom").write_bytes(
                generate_latest(ctx.run_metrics.registry)
            )
            ctx.enter("finishing")
            ctx.timings["total"] = time.monotonic() - started
            await finish(ctx)
        finally:
            display.cancel()
            follow_stop.set()
            await asyncio.gather(follower, display, return_exceptions=True)
            for proc in reversed(list(ctx.services.values())):
                await proc.stop(grace_s=30)
