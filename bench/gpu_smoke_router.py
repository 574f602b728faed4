"""The router and reload-under-load stages of ``bench/gpu_smoke.py`` (no GPU in this code: the
probes, the load loops and their bookkeeping in ``bench/gpu_smoke_lib.py`` are unit-tested on CPU,
and the whole stage runs against the CPU server in tests/integration/test_gpu_smoke_stages.py).

During the reload the weight-sync sidecar's engine lock is held (services/weight_sync/lease.py) and
deploy's SGLang liveness probe (deploy/components/sglang/liveness.py) runs every second as the
kubelet runs it: it must say alive throughout without asking SGLang for a generation."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

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
from leafe.actors.engine import SamplingParams
from leafe.services.weight_sync.lease import engine_lock

__all__ = ["reload_under_load", "routed", "router_metrics"]

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
LIVENESS = REPO / "deploy" / "components" / "sglang" / "liveness.py"


@contextmanager
def routed(args: argparse.Namespace, url: str, work: Path, report: Report) -> Iterator[str | None]:
    """sglang-router on ``--port + 1`` (metrics on ``+ 2``) in front of SGLang, from
    ``--sglang-python`` or else this interpreter (the dev extra pins it); yields its URL, or
    ``None`` (with a note) when neither has it."""
    python = next((p for p in (args.sglang_python, sys.executable) if router_version(p)), None)
    report.figures["router"] = router_version(python) if python else None
    if python is None:
        report.notes.append(
            f"sglang_router is not importable by {args.sglang_python} nor {sys.executable}: "
            f"router stage skipped (pip install sglang-router=={ROUTER_VERSION})"
        )
        yield None
        return
    router_url = f"http://127.0.0.1:{args.port + 1}"
    cmd = router_command(python, url, args.port + 1, args.port + 2)
    with sglang_server(cmd, work / "router.log", router_url, 120.0, ready_path="/readiness"):
        yield router_url


EVENT_SERIES = frozenset({"smg_worker_retries_total", "smg_router_request_errors_total"})
"""Router series that appear only once a retry or an error happened (a clean run has none)."""


def router_metrics(port: int) -> bool:
    """The router's Prometheus endpoint answers with every ``smg_*`` series the dashboard's router
    panels read (but those that only a retry or an error creates)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode(errors="replace")
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()}
    dashboard = (REPO / "deploy" / "components" / "monitoring" / "dashboard.json").read_text(
        encoding="utf-8"
    )
    wanted = set(re.findall(r"\bsmg_\w+", dashboard)) - EVENT_SERIES
    return resp.status == 200 and bool(wanted) and wanted <= exported


def liveness_getter(lock: Path, url: str) -> Callable[[], Awaitable[int | None]]:
    """deploy's SGLang liveness probe as a health check: 200 when it exits 0 (alive), 503
    otherwise."""

    async def get() -> int | None:
        argv = [sys.executable, "-I", "-S", str(LIVENESS), str(lock), f"{url}/health"]
        proc = await asyncio.create_subprocess_exec(*argv)
        return 200 if await proc.wait() == 0 else 503

    return get


async def reload_under_load(
    url: str,
    router_url: str | None,
    prompt: list[int],
    reload: Callable[[], Awaitable[T]],
    report: Report,
    concurrency: int = 4,
) -> T:
    """Run ``reload()`` while ``concurrency`` loops generate (through the router when there is one)
    and SGLang's ``/ready`` (and the router's ``/readiness``) are probed; record the figures and
    checks."""
    import aiohttp

    from leafe.actors.client import SGLangClient

    targets = {"sglang /ready": f"{url}/ready"}
    if router_url is not None:
        targets["router /readiness"] = f"{router_url}/readiness"
    logs = {name: ProbeLog() for name in targets}
    logs["sglang liveness"] = ProbeLog(timeout_s=30.0)  # the kubelet's timeout for it (sglang.yaml)
    load = LoadLog()
    stop = asyncio.Event()
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    lock = Path(tempfile.mkdtemp(prefix="gpu-smoke-lock-")) / "reload.lock"
    async with (
        aiohttp.ClientSession() as http,
        SGLangClient(router_url or url, timeout_s=600.0) as gen,
    ):

        def getter(target: str) -> Callable[[], Awaitable[int | None]]:
            async def get() -> int | None:
                async with http.get(target) as resp:
                    return resp.status

            return get

        loops = [probe_loop(getter(targets[n]), logs[n], stop) for n in targets]
        loops.append(
            probe_loop(liveness_getter(lock, url), logs["sglang liveness"], stop, every_s=1.0)
        )
        loops += [
            load_loop(lambda: gen.generate(prompt, params), load, stop) for _ in range(concurrency)
        ]
        tasks = [asyncio.create_task(loop) for loop in loops]
        try:
            await asyncio.sleep(1.0)  # load and probes running before the reload starts
            async with engine_lock(
                str(lock), deadline_s=600.0
            ):  # as the weight-sync sidecar holds it
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
