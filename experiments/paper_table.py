"""The paper's comparison at our scale, with a warm start and with power: Base, Base + SFT, Early
Experience (IWM, SR), GRPO (online rounds from Base + SFT), RFT, LEAFE from GRPO (model
reflections), LEAFE with oracle reflections (ablation), L_reh only, and a noise check, on held-out
Sokoban tasks; paired bootstrap intervals and a verdict per comparison; the Table 3 shape from Base
+ SFT. Writes ``experiments/results/<report_name>.{md,json,png}`` and the collections' logs under
``experiments/results/paper_logs/<name>/``. The protocol and phases: ``experiments/paper/``
(``phases.py``); how to reproduce every row: ``docs/experiments.md``.

    PYTHONPATH=$PWD .venv/bin/python -m experiments.paper_table --scale small  # < ~45 min, 2 cores
    PYTHONPATH=$PWD .venv/bin/python -m experiments.paper_table --scale full --max-minutes 1800
    .venv/bin/python -m experiments.paper_table --scale small --plan    # the phases, no run
    .venv/bin/python -m experiments.paper_table --scale small \
        --estimate experiments/configs/paper_full.toml
    .venv/bin/python -m experiments.paper_table --scale small --report  # rewrite the report only
    .venv/bin/python -m experiments.paper_table --config my.toml --set grpo.rounds=3 \
        --engine http://sglang:30000

A rerun of the same command resumes (finished phases leave ``runs/paper/<name>/<phase>/done.json``);
``--max-minutes`` starts no phase after that many minutes (the plan is in priority order);
``--stop-minutes`` stops the invocation then, whatever runs, as SIGTERM does (a training checkpoints
the step it is in; an evaluation or a collection starts again next time).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from pathlib import Path

from experiments.paper.carry import state_dir
from experiments.paper.config import PaperConfig, load_paper_config, scale_path
from experiments.paper.estimate import estimate_table, unit_costs
from experiments.paper.plans import plan
from experiments.paper.runner import Runner, rewrite_report, run_experiment

__all__ = ["main"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    from leafe.services.config import parse_key_value

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--scale",
        default="small",
        help="reads experiments/configs/paper_<scale>.toml (small | full | humaneval)",
    )
    p.add_argument(
        "--config", type=Path, default=None, help="a PaperConfig TOML instead of --scale's"
    )
    p.add_argument(
        "--set", type=parse_key_value, action="append", default=[], help="dotted KEY=VALUE override"
    )
    p.add_argument(
        "--engine", default="", help="SGLang URL(s), comma-separated (instead of CPU servers)"
    )
    p.add_argument("--work", type=Path, default=None, help="work dir (default runs/paper/<name>)")
    p.add_argument(
        "--results", type=Path, default=Path("experiments/results"), help="where the report goes"
    )
    p.add_argument(
        "--max-minutes", type=float, default=1e9, help="start no phase after this many minutes"
    )
    p.add_argument(
        "--stop-minutes",
        type=float,
        default=None,
        help="stop after this many minutes whatever runs "
        "(as SIGTERM: a training checkpoints its step)",
    )
    p.add_argument(
        "--plan", action="store_true", help="print the phases and their dependencies, run nothing"
    )
    p.add_argument("--quick", action="store_true", help="same as --plan (make bench)")
    p.add_argument(
        "--estimate", type=Path, default=None, help="estimate this config's wall time from the run"
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="move the work dir and the carried records aside, start over",
    )
    p.add_argument(
        "--report", action="store_true", help="rewrite the report from the finished phases only"
    )
    return p.parse_args(argv)


def _config(args: argparse.Namespace) -> PaperConfig:
    overrides = dict(args.set)
    if args.engine:
        overrides["serving.engines"] = [u for u in args.engine.split(",") if u]
    return load_paper_config(args.config or scale_path(args.scale), overrides)


def _print_plan(cfg: PaperConfig) -> None:
    for i, p in enumerate(plan(cfg), start=1):
        print(f"{i:3d}. {p.name:<28} [{p.stage}] needs: {', '.join(p.deps) or '-'}")


def _estimate(cfg: PaperConfig, work: Path, target: Path, results: Path) -> None:
    other = load_paper_config(target)
    runner = Runner(
        cfg, work, results, deadline=0.0, register=False
    )  # reads the finished phases only
    units = unit_costs(runner.state)
    lines = [
        f"# Estimate for `{other.name}` from the unit costs of `{cfg.name}` ({work})",
        "",
        "```json",
        json.dumps(units, indent=1),
        "```",
        "",
        *estimate_table(other, units),
    ]
    out = results / f"paper_estimate_{other.name}.md"
    results.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse flags, then print the plan, estimate, or run the phases."""
    from leafe.services.logsetup import configure_logging

    args = _args(argv)
    cfg = _config(args)
    if args.plan or args.quick:
        _print_plan(cfg)
        return 0
    work = args.work or Path("runs/paper") / cfg.name
    if args.estimate:
        _estimate(cfg, work, args.estimate, args.results)
        return 0
    if args.report:
        rewrite_report(cfg, work, args.results)
        return 0
    if args.fresh:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
        if work.exists():
            work.rename(work.with_name(f"{work.name}.old-{stamp}"))
        carried = state_dir(args.results, cfg.name)  # the records carried in the repository, too
        if carried.exists():
            carried.rename(carried.with_name(f"state.old-{stamp}"))
    work.mkdir(parents=True, exist_ok=True)
    configure_logging(json=True, level="info", file=work / "paper_table.jsonl")
    try:
        asyncio.run(run_experiment(cfg, work, args.results, args.max_minutes, args.stop_minutes))
    except asyncio.CancelledError:
        print(
            "[paper_table] stopped (SIGTERM or --stop-minutes); the finished phases are saved",
            flush=True,
        )
        return 143
    print(json.dumps({"report": str(args.results / f"{cfg.report_name}.md")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
