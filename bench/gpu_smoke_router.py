"""The router and reload-under-load stages of ``bench/gpu_smoke.py`` (no GPU in this code: the probes, the
load loops and their bookkeeping in ``bench/gpu_smoke_lib.py`` are unit-tested on CPU, and the whole stage
runs against the CPU server in tests/integration/test_gpu_smoke_stages.py)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from actors.engine import SamplingParams
from bench.gpu_smoke_lib import (
    ROUTER_VERSION,
    LoadLog,
    ProbeLog,
    Report,
    load_loop,
    probe_loop,
    router_command,
    router_version,
    sglang_server,
)

__all__ = ["reload_under_load", "routed", "router_metrics"]

T = TypeVar("T")


@contextmanager
def routed(args: argparse.Namespace, url: str, work: Path, report: Report) -> Iterator[str | None]:
    """sglang-router on ``--port + 1`` (metrics on ``+ 2``) in front of SGLang when ``--sglang-python``
    has it; yields its URL, or ``None`` (with a note) when it has not."""
    version = router_version(args.sglang_python)
    report.figures["router"] = version
    if version is None:
        report.notes.append(
            f"sglang_router is not importable by {args.sglang_python}: router stage skipped "
            f"(pip install sglang-router=={ROUTER_VERSION})"
        )
        yield None
        return
    router_url = f"http://127.0.0.1:{args.port + 1}"
    cmd = router_command(args.sglang_python, url, args.port + 1, args.port + 2)
    with sglang_server(cmd, work / "router.log", router_url, 120.0, ready_path="/readiness"):
        yield router_url


def router_metrics(port: int) -> bool:
    """The router's Prometheus endpoint answers with its ``sgl_router_*`` series."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.status == 200 and "sgl_router_" in resp.read().decode(errors="replace")


async def reload_under_load(
    url: str,
    router_url: str | None,
    prompt: list[int],
    reload: Callable[[], Awaitable[T]],
    report: Report,
    concurrency: int = 4,
) -> T:
    """Run ``reload()`` while ``concurrency`` loops generate (through the router when there is one) and
    SGLang's ``/ready`` (and the router's ``/readiness``) are probed; record the figures and checks."""
    import aiohttp

    from actors.client import SGLangClient

    targets = {"sglang /ready": f"{url}/ready"}
    if router_url is not None:
        targets["router /readiness"] = f"{router_url}/readiness"
    logs = {name: ProbeLog() for name in targets}
    load = LoadLog()
    stop = asyncio.Event()
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    async with aiohttp.ClientSession() as http, SGLangClient(router_url or url, timeout_s=600.0) as gen:

        def getter(target: str) -> Callable[[], Awaitable[int | None]]:
            async def get() -> int | None:
                async with http.get(target) as resp:
                    return resp.status

            return get

        loops = [probe_loop(getter(targets[n]), logs[n], stop) for n in targets]
        loops += [load_loop(lambda: gen.generate(prompt, params), load, stop) for _ in range(concurrency)]
        tasks = [asyncio.create_task(loop) for loop in loops]
        try:
            await asyncio.sleep(1.0)  # load and probes running before the reload starts
            result = await reload()
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    figures = {name: log.summary() for name, log in logs.items()}
    report.figures["reload_under_load"] = {
        **figures,
        "generations": load.requests,
        "generation_failures": load.failures,
        "errors": load.errors,
    }
    report.checks["health_answered_throughout_reload"] = all(log.healthy for log in logs.values())
    report.checks["generations_survived_reload"] = load.requests > 0 and load.failures == 0
    return result
