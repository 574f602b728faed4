"""``leafe actor``: pull task assignments, run LEAFE exploration trees or plain rollouts, publish
events.

    leafe actor --nats nats://127.0.0.1:4222 --run r1 --engine http://127.0.0.1:30000 \\
        --model tiny [--config actor.toml] [--concurrency 8] [--metrics-port 9464]

The service itself (work queue, acks, keepalives, drain) is ``services/actor/service.py``. The actor
id is the last token of every event subject it publishes on, and NATS lets each actor's credentials
publish on its own id only (``services/bus/auth.py``): credentials ``actor.<id>`` (user, or seed
file ``actor.<id>.nk``) give the id; ``--actor-id`` may repeat it, never differ from it. Without
such credentials (a test server, an admin) the id is ``--actor-id``, else ``<host>-<pid>``. SIGTERM
or Ctrl-C: stop fetching, let running episodes finish for ``drain_timeout_s``, nak the rest.
In-process (tests, benchmarks): ``await run_actor(nats=..., run_id=..., engine=...,
tokenizer=...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import structlog

from leafe.actors.client import SGLangClient
from leafe.actors.config import ActorServiceConfig
from leafe.actors.engine import Engine
from leafe.actors.env_pool import EnvFactory
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.subjects import validate_actor_id
from leafe.services.actor.service import ActorService, ActorStats
from leafe.services.bus import NatsOptions, add_nats_arguments, connect, nats_options
from leafe.services.bus.connection import credential_actor_id
from leafe.services.config import dump_config, load_config
from leafe.services.logsetup import configure_logging
from leafe.services.metrics import ActorMetrics, add_metrics_arguments, serve_metrics

__all__ = ["default_actor_id", "main", "resolve_actor_id", "run_actor"]

log = structlog.get_logger(__name__)


def model_context_length(model_dir: Path) -> int:
    """The model's ``max_position_embeddings`` (SGLang's context length unless its server is
    started with ``--context-length``), from ``config.json``; 0 when it gives none."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else 0


async def run_actor(
    *,
    nats: NatsOptions | str,
    run_id: str,
    tokenizer: ChatTokenizer,
    engine: Engine | None = None,
    engine_urls: list[str] | None = None,
    config: ActorServiceConfig | None = None,
    actor_id: str | None = None,
    stop: asyncio.Event | None = None,
    max_tasks: int | None = None,
    env_factory: EnvFactory | None = None,
    metrics: ActorMetrics | None = None,
) -> ActorStats:
    """Connect, serve tasks until ``stop`` (or ``max_tasks``), drain, disconnect. Give ``engine`` or
    URLs."""
    if engine is None and not engine_urls:
        raise ValueError("run_actor needs an engine or at least one engine URL")
    opts = NatsOptions(url=nats) if isinstance(nats, str) else nats
    actor_id = resolve_actor_id(opts, actor_id)
    async with AsyncExitStack() as stack:
        nc = await connect(opts, name=f"leafe-actor-{actor_id}")
        stack.push_async_callback(nc.close)
        config = config or ActorServiceConfig()
        if engine is None:
            engine = await stack.enter_async_context(
                SGLangClient.from_config(engine_urls or [], config.engine)
            )
        service = ActorService(
            nc=nc,
            run_id=run_id,
            engine=engine,
            tokenizer=tokenizer,
            config=config,
            actor_id=actor_id,
            env_factory=env_factory,
            max_tasks=max_tasks,
            streams_timeout_s=opts.streams_timeout_s,
            metrics=metrics,
        )
        stats = await service.run(stop)
        await nc.flush()  # the last acks leave before the connection closes
        return stats


def default_actor_id() -> str:
    """``<host>-<pid>`` (characters a subject token may not hold replaced by ``-``)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]).strip("-_") or "actor"
    return f"{host[:48]}-{os.getpid()}"


def resolve_actor_id(opts: NatsOptions, actor_id: str | None) -> str:
    """The id to publish as: the credentials' (``actor.<id>``), which ``actor_id`` may only repeat,
    else ``actor_id``, else :func:`default_actor_id`; checked as a subject token (``InvalidRunId``
    names it)."""
    pinned = credential_actor_id(opts)
    if pinned is not None and actor_id and actor_id != pinned:
        raise ValueError(
            f"actor id {actor_id!r} differs from the one the NATS credentials are pinned to "
            f"({pinned!r}): "
            "the server would refuse every event; drop --actor-id or use the actor's own "
            "credentials"
        )
    return validate_actor_id(pinned or actor_id or default_actor_id())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe actor", description=__doc__.split("\n")[0])
    add_nats_arguments(p)
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--engine", required=True, help="inference server URL(s), comma-separated")
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="tokenizer: model dir, 'tiny' or default"
    )
    p.add_argument("--config", default=None, help="ActorServiceConfig TOML file")
    p.add_argument(
        "--concurrency", type=int, default=None, help="episodes at once (overrides the config)"
    )
    p.add_argument(
        "--actor-id",
        default=None,
        help="actor id in events (default: the credentials' actor.<id>, else host-pid)",
    )
    p.add_argument("--max-tasks", type=int, default=None, help="exit after this many tasks")
    p.add_argument("--log-level", default="info")
    add_metrics_arguments(p)
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``leafe actor``."""
    p = _parser()
    args = p.parse_args(argv)
    configure_logging(json=True, level=args.log_level)
    try:
        nats = nats_options(args)
        actor_id = resolve_actor_id(nats, args.actor_id)
        config = load_config(
            ActorServiceConfig, files=[args.config], overrides={"concurrency": args.concurrency}
        )
    except ValueError as e:
        p.error(str(e))
    if not nats.url:
        p.error("give --nats or set LEAFE_NATS_URL")
    from leafe.learner.model_io import (  # transformers: only once the flags are good
        HFChatTokenizer,
        resolve_model,
    )

    log.info("actor.config", config=dump_config(config), model=args.model)
    model_dir = resolve_model(args.model)
    tokenizer = HFChatTokenizer.from_dir(model_dir)
    if not config.engine.context_length:
        config = msgspec.structs.replace(
            config,
            engine=msgspec.structs.replace(
                config.engine, context_length=model_context_length(model_dir)
            ),
        )
    urls = [u.strip() for u in args.engine.split(",") if u.strip()]
    metrics = ActorMetrics()
    serve_metrics(args.metrics_port, metrics.registry, args.metrics_host)

    async def serve() -> ActorStats:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_actor(
            nats=nats,
            run_id=args.run,
            tokenizer=tokenizer,
            engine_urls=urls,
            config=config,
            actor_id=actor_id,
            stop=stop,
            max_tasks=args.max_tasks,
            metrics=metrics,
        )

    stats = asyncio.run(serve())
    return 0 if stats.failed == 0 else 1
