"""The end of ``leafe run``: export the log, rebuild the dataset offline from it, check it equals
the samples the learner was fed, and write ``report.json`` (the data,
``services/run/report_data.py``) and ``report.md`` (rendered from it by
``services/run/report_md.py``: the Pass@k table with paired bootstrap intervals and a verdict per k,
what each part of the run did, the run's counters, curves and one tree)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.js import JetStreamContext

from leafe.learner.dataset import DatasetManifest, iter_samples, read_manifest
from leafe.protocol.codec import MSG_ID_HEADER
from leafe.protocol.events import Branch, EpisodeFinished, EpisodeStarted
from leafe.protocol.subjects import SAMPLES, samples_filter
from leafe.services.bus import read_stream
from leafe.services.eventlog.fileformat import read_events
from leafe.services.eventlog.transfer import export_run
from leafe.services.figures import lag_histogram, plot_curve, plot_passk, plot_tree
from leafe.services.run.context import RunContext
from leafe.services.run.report_data import (
    DatasetCheck,
    RunReport,
    RunSummary,
    comparisons,
    part_comparisons,
)
from leafe.services.run.report_md import render_report
from leafe.services.run.supervisor import ServiceProcess

__all__ = ["build_report", "finish"]

log = structlog.get_logger(__name__)


async def _stream_sample_ids(js: JetStreamContext, run_id: str) -> set[str]:
    ids: set[str] = set()
    async for msg in read_stream(js, stream=SAMPLES.name, filter_subject=samples_filter(run_id)):
        ids.add((msg.headers or {}).get(MSG_ID_HEADER, ""))
    return ids


async def _rebuild(ctx: RunContext, log_file: Path) -> tuple[DatasetManifest, set[str]]:
    out = ctx.run_dir / "dataset"
    argv = [
        *("replay", "--from", str(log_file), "--run", ctx.config.run_id),
        *("--model", str(ctx.model_dir), "--out", str(out), "--no-progress"),
        *("--config", str(ctx.run_dir / "config" / "replay.toml")),
    ]
    proc = ServiceProcess("replay", argv, ctx.run_dir / "logs" / "replay.log")
    await proc.start()
    assert proc.proc is not None
    if await proc.proc.wait() != 0:
        raise RuntimeError(f"leafe replay failed; see {proc.log_path}:\n{proc.tail()}")
    manifest = read_manifest(out)
    ids = {s.sample_id for s in await asyncio.to_thread(lambda: list(iter_samples(out)))}
    return manifest, ids


def _pick_tree(log_file: Path) -> list[Any]:
    """Events of the most instructive explore episode: most branches, a success preferred."""
    by_episode: dict[str, list[Any]] = {}
    explore: set[str] = set()
    for ev in read_events(log_file, strict=False):
        by_episode.setdefault(ev.episode_id, []).append(ev)
        if isinstance(ev, EpisodeStarted) and ev.mode == "explore":
            explore.add(ev.episode_id)

    def score(eid: str) -> tuple[bool, int]:
        evs = by_episode[eid]
        ok = any(isinstance(e, EpisodeFinished) and e.success for e in evs)
        return ok, sum(isinstance(e, Branch) for e in evs)

    best = max(explore, key=score, default=None)
    return by_episode[best] if best else []


def build_report(
    ctx: RunContext, manifest: DatasetManifest, stream_ids: set[str], ids: set[str]
) -> RunReport:
    """The run's report as data."""
    cfg, p = ctx.config, ctx.progress
    assert p is not None
    mode = cfg.explore.mode
    run = RunSummary(
        episodes=p.episodes_finished.get(mode, 0),
        successes=p.successes.get(mode, 0),
        steps=p.steps,
        unparseable=p.parse_failures,
        reflections=p.reflections,
        rollbacks=p.rollbacks,
        branches=p.branches,
        replay_steps=p.replay_steps,
        events=p.events,
        samples=dict(sorted(p.samples.items())),
        learner_step=p.learner_step,
        learner_loss=p.learner_loss,
        weights_version=p.weights_version,
    )
    dataset = DatasetCheck(
        samples=manifest.samples,
        content_sha256=manifest.content_sha256,
        stream_samples=len(stream_ids),
        identical=ids == stream_ids,
    )
    return RunReport(
        run_id=cfg.run_id,
        model=cfg.model,
        env=cfg.env.name,
        env_options=cfg.env.options,
        materializer=cfg.materializer,
        evals=dict(ctx.evals),
        comparisons=comparisons(ctx.evals),
        run=run,
        timings={k: round(v, 1) for k, v in ctx.timings.items()},
        dataset=dataset,
        rounds=list(ctx.rounds),
        curve=list(ctx.curve),
        policy_lag=lag_histogram(p.lag_buckets),
        stale_dropped=p.stale_dropped,
        step_counts=dict(p.step_counts),
        parts=part_comparisons(ctx.evals, mode),
        schedule=cfg.explore.schedule,
        budget_minutes=cfg.budget_minutes,
        cuts=list(ctx.cuts),
        threads=ctx.thread_plan,
    )


async def finish(ctx: RunContext) -> None:
    """Export, rebuild, compare, plot and write ``report.json`` and ``report.md`` into the run
    directory."""
    run_dir = ctx.run_dir
    log_file = run_dir / "events.leafelog"
    n = await export_run(ctx.jetstream, ctx.config.run_id, log_file)
    ctx.console.print(f"exported {n} events to {log_file}")
    manifest, ids = await _rebuild(ctx, log_file)
    stream_ids = await _stream_sample_ids(ctx.jetstream, ctx.config.run_id)
    if ids != stream_ids:
        log.error(
            "run.dataset.mismatch",
            offline_only=len(ids - stream_ids),
            stream_only=len(stream_ids - ids),
        )
    if ctx.evals:
        plot_passk({k: r.passk for k, r in ctx.evals.items()}, run_dir / "passk.png")
    if ctx.curve:
        await asyncio.to_thread(
            plot_curve, [msgspec.to_builtins(p) for p in ctx.curve], run_dir / "learning_curve.png"
        )
    tree = await asyncio.to_thread(_pick_tree, log_file)
    if tree:
        await asyncio.to_thread(plot_tree, tree, run_dir / "tree.png")
    report = await asyncio.to_thread(build_report, ctx, manifest, stream_ids, ids)
    (run_dir / "report.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n"
    )
    (run_dir / "report.md").write_text(render_report(report, ctx.config.eval), encoding="utf-8")
