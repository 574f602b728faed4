"""Starting a run: the run directory (configs, identity), NATS, the inference server, then the
services.

The embedded nats-server runs with authorization on, from deploy's permissions.json
(services/bus/auth.py): fresh nkeys per start, each role's seed in ``<run dir>/nats-keys/<role>.nk``
(0600). The supervisor is the admin (it alone creates the streams, before any service starts); each
service gets its role's seed file, and each actor one of its own, ``actor.<id>.nk``, pinned to its
actor id ``<run>-actor-<i>`` (it can publish events on no other actor's subject token).

A run directory is bound to what produced its log: the model, the environment and the materializer
(:meth:`RunConfig.identity`, saved in ``identity.json`` on the first start). Resuming it with any of
them changed would mix two runs in one log and one checkpoint, so it is refused with one line naming
the difference and the way out (another ``--run-id``, or ``--fresh`` to start this one over).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog
import tomli_w

from leafe.learner.model_io import resolve_model
from leafe.protocol.config import ConfigError, dump_config
from leafe.services.admin.streams import durables_for_run
from leafe.services.bus import (
    NatsOptions,
    add_nats_arguments,
    connect,
    ensure_durables,
    ensure_streams,
    nats_options,
)
from leafe.services.bus.auth import (
    actor_key_name,
    key_names,
    load_permissions,
    nkey_users,
    role_options,
    write_role_keys,
)
from leafe.services.bus.nats_server import EmbeddedNats, free_port
from leafe.services.config import tomlable
from leafe.services.inference.auth import read_api_key, write_api_key
from leafe.services.run.context import RunContext
from leafe.services.run.orphans import record_child
from leafe.services.run.presets import MAX_AUTO_SERVERS
from leafe.services.run.router import open_router, router_available
from leafe.services.run.supervisor import wait_http_ok
from leafe.services.threads import ThreadPlan, plan_cores, plan_threads

__all__ = [
    "actor_ids",
    "check_identity",
    "engine_threads",
    "prepare_run_dir",
    "start_infra",
    "start_pipeline",
]

log = structlog.get_logger(__name__)
IDENTITY = "identity.json"


def check_identity(ctx: RunContext, *, fresh: bool) -> None:
    """Refuse to resume a run directory made by another model, environment or materializer;
    ``fresh`` deletes the directory (its embedded log, checkpoints, weights, evaluations) first."""
    run_dir, want = ctx.run_dir, ctx.config.identity()
    if fresh and run_dir.exists():
        ctx.console.print(f"--fresh: deleting {run_dir}")
        shutil.rmtree(run_dir)
    path = run_dir / IDENTITY
    if path.is_file():
        have = json.loads(path.read_text(encoding="utf-8"))
        diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
        if diff:
            what = "; ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"run directory {run_dir} belongs to another run ({what}): "
                "use another --run-id, or --fresh to delete it and start over"
            )
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(want, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def prepare_run_dir(ctx: RunContext) -> None:
    """Write ``config.toml`` and each service's own config file under ``config/``."""
    cfg, conf = ctx.config, ctx.run_dir / "config"
    (ctx.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    conf.mkdir(exist_ok=True)
    (ctx.run_dir / "config.toml").write_text(
        tomli_w.dumps(tomlable(dump_config(cfg))), encoding="utf-8"
    )
    # The offline rebuild must fold with the replayer's materializer options, or the datasets
    # differ.
    replay = {"materializer": cfg.materializer, "model": cfg.model, "options": cfg.replayer.options}
    tables: dict[str, Any] = {
        "actor": dump_config(cfg.actor_config()),  # with the staleness gate filled in
        "replayer": dump_config(cfg.replayer),
        "learner": dump_config(cfg.learner),
        "replay": replay,
    }
    for name, table in tables.items():
        (conf / f"{name}.toml").write_text(tomli_w.dumps(tomlable(table)), encoding="utf-8")


def actor_ids(ctx: RunContext) -> list[str]:
    """The run's actor ids, ``<run>-actor-<i>``: each its own NATS user and events subject token."""
    return [f"{ctx.config.run_id}-actor-{i}" for i in range(ctx.config.services.actors)]


def _external_nats(url: str) -> NatsOptions:
    """An external server: the identity and TLS files of the ``LEAFE_NATS_*`` variables (an admin's,
    as the supervisor creates the streams); the services inherit the same variables."""
    parser = argparse.ArgumentParser()
    add_nats_arguments(parser)
    return msgspec.structs.replace(nats_options(parser.parse_args([])), url=url)


def _start_nats(ctx: RunContext, stack: AsyncExitStack) -> None:
    """The embedded server with one nkey user per role (permissions.json) and per actor; the
    supervisor is admin."""
    keys = write_role_keys(ctx.run_dir / "nats-keys", key_names(actor_ids(ctx)))
    users = nkey_users(
        keys, load_permissions(), run=ctx.config.run_id
    )  # each actor pinned to this run
    log_file = ctx.run_dir / "logs" / "nats.log"
    server = EmbeddedNats(ctx.run_dir / "nats", log_file=log_file, users=users).start()
    stack.callback(server.stop)
    if server.pid is not None:
        record_child(ctx.run_dir, "nats", server.pid)
    ctx.nats_server, ctx.role_nats = server, role_options(server.url, keys)
    ctx.nats = ctx.role_nats["admin"]


async def start_infra(ctx: RunContext, stack: AsyncExitStack) -> None:
    """NATS (embedded unless a URL is configured), the model, the inference server, the streams."""
    cfg = ctx.config
    if cfg.services.router and not router_available():
        raise ConfigError(
            "services.router = true needs sglang-router: pip install sglang-router==0.3.2"
        )
    if cfg.services.nats_url:
        ctx.nats = _external_nats(cfg.services.nats_url)
    else:
        _start_nats(ctx, stack)
    ctx.console.print(
        f"nats: {ctx.nats_server.url if ctx.nats_server else 'external'}; model {cfg.model!r}"
    )
    ctx.model_dir = await asyncio.to_thread(resolve_model, cfg.model)
    ctx.engine_urls = list(cfg.services.engines)
    cores, why = await asyncio.to_thread(plan_cores, cfg.services.cores)
    plan = plan_threads(
        cores, learner=cfg.services.learner, learner_threads=cfg.services.learner_threads
    )
    ctx.thread_plan = f"{plan.describe()} ({why})"
    ctx.console.print(ctx.thread_plan, markup=False, highlight=False)
    log.info("run.threads", plan=plan.__dict__, why=why)
    ctx.learner_threads, ctx.learner_alone = plan.learner, plan.learner_alone
    if not ctx.engine_urls:
        await _start_engines(ctx, stack, plan)
    if cfg.services.router:
        await _start_router(ctx, stack)
    nc = await connect(ctx.nats, name=f"leafe-run-{cfg.run_id}")
    stack.push_async_callback(nc.drain)
    ctx.js = nc.jetstream()
    # the only place a run creates streams: before any service starts
    await ensure_streams(ctx.js, replicas=cfg.services.stream_replicas)
    # ... and the run's durable consumers, which the services (their roles may not create one) bind
    durables = durables_for_run(
        cfg.run_id,
        materializers=(cfg.materializer,),
        actor=cfg.actor,
        replayer=cfg.replayer,
        learner=cfg.learner,
    )
    await ensure_durables(ctx.js, durables)


def _engine_admin_key(ctx: RunContext) -> Path:
    """The run's CPU servers' admin key (weight routes, ``/set_threads``): the supervisor's and
    weight sync's, never an actor's."""
    return ctx.run_dir / "secrets" / "engine-admin-key"


async def _start_engines(ctx: RunContext, stack: AsyncExitStack, plan: ThreadPlan) -> None:
    """The run's CPU inference servers (``services.inference_servers``), behind one API key."""
    svc = ctx.config.services
    servers = svc.inference_servers or min(plan.cores, MAX_AUTO_SERVERS)
    ctx.threads = None if svc.inference_threads > 0 else plan
    threads = svc.inference_threads or max(1, plan.inference_alone // servers)
    ctx.engine_key_file = str(write_api_key(ctx.run_dir / "secrets" / "engine-api-key"))
    # the weight routes and /set_threads: weight sync's and the supervisor's alone
    admin_key_file = ctx.engine_admin_key_file = str(write_api_key(_engine_admin_key(ctx)))
    started = []
    for i in range(servers):
        port = free_port()
        name = "inference" if i == 0 else f"inference-{i}"
        inference = ctx.service(
            name,
            [
                "inference",
                *("--model", str(ctx.model_dir), "--port", str(port)),
                *("--max-batch", str(svc.inference_max_batch)),
                *("--dtype", svc.inference_dtype),
                *("--threads", str(threads)),
                *("--api-key-file", ctx.engine_key_file, "--admin-key-file", admin_key_file),
                *("--weights-root", str(ctx.run_dir / "weights")),
            ],
        )
        await inference.start()
        stack.push_async_callback(inference.stop)
        ctx.engine_services.append(name)
        ctx.engine_urls.append(f"http://127.0.0.1:{port}")
        started.append(inference)
    for url, inference in zip(ctx.engine_urls, started, strict=True):
        await wait_http_ok(f"{url}/health", inference)


async def _start_router(ctx: RunContext, stack: AsyncExitStack) -> None:
    """sglang-router in front of the servers (``services.router``), supervised like a service:
    clients must present the engines' key, and its worker routes need a control key that only this
    process holds (``<run dir>/secrets/router-control-key``, 0600)."""
    api_key_file = ctx.engine_key_file or os.environ.get("LEAFE_ENGINE_API_KEY_FILE", "")
    if not api_key_file:
        raise ConfigError(
            "services.router = true with external engines needs their API key: set "
            "LEAFE_ENGINE_API_KEY_FILE (the router makes clients present it)"
        )
    ctx.router_key_file = str(write_api_key(ctx.run_dir / "secrets" / "router-control-key"))
    router = await open_router(
        ctx.engine_urls,
        ctx.run_dir / "logs" / "router.log",
        run_dir=ctx.run_dir,
        api_key_file=api_key_file,
        control_key_file=ctx.router_key_file,
    )
    stack.push_async_callback(router.stop)
    ctx.services[router.name] = router
    ctx.router_url, ctx.metrics_urls[router.name] = router.url, router.metrics_url
    ctx.console.print(
        f"router: {router.url} in front of {len(ctx.engine_urls)} inference server(s)"
    )


async def engine_threads(ctx: RunContext, *, shared: bool) -> None:
    """Fit the run's CPU inference servers to the plan: ``shared`` while the learner works (pinned
    to the cores it leaves, when there are several servers), every free core while it is idle. A
    no-op for external engines or a fixed ``inference_threads``; a failure is logged and the run
    goes on with the old placement (a slower run, never a wrong one)."""
    plan = ctx.threads
    if plan is None or not ctx.engine_urls:
        return
    cores = plan.inference_shared if shared else plan.inference_alone
    threads = max(1, cores // len(ctx.engine_urls))
    if len(ctx.engine_services) > 1:
        _pin_engines(ctx, cores if shared else 0)
    headers = {}
    if ctx.engine_key_file:  # the run's own servers: they have its admin key
        key = await asyncio.to_thread(read_api_key, str(_engine_admin_key(ctx)))
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for url in ctx.engine_urls:
                async with s.post(
                    f"{url}/set_threads", json={"threads": threads}, headers=headers
                ) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
    except (aiohttp.ClientError, TimeoutError, RuntimeError) as e:
        log.warning("run.threads.failed", threads=threads, error=f"{type(e).__name__}: {e}")
        return
    log.info(
        "run.threads.engine", threads=threads, servers=len(ctx.engine_urls), learner_busy=shared
    )


def _pin_engines(ctx: RunContext, cores: int) -> None:
    """Pin every local inference server to the last ``cores`` usable cores (the learner, unpinned,
    takes the others), or let them run anywhere (``cores`` = 0)."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    allowed = set(usable[-cores:]) if cores else set(usable)
    for name in ctx.engine_services:
        proc = ctx.services[name].proc
        if proc is None or proc.returncode is not None:
            continue
        try:
            os.sched_setaffinity(proc.pid, allowed)
        except OSError as e:  # a placement, not a requirement
            log.warning("run.threads.pin_failed", service=name, error=str(e))


async def start_pipeline(ctx: RunContext) -> None:
    """The replayer, the learner and weight sync (unless disabled), then the actors."""
    cfg, conf = ctx.config, ctx.run_dir / "config"
    model = str(ctx.model_dir)
    await ctx.service(
        "replayer",
        [
            "replayer",
            *ctx.nats_args("replayer"),
            "--model",
            model,
            "--config",
            str(conf / "replayer.toml"),
        ],
    ).start()
    if cfg.services.learner:
        learner = [
            "learner",
            *ctx.nats_args("learner"),
            *("--model", model, "--store", str(ctx.run_dir / "weights")),
            *("--checkpoint-dir", str(ctx.run_dir / "learner"), "--preset", cfg.learner_preset),
            *("--config", str(conf / "learner.toml")),
            *("--tensorboard-dir", str(ctx.tensorboard_dir / "learner")),
            *("--control", str(ctx.control_file)),
        ]
        phased = cfg.explore.schedule == "phased"  # the learner waits for each phase (phases.py)
        ctx.tell_learner(threads=ctx.learner_threads, release_seq=0 if phased else None)
        await engine_threads(ctx, shared=not phased)
        threads = {"OMP_NUM_THREADS": str(ctx.learner_threads)}
        await ctx.service("learner", learner, env=threads).start()
        servers = [a for url in ctx.engine_urls for a in ("--server", url)]
        transport = ("--transport", cfg.services.weight_transport)
        await ctx.service(
            "weight-sync",
            ["weight-sync", *ctx.nats_args("weight-sync"), *servers, *transport],
            engine_admin=True,  # the one child that reloads weights
        ).start()
    for i, actor_id in enumerate(actor_ids(ctx)):
        actor = [
            "actor",
            *ctx.nats_args(actor_key_name(actor_id)),
            *(
                "--engine",
                ",".join(ctx.client_urls),
                "--model",
                model,
                "--config",
                str(conf / "actor.toml"),
            ),
            *("--concurrency", str(cfg.services.actor_concurrency), "--actor-id", actor_id),
        ]
        await ctx.service(f"actor-{i}", actor).start()
    urls = ", ".join(f"{name} {url}" for name, url in ctx.metrics_urls.items())
    ctx.console.print(f"metrics (Prometheus): {urls}", markup=False, highlight=False)
