"""sglang-router 0.3.2 in front of inference servers: the gpu overlay's topology (actors -> router
-> engines) on one machine, so requests, seeds, readiness, weight versions and reloads go through
the real router in CI and in ``leafe run`` with ``services.router = true``.

    router = await open_router(["http://127.0.0.1:30001", "http://127.0.0.1:30002"], log_path)
    router.url            # what actors and evaluations use as their one engine URL
    await router.stop()

The flags are deploy/components/sglang/router.yaml's (cache-aware routing with balance thresholds
that spread a shared-prefix load, workers checked on the cheap ``/ready``, 3 misses of 5 s, 2
attempts per request of at most 120 s each, a circuit breaker that 4 refused requests do not open)
with the workers given as URLs instead of discovered as pods. Weight sync and the drain keep
talking to each server: the router has no ``/update_weights_from_disk`` and answers
``/get_model_info`` from its first healthy worker.

With key files (``leafe run`` always gives them) it starts through ``router_launch.py``, which reads
them and hands the router ``--api-key`` (the engines' key: clients must present it) and
``--control-plane-api-keys`` (the supervisor's key, a 0600 file no service gets: ``POST /workers``,
``DELETE /workers/<id>``, ``/workers``, ``/get_loads``), so no key is on a command line. Without
them, anyone who reached the router could add a worker of its choice (which then received the
actors' requests and their key) or remove an engine. ``/get_server_info`` still answers without a
key in 0.3.2 (router and worker counts, as ``/readiness`` does), and so do ``/readiness``,
``/health``, ``/liveness`` and ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp
import structlog

from leafe.services.bus.nats_server import free_port
from leafe.services.run.supervisor import ServiceError, ServiceProcess

__all__ = [
    "ROUTER_ATTEMPTS",
    "ROUTER_REQUEST_TIMEOUT_S",
    "ROUTER_VERSION",
    "ROUTING",
    "RouterProcess",
    "open_router",
    "router_available",
    "router_command",
]

log = structlog.get_logger(__name__)

ROUTER_VERSION = "0.3.2"
"""The sglang-router release deploy/ runs (the Dockerfile's router stage) and the dev extra pins."""


ROUTING = {
    "--policy": "cache_aware",
    "--balance-abs-threshold": "4",
    "--balance-rel-threshold": "1.2",
}
"""Cache-aware routing that still spreads load: with the defaults (64 requests and 1.5x apart) a
load whose prompts share a prefix goes to one engine (bench/router.py measures it)."""
ROUTER_ATTEMPTS = 2
"""Attempts per request (``--retry-max-retries`` counts attempts, the first included)."""
ROUTER_REQUEST_TIMEOUT_S = 120
"""The router's timeout of one attempt: ``ROUTER_ATTEMPTS`` of them fit in the actors' client
timeout (``SGLangClientConfig.timeout_s``, 300 s), so a hung engine's request is retried on another
by the router instead of failing at the client (where it counts as an attempt of the task)."""


def router_available() -> bool:
    """Whether this interpreter can run the router (``pip install sglang-router==0.3.2``)."""
    return importlib.util.find_spec("sglang_router") is not None


def router_command(
    workers: Sequence[str],
    *,
    port: int,
    prometheus_port: int,
    host: str = "127.0.0.1",
    health_interval_s: int = 10,
    python: str = sys.executable,
    api_key_file: str = "",
    control_key_file: str = "",
    overrides: Mapping[str, str] | None = None,
) -> list[str]:
    """The router's launch: deploy's flags (router.yaml) with ``workers`` as URLs; with key files,
    through ``router_launch.py``, which reads them (both or neither). ``overrides`` replaces or
    adds flags (``bench/router.py`` compares routing settings with it)."""
    if bool(api_key_file) != bool(control_key_file):
        raise ValueError("the router needs both key files (the engines' and its control key)")
    flags = {
        "--host": host,
        "--port": str(port),
        **ROUTING,
        "--health-check-endpoint": "/ready",
        "--health-check-interval-secs": str(health_interval_s),
        "--health-check-timeout-secs": "5",
        "--health-failure-threshold": "3",
        "--retry-max-retries": str(ROUTER_ATTEMPTS),
        "--request-timeout-secs": str(ROUTER_REQUEST_TIMEOUT_S),
        # The breaker counts refused requests (400) too: 5 in a row, not 4, skip a worker for 10 s.
        "--cb-failure-threshold": "5",
        "--cb-timeout-duration-secs": "10",
        "--prometheus-host": host,
        "--prometheus-port": str(prometheus_port),
        "--log-level": "warn",
        **(overrides or {}),
    }
    argv = [python, "-m", "sglang_router.launch_router"]
    if api_key_file:
        argv = [python, "-m", "leafe.services.run.router_launch"]
        argv += ["--api-key-file", api_key_file, "--control-key-file", control_key_file, "--"]
    argv += ["--worker-urls", *workers]
    return argv + [token for pair in flags.items() for token in pair]


class RouterProcess(ServiceProcess):
    """The router as a supervised child: logged, recorded, restarted like the ``leafe`` services."""

    def __init__(
        self,
        command: list[str],
        log_path: Path,
        *,
        url: str,
        metrics_url: str,
        run_dir: Path | None = None,
    ) -> None:
        super().__init__("router", [], log_path, run_dir=run_dir)
        self.argv = command  # not a `leafe` verb: the router's own launch
        self.url = url
        """Where clients send requests."""
        self.metrics_url = metrics_url
        """Its Prometheus endpoint (``smg_*`` series)."""

    async def healthy_workers(self) -> int | None:
        """``healthy_workers`` of its ``/readiness`` (``None``: no answer)."""
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
                http.get(f"{self.url}/readiness") as resp,
            ):
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return int(body.get("healthy_workers", 0)) if isinstance(body, dict) else None

    async def wait_workers(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` workers are healthy; :class:`ServiceError` with the log tail if it
        dies or times out."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (await self.healthy_workers() or 0) < count:
            self.check()
            if asyncio.get_running_loop().time() > deadline:
                raise ServiceError(
                    f"the router did not report {count} healthy workers within {timeout_s:.0f}s; "
                    f"see {self.log_path}:\n{self.tail()}"
                )
            await asyncio.sleep(0.25)


async def open_router(
    workers: Sequence[str],
    log_path: Path,
    *,
    run_dir: Path | None = None,
    health_interval_s: int = 10,
    timeout_s: float = 60.0,
    api_key_file: str = "",
    control_key_file: str = "",
    overrides: Mapping[str, str] | None = None,
) -> RouterProcess:
    """Start the router in front of ``workers`` and wait until every one is healthy behind it;
    with ``api_key_file`` and ``control_key_file``, keyed (see the module docstring)."""
    if not router_available():
        raise ServiceError(
            f"sglang_router is not importable by {sys.executable}: pip install "
            f"sglang-router=={ROUTER_VERSION}"
        )
    port, prometheus_port = free_port(), free_port()
    command = router_command(
        workers,
        port=port,
        prometheus_port=prometheus_port,
        health_interval_s=health_interval_s,
        api_key_file=api_key_file,
        control_key_file=control_key_file,
        overrides=overrides,
    )
    router = RouterProcess(
        command,
        log_path,
        url=f"http://127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{prometheus_port}/metrics",
        run_dir=run_dir,
    )
    await router.start()
    try:
        await router.wait_workers(len(workers), timeout_s)
    except BaseException:
        await router.stop(5.0)
        raise
    log.info("run.router.ready", url=router.url, workers=list(workers))
    return router
