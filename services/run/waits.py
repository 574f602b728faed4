"""Waiting for a run's services: for the replayer to fold the log, the learner to train what it was
delivered, the engines to serve a push, with crashed services restarted meanwhile (:func:`watch`).

A wait for work gives up only when the work stops moving (:data:`STALL_S` without progress), never
after a fixed time: a slow machine takes longer for the same work, and cutting it there would make
the run's result depend on the machine's speed. Loading a pushed version is not work that grows with
the run: it has a plain timeout (:data:`SERVE_TIMEOUT_S`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import aiohttp
import structlog
from nats.js.errors import NotFoundError

from leafe.actors.client import SGLangClient
from leafe.protocol.subjects import EVENTS, SAMPLES, learner_durable, replayer_durable
from leafe.services.run.context import RunContext
from leafe.services.run.metrics import parse_samples, scrape
from leafe.services.run.supervisor import restart_crashed

__all__ = [
    "MAX_RESTARTS",
    "SERVE_TIMEOUT_S",
    "STALL_S",
    "folded_all",
    "wait_folded",
    "wait_served",
    "wait_trained",
    "wait_until",
    "watch",
]

log = structlog.get_logger(__name__)
MAX_RESTARTS = 3
STALL_S = 900.0
"""A wait for the replayer or the learner gives up after this long without progress: above the
slowest learner step seen (~55 s on one Zen 3 core for SmolLM2, 16 samples) with a wide margin."""
SERVE_TIMEOUT_S = 300.0
"""How long the engines may take to load a pushed version (a load, not work that grows with the
run)."""


async def watch(ctx: RunContext) -> None:
    """Restart services that crashed (never one stopped on purpose); the log makes a restart
    safe."""
    for name in await restart_crashed(ctx.services.values(), max_restarts=MAX_RESTARTS):
        restarts = ctx.services[name].restarts
        ctx.console.print(f"[yellow]{name} exited; restarting ({restarts}/{MAX_RESTARTS})[/yellow]")


async def _consumer_state(
    ctx: RunContext, stream: str, durable: str
) -> tuple[int, int, int] | None:
    """(pending, ack pending, last delivered seq) of a durable; None before its service created
    it."""
    try:
        info = await ctx.jetstream.consumer_info(stream, durable)
    except NotFoundError:
        return None
    return (
        int(info.num_pending or 0),
        int(info.num_ack_pending or 0),
        int(info.delivered.stream_seq or 0),
    )


async def wait_until(
    ctx: RunContext,
    what: str,
    check: Callable[[], Awaitable[bool]],
    timeout_s: float,
    moved: Callable[[], object] | None = None,
) -> bool:
    """Poll ``check`` until True, a stop, or ``timeout_s`` without progress: each change of
    ``moved()`` (a progress marker: counts, sequences) restarts the clock; without ``moved`` it is a
    plain timeout."""
    marker = moved() if moved is not None else None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ctx.stop.is_set():
        await watch(ctx)
        if await check():
            return True
        if moved is not None and (now := moved()) != marker:
            marker, deadline = now, time.monotonic() + timeout_s
        await asyncio.sleep(1.0)
    if not ctx.stop.is_set():
        idle = " without progress" if moved is not None else ""
        log.warning(
            "run.wait.timeout", waiting_for=what, timeout_s=timeout_s, stalled=moved is not None
        )
        ctx.console.print(
            f"[yellow]gave up waiting for {what} after {timeout_s:.0f}s{idle}[/yellow]"
        )
    return False


def folded_all(pending: int, ack_pending: int, held_anchors: int | None) -> bool:
    """The replayer folded every event of the log: nothing left to deliver, and nothing unacked but
    the anchors it holds, one per open episode (``services/replayer/service.py``). Episodes left
    open when the actors stopped (a budget cut mid-episode) will never finish, so waiting for
    ``ack_pending == 0`` only ran into the timeout; the log's end closes them as abandoned, online
    as offline. ``held_anchors`` ``None`` (the replayer's metrics unreadable): only ``ack_pending ==
    0`` counts."""
    return pending == 0 and ack_pending == (held_anchors or 0)


async def _replayer_open(ctx: RunContext) -> int | None:
    """``leafe_replayer_held_anchors`` from the replayer's /metrics (``None`` if unreadable)."""
    url = ctx.metrics_urls.get("replayer")
    if url is None:
        return None
    try:
        return int(parse_samples(await scrape(url)).get("leafe_replayer_held_anchors", 0))
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.info("run.wait.replayer_metrics", error=f"{type(e).__name__}: {e}")
        return None


async def wait_folded(ctx: RunContext) -> bool:
    """Until the replayer folded every event in the log (True), or it stalled (False, said)."""
    cfg = ctx.config
    replayer = replayer_durable(cfg.run_id, cfg.materializer)
    state: tuple[int, int, int] | None = None

    async def replayer_done() -> bool:
        nonlocal state
        state = await _consumer_state(ctx, EVENTS.name, replayer)
        return state is not None and folded_all(state[0], state[1], await _replayer_open(ctx))

    return await wait_until(
        ctx, "the replayer to fold every event", replayer_done, STALL_S, lambda: state
    )


async def wait_trained(ctx: RunContext, read_learner: Callable[[], Awaitable[None]]) -> bool:
    """Until the replayer folded every event in the log and the learner trained every sample
    delivered to it (True), or one of them stalled (False, said on the console). A continuous run's
    warm start and drain wait here."""
    progress, cfg = ctx.progress, ctx.config
    assert progress is not None
    folded = await wait_folded(ctx)
    if "learner" not in ctx.services:
        return folded
    learner = learner_durable(cfg.run_id, cfg.learner.durable)

    async def learner_done() -> bool:
        await read_learner()
        state = await _consumer_state(ctx, SAMPLES.name, learner)
        return state is not None and state[0] == 0 and progress.learner_samples_seq >= state[2]

    def moved() -> object:
        return progress.learner_step, progress.learner_samples_seq

    ctx.tell_learner(flush=True)  # the tail: a partial batch below min_batch is trained too
    try:
        trained = await wait_until(
            ctx, "the learner to train every sample", learner_done, STALL_S, moved
        )
    finally:
        ctx.tell_learner(flush=False)
    return folded and trained


async def wait_served(ctx: RunContext) -> bool:
    """Until every engine serves the newest pushed version (True), or :data:`SERVE_TIMEOUT_S`."""
    progress = ctx.progress
    assert progress is not None
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(SGLangClient(url, api_key_file=ctx.engine_key_file))
            for url in ctx.engine_urls
        ]

        async def served() -> bool:  # every server: the evaluation after may go to any of them
            want = progress.weights_version
            return want == "default" or all([await e.weight_version() == want for e in engines])

        what = f"the inference servers to serve {progress.weights_version}"
        return await wait_until(ctx, what, served, SERVE_TIMEOUT_S)
