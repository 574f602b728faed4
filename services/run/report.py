"""The end of ``leafe run``: export the log, rebuild the dataset offline from it, check it equals the
samples the learner was fed, and write ``report.md`` with the Pass@k table, curves and one tree."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog

from services.figures import passk_markdown, plot_passk, plot_tree
from services.run.context import RunContext

__all__ = ["finish"]

log = structlog.get_logger(__name__)


async def _stream_sample_ids(js: Any, run_id: str) -> set[str]:
    from protocol.codec import MSG_ID_HEADER
    from protocol.subjects import SAMPLES
    from services.bus import read_stream

    ids: set[str] = set()
    async for msg in read_stream(js, stream=SAMPLES.name, filter_subject=f"leafe.{run_id}.samples.>"):
        ids.add((msg.headers or {}).get(MSG_ID_HEADER, ""))
    return ids


async def _rebuild(ctx: RunContext, log_file: Path) -> tuple[Path, Any]:
    from learner.dataset import iter_samples, read_manifest
    from services.run.supervisor import ServiceProcess

    out = ctx.run_dir / "dataset"
    proc = ServiceProcess("replay", [
        "replay", "--from", str(log_file), "--run", ctx.config.run_id, "--materializer",
        ctx.config.materializer, "--model", str(ctx.model_dir), "--out", str(out), "--no-progress",
        "--config", str(ctx.run_dir / "config" / "replay.toml"),
    ], ctx.run_dir / "logs" / "replay.log")  # fmt: skip
    await proc.start()
    assert proc.proc is not None
    if await proc.proc.wait() != 0:
        raise RuntimeError(f"leafe replay failed; see {proc.log_path}:\n{proc.tail()}")
    manifest = read_manifest(out)
    ids = {s.sample_id for s in await asyncio.to_thread(lambda: list(iter_samples(out)))}
    return out, (manifest, ids)


def _pick_tree(log_file: Path) -> list[Any]:
    """Events of the most instructive explore episode: most branches, a success preferred."""
    from protocol.events import Branch, EpisodeFinished, EpisodeStarted
    from services.eventlog.fileformat import read_events

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


def _report(ctx: RunContext, dataset: Path, manifest: Any, same: bool, n_stream: int) -> str:
    cfg, p = ctx.config, ctx.progress
    assert p is not None
    table = {label: r.passk for label, r in ctx.evals.items()}
    lines = [f"# leafe run `{cfg.run_id}`", ""]
    lines += [f"Model `{cfg.model}`, environment `{cfg.env.name}` {cfg.env.options}, "
              f"materializer `{cfg.materializer}`.", ""]  # fmt: skip
    if table:
        lines += [passk_markdown(table, title=f"Pass@k on {cfg.eval.tasks} {cfg.eval.split} tasks, "
                                 f"n = {cfg.eval.samples} samples each (%)"), "![Pass@k](passk.png)", ""]  # fmt: skip
        for label, r in ctx.evals.items():
            lines.append(f"- {label}: weights `{r.weight_version}`, success rate {100 * r.success_rate:.1f}%, "
                         f"{r.mean_steps:.1f} actions/episode, {100 * r.parse_failure_rate:.0f}% unparseable, "
                         f"{r.mean_prompt_tokens:.0f} prompt tokens/step, {r.wall_s:.0f} s")  # fmt: skip
        lines.append("")
    ex_done, ex_ok = p.episodes_finished.get(cfg.explore.mode, 0), p.successes.get(cfg.explore.mode, 0)
    lines += ["## Run", "", "| what | value |", "|---|---|",
              f"| wall time | {ctx.timings.get('total', 0) / 60:.1f} min |",
              f"| {cfg.explore.mode} episodes (success) | {ex_done} ({ex_ok}) |",
              f"| policy steps (unparseable) | {p.steps} ({p.parse_failures}) |",
              f"| reflections / rollbacks / branches | {p.reflections} / {p.rollbacks} / {p.branches} |",
              f"| env steps spent replaying | {p.replay_steps} |",
              f"| events in the log | {p.events} |",
              f"| samples | {', '.join(f'{k} {v}' for k, v in sorted(p.samples.items())) or 0} |",
              f"| learner steps, last loss | {p.learner_step}, {p.learner_loss} |",
              f"| weight versions pushed | {p.weights_version} |", ""]  # fmt: skip
    lines += ["Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in ctx.timings.items()), ""]
    verdict = "identical to" if same else "DIFFERENT from"
    lines += [f"The dataset rebuilt offline from `events.leafelog` (`{dataset.name}/`, {manifest.samples} samples, "
              f"sha256 {manifest.content_sha256[:16]}...) is {verdict} the {n_stream} samples the replayer "
              "published to the learner.", "", "![exploration tree](tree.png)", ""]  # fmt: skip
    return "\n".join(lines)


async def finish(ctx: RunContext) -> None:
    """Export, rebuild, compare, plot and write ``report.md`` into the run directory."""
    from services.eventlog.transfer import export_run

    run_dir = ctx.run_dir
    log_file = run_dir / "events.leafelog"
    n = await export_run(ctx.js, ctx.config.run_id, log_file)
    ctx.console.print(f"exported {n} events to {log_file}")
    dataset, (manifest, ids) = await _rebuild(ctx, log_file)
    stream_ids = await _stream_sample_ids(ctx.js, ctx.config.run_id)
    same = ids == stream_ids
    if not same:
        log.error(
            "run.dataset.mismatch", offline_only=len(ids - stream_ids), stream_only=len(stream_ids - ids)
        )
    if ctx.evals:
        plot_passk({k: r.passk for k, r in ctx.evals.items()}, run_dir / "passk.png")
    tree = await asyncio.to_thread(_pick_tree, log_file)
    if tree:
        await asyncio.to_thread(plot_tree, tree, run_dir / "tree.png")
    (run_dir / "report.md").write_text(
        _report(ctx, dataset, manifest, same, len(stream_ids)), encoding="utf-8"
    )
