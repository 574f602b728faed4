"""``leafe replayer``: the online replayer, events in, samples out, with no loss and no duplicates.

    leafe replayer --nats URL --run RUN --materializer leafe [--model DIR] \\
        [--config replayer.toml] [--metrics-port 9464]

The ack protocol that makes it restartable at any moment is described in
``services/replayer/service.py``. Run exactly one replayer per (run, materializer): its durable
consumer is its identity. SIGTERM/SIGINT: finish the batch in hand, then exit.

    leafe replayer redrive --nats URL --run RUN [--code CAP ...] [--dry-run]

publishes again the events dead-lettered because a cap was reached, once the cause is gone
(``services/replayer/redrive.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from leafe.services.bus import add_nats_arguments, nats_options
from leafe.services.config import dump_config, load_config
from leafe.services.logsetup import configure_logging
from leafe.services.metrics import ReplayerMetrics, add_metrics_arguments, serve_metrics
from leafe.services.replayer.config import ReplayerConfig
from leafe.services.replayer.service import serve

__all__ = ["main"]

log = structlog.get_logger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leafe replayer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_nats_arguments(p)
    p.add_argument("--run", required=True, help="run id whose events are materialized")
    p.add_argument(
        "--materializer", default=None, help="leafe | grpo | rft (default from config: leafe)"
    )
    p.add_argument("--model", default=None, help="tokenizer: default | tiny | HF model dir")
    p.add_argument("--config", default=None, help="TOML file with ReplayerConfig fields")
    p.add_argument("--log-level", default="info", help="log level (default info)")
    add_metrics_arguments(p)
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``leafe replayer`` (and of ``leafe replayer redrive``)."""
    if argv[:1] == ["redrive"]:
        from leafe.services.replayer.redrive import main as redrive_main

        return redrive_main(argv[1:])
    p = _parser()
    args = p.parse_args(argv)
    configure_logging(json=True, level=args.log_level)
    try:
        nats = nats_options(args)
        overrides = {"materializer": args.materializer, "model": args.model}
        config = load_config(ReplayerConfig, files=[args.config], overrides=overrides)
    except ValueError as e:
        p.error(str(e))
    if not nats.url:
        p.error("no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    structlog.contextvars.bind_contextvars(run_id=args.run, service="replayer")
    log.info("replayer.config", config=dump_config(config))
    metrics = ReplayerMetrics()
    serve_metrics(args.metrics_port, metrics.registry, args.metrics_host)

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, nats=nats, run_id=args.run, stop=stop, metrics=metrics)

    asyncio.run(_main())
    return 0
