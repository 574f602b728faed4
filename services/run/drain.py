"""Draining a run: stop the actors, let the replayer fold every event and the learner train every
sample, stop the learner (its final step, checkpoint and push), wait until the engines serve that push."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import aiohttp
import structlog
from nats.js.errors import NotFoundError

from actors.client import SGLangClient
from protocol.subjects import EVENTS, SAMPLES, learner_durable, replayer_durable
from services.run.context import RunContext
from services.run.metrics import parse_samples, scrape
from services.run.supervisor import restart_crashed

__all__ = ["MAX_RESTARTS", "drain", "folded_all", "save_metrics", "wait_trained", "watch"]

log = structlog.get_logger(__name__)
MAX_RESTARTS = 3


async def watch(ctx: RunContext) -> None:
    """Restart services that crashed (never one stopped on purpose); the log makes a restart safe."""
    for name in await restart_crashed(ctx.services.values(), max_restarts=MAX_RESTARTS):
        restarts = ctx.services[name].restarts
        ctx.console.print(f"[yellow]{name} exited; restarting ({restarts}/{MAX_RESTARTS})[/yellow]")


async def _consumer_state(ctx: RunContext, stream: str, durable: str) -> tuple[int, int, int] | None:
    """(pending, ack pending, last delivered seq) of a durable; None before its service created it."""
    try:
        info = await ctx.jetstream.consumer_info(stream, durable)
    except NotFoundError:
        return None
    return int(info.num_pending or 0), int(info.num_ack_pending or 0), int(info.delivered.stream_seq or 0)


async def _wait_until(
    ctx: RunContext, what: str, check: Callable[[], Awaitable[bool]], timeout_s: float
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ctx.stop.is_set():
        await watch(ctx)
        if await check():
            return True
        await asyncio.sleep(1.0)
    if not ctx.stop.is_set():
        log.warning("run.drain.timeout", waiting_for=what, timeout_s=timeout_s)
        ctx.console.print(f"[yellow]gave up waiting for {what} after {timeout_s:.0f}s[/yellow]")
    return False


async def drain(ctx: RunContext, read_learner: Callable[[], Awaitable[None]]) -> None:
    """Stop actors, let the replayer fold everything and the learner train everything, then stop them.
    ``read_learner`` refreshes the learner's progress (its consumed sample sequence) from its metrics.
    Each service's last /metrics is saved to ``metrics/<name>.prom`` just before it is stopped."""
    assert ctx.progress is not None
    ctx.stage = "draining"
    for name in [n for n in ctx.services if n.startswith("actor")]:
        await save_metrics(ctx, name)
        await ctx.services[name].stop(grace_s=60)
    await wait_trained(ctx, read_learner, replayer_timeout_s=180, learner_timeout_s=300)
    if "learner" in ctx.services:
        # Everything delivered is trained, so the scrape above holds the last step; the learner's
        # metrics end with its process, the weights it pushes on stop are read from the stream.
        await save_metrics(ctx, "learner")
        await ctx.services["learner"].stop(grace_s=180)  # final step, checkpoint and push
        await _wait_weights_served(ctx)
    for name in ("weight-sync", "replayer"):
        if name in ctx.services:
            await save_metrics(ctx, name)
            await ctx.services[name].stop(grace_s=60)


async def wait_trained(
    ctx: RunContext,
    read_learner: Callable[[], Awaitable[None]],
    *,
    replayer_timeout_s: float,
    learner_timeout_s: float,
) -> bool:
    """Until the replayer folded every event in the log and the learner trained every sample delivered to
    it (True), or a timeout (False, said on the console). The warm start waits here before exploring."""
    progress, cfg = ctx.progress, ctx.config
    assert progress is not None
    replayer = replayer_durable(cfg.run_id, cfg.materializer)

    async def replayer_done() -> bool:
        state = await _consumer_state(ctx, EVENTS.name, replayer)
        return state is not None and folded_all(state[0], state[1], await _replayer_open(ctx))

    folded = await _wait_until(ctx, "the replayer to fold every event", replayer_done, replayer_timeout_s)
    if "learner" not in ctx.services:
        return folded
    learner = learner_durable(cfg.run_id, cfg.learner.durable)

    async def learner_done() -> bool:
        await read_learner()
        state = await _consumer_state(ctx, SAMPLES.name, learner)
        return state is not None and state[0] == 0 and progress.learner_samples_seq >= state[2]

    trained = await _wait_until(ctx, "the learner to train every sample", learner_done, learner_timeout_s)
    return folded and trained


def folded_all(pending: int, ack_pending: int, held_anchors: int | None) -> bool:
    """The replayer folded every event of the log: nothing left to deliver, and nothing unacked but the
    anchors it holds, one per open episode (``services/replayer/service.py``). Episodes left open when
    the actors stopped (a budget cut mid-episode) will never finish, so waiting for ``ack_pending == 0``
    only ran into the timeout; the log's end closes them as abandoned, online as offline.
    ``held_anchors`` ``None`` (the replayer's metrics unreadable): only ``ack_pending == 0`` counts."""
    return pending == 0 and ack_pending == (held_anchors or 0)


async def _replayer_open(ctx: RunContext) -> int | None:
    """``leafe_replayer_held_anchors`` from the replayer's /metrics (``None`` if unreadable)."""
    url = ctx.metrics_urls.get("replayer")
    if url is None:
        return None
    try:
        return int(parse_samples(await scrape(url)).get("leafe_replayer_held_anchors", 0))
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.info("run.drain.replayer_metrics", error=f"{type(e).__name__}: {e}")
        return None


async def save_metrics(ctx: RunContext, name: str) -> None:
    """Write service ``name``'s current /metrics text to ``<run dir>/metrics/<name>.prom`` (a service
    that does not answer is logged and skipped: the run goes on)."""
    url, proc = ctx.metrics_urls.get(name), ctx.services.get(name)
    if url is None or proc is None or not proc.alive:
        return
    try:
        text = await scrape(url)
    except (aiohttp.ClientError, TimeoutError) as e:
        log.warning("run.metrics.unreadable", service=name, url=url, error=f"{type(e).__name__}: {e}")
        return
    path = ctx.run_dir / "metrics" / f"{name}.prom"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


async def _wait_weights_served(ctx: RunContext) -> None:
    progress = ctx.progress
    assert progress is not None
    await asyncio.sleep(1.0)  # the final WeightsPublished reaches the follower
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(SGLangClient(url, api_key_file=ctx.engine_key_file))
            for url in ctx.engine_urls
        ]

        async def served() -> bool:  # every server: the evaluation after may go to any of them
            want = progress.weights_version
            return want == "default" or all([await e.weight_version() == want for e in engines])

        await _wait_until(ctx, f"the inference servers to serve {progress.weights_version}", served, 180)
