"""``leafe inference``: the CPU inference server with SGLang's native HTTP API, until SIGTERM.

    leafe inference --model tiny|smollm2-135m-instruct|DIR --port 30000 --max-batch 16 \\
        [--config inference.toml]
    # Prometheus /metrics (leafe_inference_*) on its own port:
    leafe inference ... --metrics-port 9464

The server itself is ``services/inference/server.py``; torch loads only after the flags are read, so
``--help`` is instant. The metrics are read at scrape time from the engine's own counters (the
``internal_states`` of ``/get_server_info``) by ``leafe.services.metrics.InferenceCollector``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from prometheus_client import CollectorRegistry

from leafe.services.config import load_config
from leafe.services.inference.config import InferenceConfig
from leafe.services.logsetup import configure_logging
from leafe.services.metrics import InferenceCollector, add_metrics_arguments, serve_metrics

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leafe inference", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument(
        "--config", default=None, help="TOML file with InferenceConfig fields (flags override)"
    )
    p.add_argument(
        "--model", default=None, help="smollm2-135m-instruct | tiny | HF model directory"
    )
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None, help="0 = pick a free port (printed at start)")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--batch-wait-ms", type=float, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--prefix-cache-tokens", type=int, default=None, help="0 = no prefix cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (0 = one per core)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default=None)
    p.add_argument(
        "--api-key-file", default=None, help="file with the API key (Authorization: Bearer)"
    )
    p.add_argument(
        "--admin-key-file",
        default=None,
        help="file with the admin key (weight updates, /flush_cache, /set_threads)",
    )
    p.add_argument(
        "--weights-root", default=None, help="weight updates load only exports under this dir"
    )
    p.add_argument("--log-level", default="info")
    add_metrics_arguments(p)
    return p


async def _serve(config: InferenceConfig, metrics_port: int, metrics_host: str) -> None:
    """Like ``server.serve``, with the engine's counters exported on ``metrics_port`` while it
    runs."""
    from leafe.services.inference.server import (
        InferenceServer,
    )  # torch: only once the flags are good

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with InferenceServer(config) as server:
        registry = CollectorRegistry()
        registry.register(
            InferenceCollector(lambda: server.engine.describe() if server.engine else None)
        )
        exporter = serve_metrics(metrics_port, registry, metrics_host)
        print(f"leafe inference: serving on {server.url}", flush=True)
        try:
            await stop.wait()
        finally:
            if exporter is not None:
                exporter.close()


def main(argv: list[str]) -> int:
    """Entry point of ``leafe inference``."""
    p = _parser()
    a = p.parse_args(argv)
    configure_logging(json=True, level=a.log_level)
    flags = {
        k: v
        for k, v in vars(a).items()
        if k not in ("config", "log_level", "metrics_port", "metrics_host")
    }
    try:
        config = load_config(InferenceConfig, files=[a.config], overrides=flags)
    except ValueError as e:
        p.error(str(e))
    asyncio.run(_serve(config, a.metrics_port, a.metrics_host))
    return 0
