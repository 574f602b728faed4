"""Several local inference servers follow the thread plan by placement (services/run/launch.py): pinned to
the cores the learner leaves while it trains, anywhere while it is idle."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from services.run.context import RunContext
from services.run.launch import engine_threads
from services.run.presets import resolve_run_config
from services.run.supervisor import ServiceProcess
from services.threads import plan_threads

pytestmark = pytest.mark.anyio


async def test_servers_share_the_learners_leftover_cores_then_get_them_all(tmp_path: Path) -> None:
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    cfg = resolve_run_config("tiny", overrides={"runs_dir": str(tmp_path), "run_id": "r"})
    ctx = RunContext(config=cfg, console=Console(file=io.StringIO()), stop=asyncio.Event())
    ctx.threads = plan_threads(len(usable))
    for name in ("inference", "inference-1"):  # stand-ins: any long-lived child (the HTTP resize fails)
        proc = ServiceProcess(name, ["--version"], tmp_path / f"{name}.log")
        proc.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        ctx.services[name] = await proc.start()
        ctx.engine_services.append(name)
        ctx.engine_urls.append("http://127.0.0.1:9")  # nothing listens: the resize is logged, not fatal
    pids = [ctx.services[n].proc.pid for n in ctx.engine_services]  # type: ignore[union-attr]
    try:
        await engine_threads(ctx, shared=True)
        shared = set(usable[-ctx.threads.inference_shared :])
        assert [os.sched_getaffinity(p) for p in pids] == [shared, shared]
        await engine_threads(ctx, shared=False)
        assert [os.sched_getaffinity(p) for p in pids] == [set(usable), set(usable)]
    finally:
        for name in ctx.engine_services:
            await ctx.services[name].stop(grace_s=5)
