"""The end of ``leafe run``: export the log, rebuild the dataset offline from it, check it equals the
samples the learner was fed, and write ``report.json`` (the data) and ``report.md`` (the Pass@k table
with paired bootstrap intervals and a verdict per k, the run's counters, curves and one tree)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.js import JetStreamContext

from actors.evaluate import EvalResult
from actors.passk import PassKDiff, paired_difference
from learner.dataset import DatasetManifest, iter_samples, read_manifest
from protocol.codec import MSG_ID_HEADER
from protocol.events import Branch, EpisodeFinished, EpisodeStarted
from protocol.subjects import SAMPLES, samples_filter
from services.bus import read_stream
from services.eventlog.fileformat import read_events
from services.eventlog.transfer import export_run
from services.figures import lag_histogram, passk_markdown, plot_curve, plot_passk, plot_tree
from services.run.context import RunContext
from services.run.rounds import CurvePoint, RoundRecord
from services.run.supervisor import ServiceProcess

__all__ = ["DatasetCheck", "RunReport", "RunSummary", "build_report", "finish", "render_report"]

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


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the run did, counted from its log (``RunProgress``) and its services."""

    episodes: int
    """Training-time episodes finished (of the explore mode)."""
    successes: int
    """Of them, episodes in which some branch succeeded."""
    steps: int
    """Policy steps (eval included)."""
    unparseable: int
    """Steps whose answer named no valid action."""
    reflections: int
    rollbacks: int
    branches: int
    replay_steps: int
    """Env steps spent replaying prefixes on rollback."""
    events: int
    """Events in the log."""
    samples: dict[str, int]
    """Samples published, by kind."""
    learner_step: int
    learner_loss: float | None
    weights_version: str
    """Last version pushed (``default`` if none)."""


class DatasetCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The offline rebuild from the exported log against what the replayer published."""

    samples: int
    content_sha256: str
    stream_samples: int
    identical: bool
    """Same sample ids on both sides."""


class RunReport(msgspec.Struct, frozen=True, kw_only=True):
    """``report.json``: everything ``report.md`` says, as data."""

    run_id: str
    model: str
    env: str
    env_options: dict[str, Any]
    materializer: str
    evals: dict[str, EvalResult]
    """Label -> result (``before``, ``after-<version>``)."""
    comparisons: list[PassKDiff]
    """After minus before per k, with 95% intervals (empty without both evaluations)."""
    run: RunSummary
    timings: dict[str, float]
    """Seconds per stage."""
    dataset: DatasetCheck
    rounds: list[RoundRecord] = msgspec.field(default_factory=list)
    """Each explore round (continual mode)."""
    curve: list[CurvePoint] = msgspec.field(default_factory=list)
    """The learning curve on the validation slice."""
    policy_lag: dict[str, int] = msgspec.field(default_factory=dict)
    """Trained samples per policy lag (versions behind the learner's push at training time)."""
    stale_dropped: int = 0
    """Samples dropped for exceeding ``max_policy_lag``."""


def _comparisons(evals: dict[str, EvalResult]) -> list[PassKDiff]:
    after = [label for label in evals if label.startswith("after-")]
    if "before" not in evals or not after:
        return []
    a, b = evals[after[-1]], evals["before"]
    return [paired_difference(a.successes, b.successes, k) for k in sorted(set(a.passk) & set(b.passk))]


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
        comparisons=_comparisons(ctx.evals),
        run=run,
        timings={k: round(v, 1) for k, v in ctx.timings.items()},
        dataset=dataset,
        rounds=list(ctx.rounds),
        curve=list(ctx.curve),
        policy_lag=lag_histogram(p.lag_buckets),
        stale_dropped=p.stale_dropped,
    )


def _verdict(d: PassKDiff) -> str:
    if d.within_noise:
        return "within noise"
    return "better" if d.diff > 0 else "worse"


def _eval_lines(r: RunReport, cfg_eval: Any) -> list[str]:
    table = {label: e.passk for label, e in r.evals.items()}
    title = f"Pass@k on {cfg_eval.tasks} {cfg_eval.split} tasks, n = {cfg_eval.samples} samples each (%)"
    lines = [passk_markdown(table, title=title), "![Pass@k](passk.png)", ""]
    for label, e in r.evals.items():
        lines.append(
            f"- {label}: weights `{e.weight_version}`, success rate {100 * e.success_rate:.1f}%, "
            f"{e.mean_steps:.1f} actions/episode, {100 * e.parse_failure_rate:.0f}% unparseable, "
            f"{e.mean_prompt_tokens:.0f} prompt tokens/step, {e.wall_s:.0f} s"
        )
    if r.comparisons:
        lines += [
            "",
            "| after - before | difference (points) | 95% interval | verdict |",
            "|---|---|---|---|",
        ]
        for d in r.comparisons:
            lines.append(
                f"| Pass@{d.k} | {100 * d.diff:+.1f} | [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}] | {_verdict(d)} |"
            )
        lines += [
            "",
            f'Two-level bootstrap over the {r.comparisons[0].tasks} tasks and their samples. "within noise": the '
            "interval contains 0, so these evaluations cannot tell the weights apart; evaluate more tasks "
            "(`[eval] tasks`) for a verdict that means something.",
        ]
    return [*lines, ""]


def _continual_lines(r: RunReport) -> list[str]:
    """Rounds, the learning curve and the policy-lag histogram (when there are any)."""
    lines: list[str] = []
    if len(r.rounds) > 1 or r.curve:
        lines += [
            "## Continual rounds",
            "",
            "| round | tasks | finished | min | episodes (success) | learner step | weights |",
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        for x in r.rounds:
            lines.append(
                f"| {x.round} | {x.tasks} | {'yes' if x.finished else 'cut'} | {x.wall_s / 60:.1f} | "
                f"{x.episodes} ({x.successes}) | {x.learner_step} | {x.weights_version} |"
            )
        lines.append("")
    if r.curve:
        ks = sorted({k for p in r.curve for k in p.passk})
        head = " | ".join(f"Pass@{k}" for k in ks)
        lines += [
            "## Learning curve (validation slice of the train split)",
            "",
            f"| round | min | learner step | version | {head} | unparseable | eval s |",
        ]
        lines += ["|---" * (6 + len(ks)) + "|"]
        for p in r.curve:
            cells = " | ".join(f"{100 * p.passk.get(k, 0.0):.1f}" for k in ks)
            mixed = "" if len(p.policy_versions) <= 1 else " (mixed)"
            lines.append(
                f"| {p.round} | {p.wall_s / 60:.1f} | {p.learner_step} | {p.weight_version}{mixed} | {cells} | "
                f"{100 * p.parse_failure_rate:.0f}% | {p.eval_wall_s:.0f} |"
            )
        lines += ["", "![learning curve](learning_curve.png)", ""]
    if r.policy_lag or r.stale_dropped:
        hist = ", ".join(f"{k}: {v}" for k, v in r.policy_lag.items() if v)
        lines += [
            f"Policy lag of the trained samples (versions behind the learner's latest push): {hist or 'none'}; "
            f"dropped as stale (past max_policy_lag): {r.stale_dropped}.",
            "",
        ]
    return lines


def render_report(r: RunReport, cfg_eval: Any) -> str:
    """``report.md`` from the report's data."""
    lines = [f"# leafe run `{r.run_id}`", ""]
    lines += [
        f"Model `{r.model}`, environment `{r.env}` {r.env_options}, materializer `{r.materializer}`.",
        "",
    ]
    if r.evals:
        lines += _eval_lines(r, cfg_eval)
    u = r.run
    samples = ", ".join(f"{k} {v}" for k, v in u.samples.items()) or "0"
    lines += [
        "## Run",
        "",
        "| what | value |",
        "|---|---|",
        f"| wall time | {r.timings.get('total', 0) / 60:.1f} min |",
        f"| training episodes (success) | {u.episodes} ({u.successes}) |",
        f"| policy steps (unparseable) | {u.steps} ({u.unparseable}) |",
        f"| reflections / rollbacks / branches | {u.reflections} / {u.rollbacks} / {u.branches} |",
        f"| env steps spent replaying | {u.replay_steps} |",
        f"| events in the log | {u.events} |",
        f"| samples | {samples} |",
        f"| learner steps, last loss | {u.learner_step}, {u.learner_loss} |",
        f"| weight versions pushed | {u.weights_version} |",
        "",
        "Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.timings.items()),
        "",
    ]
    lines += _continual_lines(r)
    d = r.dataset
    verdict = "identical to" if d.identical else "DIFFERENT from"
    lines += [
        f"The dataset rebuilt offline from `events.leafelog` (`dataset/`, {d.samples} samples, sha256 "
        f"{d.content_sha256[:16]}...) is {verdict} the {d.stream_samples} samples the replayer published to "
        "the learner.",
        "",
        "![exploration tree](tree.png)",
        "",
    ]
    return "\n".join(lines)


async def finish(ctx: RunContext) -> None:
    """Export, rebuild, compare, plot and write ``report.json`` and ``report.md`` into the run directory."""
    run_dir = ctx.run_dir
    log_file = run_dir / "events.leafelog"
    n = await export_run(ctx.jetstream, ctx.config.run_id, log_file)
    ctx.console.print(f"exported {n} events to {log_file}")
    manifest, ids = await _rebuild(ctx, log_file)
    stream_ids = await _stream_sample_ids(ctx.jetstream, ctx.config.run_id)
    if ids != stream_ids:
        log.error(
            "run.dataset.mismatch", offline_only=len(ids - stream_ids), stream_only=len(stream_ids - ids)
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
    (run_dir / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    (run_dir / "report.md").write_text(render_report(report, ctx.config.eval), encoding="utf-8")
