"""Phased runs (``[explore] schedule = "phased"``, the default): work, not the wall clock, decides
what a run does, so the same config gives the same tasks, samples, steps and figures on a fast or a
slow machine.

```
 phase (a warm-start pass, round r): submit ─► every task finished
    ─► the replayer folded every event
    ─► release: the learner takes every free core and trains exactly the phase's samples (batches in
       sample-id order, services/learner/control.py) ─► one push ─► every engine serves it
    ─► the learner gives the cores back; the next phase samples from those weights
```

Nothing here waits for a fixed time: a wait gives up only when its work stops moving
(``services/run/waits.py``). The phase's samples are those the learner's consumer was delivered once
the replayer had folded everything: ``release_seq`` is that consumer's last delivered stream
sequence. A continuous run (the ``leafe`` and ``grpo`` presets) overlaps actors and learner instead;
only its warm start moves the cores to the learner (:func:`learner_cores`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import structlog
from nats.js.errors import NotFoundError

from leafe.protocol.subjects import SAMPLES, learner_durable
from leafe.services.run.context import RunContext
from leafe.services.run.launch import engine_threads
from leafe.services.run.waits import STALL_S, wait_folded, wait_served, wait_until

__all__ = ["learner_cores", "train_phase"]

log = structlog.get_logger(__name__)


async def learner_cores(ctx: RunContext, *, alone: bool) -> None:
    """Move the free cores: to the learner while the engines idle (``alone``), else back to the
    plan's split (the learner's share; the engines every core in a phased run, whose learner then
    idles)."""
    if "learner" not in ctx.services:
        return
    ctx.tell_learner(threads=ctx.learner_alone if alone else ctx.learner_threads)
    phased = ctx.config.explore.schedule == "phased"
    await engine_threads(ctx, shared=not (alone or phased))


async def _delivered_seq(ctx: RunContext) -> int | None:
    """The learner consumer's last delivered sequence once nothing is pending (None: it stalled)."""
    cfg = ctx.config
    durable = learner_durable(cfg.run_id, cfg.learner.durable)
    state: tuple[int, int] | None = None

    async def all_delivered() -> bool:
        nonlocal state
        try:
            info = await ctx.jetstream.consumer_info(SAMPLES.name, durable)
        except NotFoundError:  # the learner has not bound it yet
            return False
        state = int(info.num_pending or 0), int(info.delivered.stream_seq or 0)
        return state[0] == 0

    what = "the learner to be delivered every sample"
    if not await wait_until(ctx, what, all_delivered, STALL_S, lambda: state):
        return None
    assert state is not None
    return state[1]


async def train_phase(
    ctx: RunContext, read_learner: Callable[[], Awaitable[None]], what: str
) -> bool:
    """Release every sample of the log so far to the learner (with every free core), wait until it
    trained them and its push is served, then give the cores back. False when a wait gave up (said
    on the console; the run goes on with the weights it has)."""
    progress = ctx.progress
    assert progress is not None
    if "learner" not in ctx.services:
        return await wait_folded(ctx)
    if not await wait_folded(ctx) or (release := await _delivered_seq(ctx)) is None:
        return False
    ctx.enter(f"training {what}")
    cfg = ctx.config
    trainable = sum(n for kind, n in progress.samples.items() if kind in cfg.learner.kinds)
    new = max(
        0, trainable - ctx.released_samples
    )  # as the follower counted them: a plan, not a check
    ctx.plan.expect(ctx.stage, math.ceil(new / cfg.learner.trainer.batch.global_batch))
    ctx.released_samples = trainable
    await learner_cores(ctx, alone=True)
    ctx.tell_learner(release_seq=release)

    async def trained() -> bool:
        await read_learner()
        return progress.learner_samples_seq >= release

    def moved() -> object:
        return progress.learner_step, progress.learner_samples_seq

    ok = await wait_until(ctx, f"the learner to train {what}", trained, STALL_S, moved)
    if (
        ok and progress.learner_step > progress.weights_step
    ):  # steps taken: their push, then its load

        async def pushed() -> bool:
            return progress.weights_step >= progress.learner_step

        ok = await wait_until(ctx, "the learner's push", pushed, STALL_S) and await wait_served(ctx)
    await learner_cores(ctx, alone=False)
    log.info("run.phase.trained", what=what, release_seq=release, step=progress.learner_step, ok=ok)
    return ok
