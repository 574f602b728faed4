"""Draining a run: stop the actors, let the replayer fold every event and the learner train every
sample (a phased run trains them as one last phase, ``services/run/phases.py``), stop the learner
(its final step, checkpoint and push), wait until the engines serve that push. The waits are
``services/run/waits.py``'s: they give up only when the work stops moving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import structlog

from leafe.services.run.context import RunContext
from leafe.services.run.metrics import scrape
from leafe.services.run.phases import train_phase
from leafe.services.run.waits import wait_served, wait_trained

__all__ = ["drain", "save_metrics"]

log = structlog.get_logger(__name__)


async def drain(ctx: RunContext, read_learner: Callable[[], Awaitable[None]]) -> None:
    """Stop actors, let the replayer fold everything and the learner train everything, then stop
    them. ``read_learner`` refreshes the learner's progress (its consumed sample sequence) from its
    metrics. Each service's last /metrics is saved to ``metrics/<name>.prom`` just before it is
    stopped."""
    assert ctx.progress is not None
    ctx.enter("draining")
    for name in [n for n in ctx.services if n.startswith("actor")]:
        await save_metrics(ctx, name)
        await ctx.services[name].stop(grace_s=60)
    if ctx.config.explore.schedule == "phased":
        await train_phase(ctx, read_learner, "the rest")  # a cut phase's samples (budget, Ctrl-C)
    else:
        await wait_trained(ctx, read_learner)
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


async def save_metrics(ctx: RunContext, name: str) -> None:
    """Write service ``name``'s current /metrics text to ``<run dir>/metrics/<name>.prom`` (a
    service that does not answer is logged and skipped: the run goes on)."""
    url, proc = ctx.metrics_urls.get(name), ctx.services.get(name)
    if url is None or proc is None or not proc.alive:
        return
    try:
        text = await scrape(url)
    except (aiohttp.ClientError, TimeoutError) as e:
        log.warning(
            "run.metrics.unreadable", service=name, url=url, error=f"{type(e).__name__}: {e}"
        )
        return
    path = ctx.run_dir / "metrics" / f"{name}.prom"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


async def _wait_weights_served(ctx: RunContext) -> None:
    await asyncio.sleep(1.0)  # the final WeightsPublished reaches the follower
    await wait_served(ctx)
