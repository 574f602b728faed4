"""``leafe weight-sync``: make every inference server serve the latest published weight version.

    leafe weight-sync --nats URL --run r1 --server http://127.0.0.1:30000 \\
        --server http://gpu-2:30000
    # apply the latest version, report, exit 1 if any server failed
    leafe weight-sync ... --once
    # WeightSyncConfig fields; flags override
    leafe weight-sync ... --config weight-sync.toml
    # Prometheus /metrics (leafe_weight_sync_*)
    leafe weight-sync ... --metrics-port 9465
    # read by the engine's liveness probe
    leafe weight-sync ... --engine-lock /run/leafe/engine/reload.lock
    # broadcast each version to a group of the servers (this process is rank 0)
    leafe weight-sync ... --transport distributed --master-address 10.0.0.5 --rendezvous-port 29600
    # the servers are the addresses of a (headless Service's) name, looked up before every round
    leafe weight-sync ... --engines-dns sglang-engines:30000

How it reconciles is described in ``services/weight_sync/service.py``. It reads the engines' API key
from ``$LEAFE_ENGINE_API_KEY_FILE`` (``/model_info``) and their admin key, which the weight routes
need, from ``$LEAFE_ENGINE_ADMIN_KEY_FILE`` (``/update_weights_from_disk``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from leafe.services.bus import NatsOptions, add_nats_arguments, nats_options
from leafe.services.config import dump_config, load_config
from leafe.services.logsetup import configure_logging
from leafe.services.metrics import WeightSyncMetrics, add_metrics_arguments, serve_metrics
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

__all__ = ["main"]

log = structlog.get_logger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe weight-sync", description=__doc__.split("\n\n")[0])
    add_nats_arguments(p)
    p.add_argument(
        "--run", "--run-id", dest="run", required=True, help="run id (--run-id under torchrun)"
    )
    p.add_argument(
        "--server", action="append", default=None, help="inference server base URL (repeatable)"
    )
    p.add_argument("--config", default=None, help="TOML file with WeightSyncConfig fields")
    p.add_argument(
        "--reconcile-interval", type=float, default=None, help="seconds between server checks"
    )
    p.add_argument(
        "--verify",
        choices=["manifest", "files", "off"],
        default=None,
        help="check the export against the announcement: every file (default), "
        "the manifest sha256 only, or off",
    )
    p.add_argument(
        "--transport",
        choices=["disk", "distributed"],
        default=None,
        help="disk: each server loads the export (default); distributed: broadcast it to a "
        "group of the servers (SGLang's /update_weights_from_distributed)",
    )
    p.add_argument(
        "--master-address",
        default=None,
        help="distributed: the address the servers reach this process's rendezvous store on",
    )
    p.add_argument(
        "--rendezvous-port",
        type=int,
        default=None,
        help="distributed: the rendezvous store's port (0: a free one)",
    )
    p.add_argument(
        "--engines-dns",
        default=None,
        metavar="NAME:PORT",
        help="find the servers by resolving NAME before every round (each address a server "
        "http://ADDR:PORT; a Kubernetes headless Service of the engine pods)",
    )
    p.add_argument(
        "--group-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="distributed: gloo (CPU, TCP; default) or nccl (this process and the servers on GPUs)",
    )
    p.add_argument(
        "--engine-lock",
        default=None,
        help="file held locked while the server loads, read by the engine's liveness probe "
        "(one per pod)",
    )
    p.add_argument(
        "--once", action="store_true", help="apply the latest version and exit (1 if any failed)"
    )
    p.add_argument("--log-level", default="info")
    add_metrics_arguments(p)
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``leafe weight-sync``."""
    p = _parser()
    a = p.parse_args(argv)
    configure_logging(json=True, level=a.log_level)
    overrides = {
        "servers": a.server,
        "reconcile_interval_s": a.reconcile_interval,
        "verify": a.verify,
        "engine_lock": a.engine_lock,
        "transport": a.transport,
        "master_address": a.master_address,
        "rendezvous_port": a.rendezvous_port,
        "engines_dns": a.engines_dns,
        "group_backend": a.group_backend,
    }
    try:
        nats = nats_options(a)
        cfg = load_config(WeightSyncConfig, files=[a.config], overrides=overrides)
    except ValueError as e:
        p.error(str(e))
    if not nats.url:
        p.error("give --nats URL or set LEAFE_NATS_URL")
    if not cfg.servers and not cfg.engines_dns:
        p.error(
            "no inference server: give --server URL or --engines-dns NAME:PORT "
            "(or `servers` / `engines_dns` in --config)"
        )
    structlog.contextvars.bind_contextvars(run_id=a.run)
    log.info("weight_sync.config", config=dump_config(cfg))
    metrics = WeightSyncMetrics()
    serve_metrics(a.metrics_port, metrics.registry, a.metrics_host)
    return asyncio.run(_main(cfg, a.run, nats, a.once, metrics))


async def _main(
    cfg: WeightSyncConfig, run_id: str, nats: NatsOptions, once: bool, metrics: WeightSyncMetrics
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ok = await WeightSync(cfg, run_id=run_id, metrics=metrics).run(nats, stop, once=once)
    return 0 if ok else 1
