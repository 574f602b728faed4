"""Cores follow the work (services/run/launch.py, services/run/phases.py): local inference servers
are pinned to the cores the learner leaves while both work and run anywhere while it is idle; the
learner gets every free core while the engines idle (the warm start, a phased run's training) and
gives them back when the actors run."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rich.console import Console

from leafe.services.run.context import RunContext
from leafe.services.run.launch import engine_threads
from leafe.services.run.phases import learner_cores
from leafe.services.run.presets import resolve_run_config
from leafe.services.run.supervisor import ServiceProcess
from leafe.services.threads import plan_threads

pytestmark = pytest.mark.anyio


@pytest.fixture
async def ctx(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[RunContext]:
    """A tiny run's context on every usable core, with two stand-in inference servers (any
    long-lived child: their HTTP resize fails, is logged and is not fatal) and a learner that never
    starts."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    schedule = getattr(request, "param", "phased")
    overrides = {"runs_dir": str(tmp_path), "run_id": "r", "explore.schedule": schedule}
    ctx = RunContext(
        config=resolve_run_config("tiny", overrides=overrides),
        console=Console(file=io.StringIO()),
        stop=asyncio.Event(),
    )
    ctx.threads = plan_threads(len(usable))
    ctx.learner_threads, ctx.learner_alone = ctx.threads.learner, ctx.threads.learner_alone
    for name in ("inference", "inference-1"):
        proc = ServiceProcess(name, ["--version"], tmp_path / f"{name}.log")
        proc.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        ctx.services[name] = await proc.start()
        ctx.engine_services.append(name)
        ctx.engine_urls.append("http://127.0.0.1:9")  # nothing listens
    ctx.services["learner"] = ServiceProcess("learner", ["--version"], tmp_path / "learner.log")
    yield ctx
    for name in ctx.engine_services:
        await ctx.services[name].stop(grace_s=5)


def _engine_cores(ctx: RunContext) -> list[set[int]]:
    return [os.sched_getaffinity(ctx.services[n].proc.pid) for n in ctx.engine_services]  # type: ignore[union-attr]


def _learner_threads(ctx: RunContext) -> int:
    return int(json.loads(ctx.control_file.read_text())["threads"])


async def test_servers_share_the_learners_leftover_cores_then_get_them_all(ctx: RunContext) -> None:
    """Pinned to the cores the learner leaves while both work, every core once the learner is
    idle."""
    usable = sorted(os.sched_getaffinity(0))
    assert ctx.threads is not None
    await engine_threads(ctx, shared=True)
    shared = set(usable[-ctx.threads.inference_shared :])
    assert _engine_cores(ctx) == [shared, shared]
    await engine_threads(ctx, shared=False)
    assert _engine_cores(ctx) == [set(usable), set(usable)]


@pytest.mark.parametrize("ctx", ["continuous"], indirect=True)
async def test_the_learner_takes_every_core_while_the_engines_idle_then_gives_them_back(
    ctx: RunContext,
) -> None:
    """Continuous: during the warm start the learner is told every free core (the engines have no
    work and run unpinned); when the actors' turn comes it goes back to its share and the engines to
    the rest."""
    usable = sorted(os.sched_getaffinity(0))
    assert ctx.threads is not None
    await learner_cores(ctx, alone=True)
    assert _learner_threads(ctx) == len(usable) and _engine_cores(ctx) == [set(usable)] * 2
    await learner_cores(ctx, alone=False)
    shared = set(usable[-ctx.threads.inference_shared :])
    assert _learner_threads(ctx) == ctx.threads.learner < len(usable)
    assert _engine_cores(ctx) == [shared, shared]


async def test_a_phased_run_hands_every_core_to_whichever_side_works(ctx: RunContext) -> None:
    """Phased: the learner trains alone on every core, and while the actors run it idles, so the
    engines get every core (never pinned beside an idle learner)."""
    usable = sorted(os.sched_getaffinity(0))
    await learner_cores(ctx, alone=True)
    assert _learner_threads(ctx) == len(usable)
    await learner_cores(ctx, alone=False)
    assert _engine_cores(ctx) == [set(usable)] * 2
