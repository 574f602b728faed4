"""The stages of ``leafe run`` (see ``services/run/main.py`` for the picture): start, evaluate, explore,
drain, evaluate, finish. Each stage is a short coroutine over a shared :class:`RunContext`."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import structlog
import tomli_w
from rich.live import Live

from services.run.context import RunContext
from services.run.presets import RunConfig
from services.run.progress import RunProgress
from services.run.supervisor import wait_http_ok

__all__ = ["run_stages"]

log = structlog.get_logger(__name__)
MAX_RESTARTS = 3


def _write_configs(ctx: RunContext) -> None:
    from services.config import dump_config

    cfg = ctx.config
    (ctx.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    conf = ctx.run_dir / "config"
    conf.mkdir(exist_ok=True)
    (ctx.run_dir / "config.toml").write_text(tomli_w.dumps(_tomlable(dump_config(cfg))), encoding="utf-8")
    # The offline rebuild must fold with the replayer's materializer options, or the datasets differ.
    replay = {"materializer": cfg.materializer, "options": cfg.replayer.get("options", {})}
    tables = {"actor": cfg.actor, "replayer": cfg.replayer, "learner": cfg.learner, "replay": replay}
    for name, table in tables.items():
        (conf / f"{name}.toml").write_text(tomli_w.dumps(_tomlable(table)), encoding="utf-8")


def _tomlable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _tomlable(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_tomlable(v) for v in value]
    return value


async def _start_infra(ctx: RunContext, stack: AsyncExitStack) -> None:
    import os

    from learner.model_io import resolve_model
    from services.bus import connect, ensure_streams
    from services.bus.nats_server import EmbeddedNats, free_port

    cfg = ctx.config
    ctx.nats_url = cfg.services.nats_url or os.environ.get("LEAFE_NATS_URL", "")
    if not ctx.nats_url:
        server = EmbeddedNats(ctx.run_dir / "nats", log_file=ctx.run_dir / "logs" / "nats.log").start()
        stack.callback(server.stop)
        ctx.nats_server, ctx.nats_url = server, server.url
    ctx.console.print(f"nats: {ctx.nats_url}; resolving model {cfg.model!r}")
    ctx.model_dir = await asyncio.to_thread(resolve_model, cfg.model)
    ctx.engine_urls = list(cfg.services.engines)
    if not ctx.engine_urls:
        port = free_port()
        inference = ctx.service("inference", [
            "inference", "--model", str(ctx.model_dir), "--port", str(port),
            "--max-batch", str(cfg.services.inference_max_batch),
            "--threads", str(cfg.services.inference_threads),
        ])  # fmt: skip
        await inference.start()
        stack.push_async_callback(inference.stop)
        ctx.engine_urls = [f"http://127.0.0.1:{port}"]
        await wait_http_ok(f"{ctx.engine_urls[0]}/health", inference)
    nc = await connect(ctx.nats_url, name=f"leafe-run-{cfg.run_id}")
    stack.push_async_callback(nc.drain)
    ctx.js = nc.jetstream()
    await ensure_streams(ctx.js)


async def _display(ctx: RunContext) -> None:
    assert ctx.progress is not None
    if ctx.live:
        with Live(ctx.progress.table(ctx.stage), console=ctx.console, refresh_per_second=2) as live:
            while True:
                _read_learner(ctx)
                live.update(ctx.progress.table(ctx.stage))
                await asyncio.sleep(0.5)
    while True:
        await asyncio.sleep(30)
        _read_learner(ctx)
        ctx.console.print(ctx.progress.table(ctx.stage))


def _read_learner(ctx: RunContext) -> None:
    if ctx.progress is not None:
        path = ctx.run_dir / "logs" / "learner.log"
        ctx.learner_log_offset = ctx.progress.read_learner_log(path, ctx.learner_log_offset)


async def _evaluate(ctx: RunContext, label: str) -> None:
    from actors.client import SGLangClient
    from actors.evaluate import EvalResult, evaluate
    from envs.registry import make_env
    from learner.model_io import HFChatTokenizer
    from services.actor_episode import PublisherSink
    from services.bus import Publisher

    cfg, ev = ctx.config, ctx.config.eval
    path = ctx.run_dir / "eval" / f"{label}.json"
    if path.is_file():  # resumed run: this evaluation already finished
        ctx.evals[label] = msgspec.json.decode(path.read_bytes(), type=EvalResult)
        return
    ctx.stage = f"evaluating {label}"
    env = make_env(cfg.env.name, **cfg.env.options)
    task_ids = env.tasks(ev.split)[: ev.tasks]
    env.close()
    assert ctx.model_dir is not None
    tokenizer = HFChatTokenizer.from_dir(ctx.model_dir)
    async with SGLangClient(ctx.engine_urls) as engine, Publisher(ctx.js) as pub:
        result = await evaluate(
            engine=engine, tokenizer=tokenizer, env_name=cfg.env.name, env_options=cfg.env.options,
            task_ids=task_ids, split=ev.split, samples=ev.samples, ks=ev.ks, run_id=cfg.run_id,
            label=label, concurrency=ev.concurrency, sink=PublisherSink(pub), seed=ev.seed,
            rollout_overrides=_rollout_overrides(cfg),
        )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    ctx.evals[label] = result
    scores = ", ".join(f"pass@{k} {100 * v:.1f}%" for k, v in result.passk.items())
    ctx.console.print(f"eval {label}: {scores}")


def _rollout_overrides(cfg: RunConfig) -> dict[str, Any]:
    """The actors' ``[actor.rollout]`` settings for this env ("*" first), so evaluation samples exactly
    as the actors' plain rollouts do."""
    tables = cfg.actor.get("rollout", {})
    return {**tables.get("*", {}), **tables.get(cfg.env.name, {})}


async def _start_pipeline(ctx: RunContext) -> None:
    cfg, conf, run = ctx.config, ctx.run_dir / "config", ctx.config.run_id
    nats = ["--nats", ctx.nats_url, "--run", run]
    assert ctx.model_dir is not None
    model = str(ctx.model_dir)
    await ctx.service("replayer", [
        "replayer", *nats, "--materializer", cfg.materializer, "--model", model,
        "--config", str(conf / "replayer.toml"),
    ]).start()  # fmt: skip
    if cfg.services.learner:
        await ctx.service("learner", [
            "learner", *nats, "--model", model, "--store", str(ctx.run_dir / "weights"),
            "--checkpoint-dir", str(ctx.run_dir / "learner"), "--preset", cfg.learner_preset,
            "--config", str(conf / "learner.toml"),
        ], env={"OMP_NUM_THREADS": str(cfg.services.learner_threads)}).start()  # fmt: skip
        servers = [a for url in ctx.engine_urls for a in ("--server", url)]
        await ctx.service("weight-sync", ["weight-sync", *nats, *servers]).start()
    for i in range(cfg.services.actors):
        await ctx.service(f"actor-{i}", [
            "actor", *nats, "--engine", ",".join(ctx.engine_urls), "--model", model,
            "--config", str(conf / "actor.toml"), "--concurrency", str(cfg.services.actor_concurrency),
            "--actor-id", f"{run}-actor-{i}",
        ]).start()  # fmt: skip


async def _finished_task_keys(ctx: RunContext) -> set[str]:
    from protocol.events import EpisodeFinished, EpisodeStarted
    from services.eventlog.transfer import iter_stream_events

    keys: dict[str, str] = {}
    done: set[str] = set()
    async for ev in iter_stream_events(ctx.js, ctx.config.run_id):
        if isinstance(ev, EpisodeStarted):
            keys[ev.episode_id] = ev.task_key
        elif isinstance(ev, EpisodeFinished) and ev.episode_id in keys:
            done.add(keys[ev.episode_id])
    return done


async def _submit(ctx: RunContext) -> None:
    from envs.registry import make_env
    from services.tasks import make_assignments, submit

    cfg, ex = ctx.config, ctx.config.explore
    env = make_env(cfg.env.name, **cfg.env.options)
    task_ids = env.tasks("train")[ex.offset : ex.offset + ex.tasks]
    env.close()
    batch = make_assignments(
        run_id=cfg.run_id, env=cfg.env.name, task_ids=task_ids, mode=ex.mode, split="train",
        samples=ex.samples, seed=ex.seed, env_options=cfg.env.options,
    )  # fmt: skip
    ctx.explore_keys = [a.task_key for a in batch]
    done = await _finished_task_keys(ctx)
    n = await submit(ctx.js, batch, skip=done)
    ctx.console.print(f"submitted {n} {ex.mode} tasks ({len(done & set(ctx.explore_keys))} already done)")


async def _watch(ctx: RunContext, names: list[str]) -> None:
    """Restart a crashed service (up to MAX_RESTARTS times each); the log makes that safe."""
    for name in names:
        proc = ctx.services.get(name)
        if proc is None or proc.alive:
            continue
        if proc.restarts >= MAX_RESTARTS:
            proc.check()
        proc.restarts += 1
        log.warning("run.service.restart", service=name, code=proc.proc.returncode if proc.proc else None)
        ctx.console.print(f"[yellow]{name} exited; restarting ({proc.restarts}/{MAX_RESTARTS})[/yellow]")
        await proc.start()


async def _explore(ctx: RunContext) -> None:
    assert ctx.progress is not None
    ctx.stage = "exploring"
    deadline = time.monotonic() + 60 * ctx.config.budget_minutes
    await _submit(ctx)
    keys = set(ctx.explore_keys)
    while not ctx.stop.is_set() and not keys <= ctx.progress.finished_keys:
        if time.monotonic() > deadline:
            ctx.console.print("[yellow]budget reached: draining with tasks left[/yellow]")
            break
        await _watch(ctx, list(ctx.services))
        await asyncio.sleep(1.0)


async def _consumer_state(ctx: RunContext, stream: str, durable: str) -> tuple[int, int, int] | None:
    try:
        info = await ctx.js.consumer_info(stream, durable)
    except Exception:  # not created yet (service still starting)
        return None
    return int(info.num_pending or 0), int(info.num_ack_pending or 0), int(info.delivered.stream_seq or 0)


async def _wait_until(ctx: RunContext, what: str, check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ctx.stop.is_set():
        await _watch(ctx, [n for n in ctx.services if n != "inference" and not n.startswith("actor")])
        if await check():
            return True
        await asyncio.sleep(1.0)
    if not ctx.stop.is_set():
        log.warning("run.drain.timeout", waiting_for=what, timeout_s=timeout_s)
        ctx.console.print(f"[yellow]gave up waiting for {what} after {timeout_s:.0f}s[/yellow]")
    return False


async def _drain(ctx: RunContext) -> None:
    """Stop actors, let the replayer fold everything and the learner train everything, then stop them."""
    from protocol.subjects import EVENTS, SAMPLES
    from services.replayer import durable_name

    assert ctx.progress is not None
    progress = ctx.progress
    ctx.stage = "draining"
    for name in [n for n in ctx.services if n.startswith("actor")]:
        await ctx.services[name].stop(grace_s=60)
    replayer = durable_name(ctx.config.run_id, ctx.config.materializer)

    async def replayer_done() -> bool:
        state = await _consumer_state(ctx, EVENTS.name, replayer)
        return state is not None and state[0] == 0 and state[1] == 0

    await _wait_until(ctx, "the replayer to fold every event", replayer_done, 180)
    if "learner" in ctx.services:
        learner = f"learner-{ctx.config.run_id}"

        async def learner_done() -> bool:
            _read_learner(ctx)
            state = await _consumer_state(ctx, SAMPLES.name, learner)
            return state is not None and state[0] == 0 and progress.learner_samples_seq >= state[2]

        await _wait_until(ctx, "the learner to train every sample", learner_done, 300)
        await ctx.services["learner"].stop(grace_s=180)  # final step, checkpoint and push
        _read_learner(ctx)
        await _wait_weights_served(ctx)
    for name in ("weight-sync", "replayer"):
        if name in ctx.services:
            await ctx.services[name].stop(grace_s=60)


async def _wait_weights_served(ctx: RunContext) -> None:
    from actors.client import SGLangClient

    assert ctx.progress is not None
    progress = ctx.progress
    await asyncio.sleep(1.0)  # the final WeightsPublished reaches the follower
    async with SGLangClient(ctx.engine_urls) as engine:

        async def served() -> bool:
            want = progress.weights_version
            return want == "default" or await engine.weight_version() == want

        await _wait_until(ctx, f"the inference server to serve {progress.weights_version}", served, 180)


async def run_stages(ctx: RunContext) -> None:
    """All stages, with every child process stopped on the way out (also on Ctrl-C and errors)."""
    from services.logsetup import configure_logging
    from services.run.report import finish

    cfg = ctx.config
    _write_configs(ctx)
    configure_logging(json=True, file=ctx.run_dir / "logs" / "run.jsonl")
    ctx.console.print(f"leafe run {cfg.run_id}: run directory {ctx.run_dir}")
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        await _start_infra(ctx, stack)
        ctx.progress = RunProgress(run_id=cfg.run_id)
        follow_stop = asyncio.Event()
        follower = asyncio.create_task(_follow(ctx, follow_stop))
        display = asyncio.create_task(_display(ctx))
        try:
            stages = {"eval_before": lambda: _maybe_eval(ctx, "before", cfg.eval.before),
                      "start": lambda: _start_pipeline(ctx), "explore": lambda: _explore(ctx),
                      "drain": lambda: _drain(ctx)}  # fmt: skip
            for stage, make in stages.items():
                t0 = time.monotonic()
                await make()
                ctx.timings[stage] = time.monotonic() - t0
            if not ctx.stop.is_set():
                version = ctx.progress.weights_version
                if cfg.eval.after and version != "default":
                    t0 = time.monotonic()
                    await _unless_stopped(ctx, _evaluate(ctx, f"after-{version}"))
                    ctx.timings["eval_after"] = time.monotonic() - t0
            ctx.stage = "finishing"
            ctx.timings["total"] = time.monotonic() - started
            await finish(ctx)
        finally:
            display.cancel()
            follow_stop.set()
            await asyncio.gather(follower, display, return_exceptions=True)
            for proc in reversed(list(ctx.services.values())):
                await proc.stop(grace_s=30)


async def _follow(ctx: RunContext, stop: asyncio.Event) -> None:
    """Keep the progress counters fed; if the subscription fails, say so and rebuild them from the log."""
    while not stop.is_set():
        try:
            assert ctx.progress is not None
            await ctx.progress.follow(ctx.js, stop)
        except Exception as e:
            log.warning("run.progress.restart", error=f"{type(e).__name__}: {e}")
            ctx.console.print(
                f"[yellow]progress follower failed ({type(e).__name__}: {e}); rebuilding[/yellow]"
            )
            old = ctx.progress
            assert old is not None
            # Stream-fed counters restart from zero (the new subscription replays the log from its start);
            # the learner's come from its log file and carry over.
            ctx.progress = RunProgress(
                run_id=old.run_id, started_at=old.started_at, learner_step=old.learner_step,
                learner_loss=old.learner_loss, learner_samples_seq=old.learner_samples_seq,
            )  # fmt: skip
            await asyncio.sleep(1.0)


async def _maybe_eval(ctx: RunContext, label: str, enabled: bool) -> None:
    if enabled and not ctx.stop.is_set():
        await _unless_stopped(ctx, _evaluate(ctx, label))


async def _unless_stopped(ctx: RunContext, coro: Any) -> None:
    """Run ``coro`` but cancel it on Ctrl-C/SIGTERM (an unfinished evaluation is redone on resume)."""
    work = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(ctx.stop.wait())
    await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        ctx.console.print("[yellow]interrupted: evaluation cancelled (it is redone on resume)[/yellow]")
        return
    work.result()
