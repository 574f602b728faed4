"""``leafe run``: the whole LEAFE pipeline on one machine (the main job, ``make run``).

```
 embedded nats-server (run dir) ─ LEAFE_TASKS ─► leafe actor ×N ─/generate─► leafe inference (CPU)
        │                                            │ events                                 ▲
        │                               LEAFE_EVENTS ▼              /update_weights_from_disk │
        │                      leafe replayer ─► LEAFE_SAMPLES ─► leafe learner               │
        │                                             WeightsPublished └─► leafe weight-sync ─┘
 this supervisor: eval before ─► submit tasks ─► progress ─► drain ─► eval after
                  ─► export, replay, report
```

Every service is its own ``leafe <verb>`` process (as deploy/ runs them) with its log in ``<run
dir>/logs``. Stages: (1) Pass@k of the starting weights on held-out tasks; (2) explore: submit the
train tasks, the actors explore, the replayer materializes samples, the learner trains and pushes
weights, weight sync reloads the inference server; (3) drain: wait until every episode is folded and
every sample trained, push the final weights; (4) Pass@k of the final weights; (5) export the log,
rebuild the dataset offline, check it equals what the learner was fed, and write ``report.md``.
Ctrl-C drains gracefully; running again with the same run id resumes (the nats store, checkpoints
and finished evaluations live in the run directory; finished tasks are not resubmitted).

    leafe run                # default preset: Sokoban, SmolLM2-135M-Instruct (times: README.md)
    leafe run --preset tiny  # tiny random model, a couple of tasks (the end-to-end test)
    leafe run --config my.toml --run-id exp1
    leafe run --fresh        # start the preset's run over instead of resuming it
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import structlog
from rich.console import Console

from leafe.protocol.config import ConfigError
from leafe.services.run.context import RunContext
from leafe.services.run.orphans import RunLocked
from leafe.services.run.presets import PRESETS, RunConfig, resolve_run_config
from leafe.services.run.stages import run_stages
from leafe.services.run.supervisor import ServiceError

__all__ = ["main", "run"]

log = structlog.get_logger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe run", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--preset", default="default", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--config", type=Path, default=None, help="TOML file merged over the preset")
    p.add_argument(
        "--run-id", default=None, help="run id (default: the preset's name; same id = resume)"
    )
    p.add_argument("--runs-dir", default=None, help="parent of run directories (default runs/)")
    p.add_argument("--budget-minutes", type=float, default=None, help="explore + learn budget")
    p.add_argument(
        "--fresh", action="store_true", help="delete this run's directory first (no resume)"
    )
    p.add_argument(
        "--no-live", action="store_true", help="no live table (a progress line per change instead)"
    )
    return p


def resolve(args: argparse.Namespace) -> RunConfig:
    """Preset + TOML file + flags -> the run's config (validated before anything starts)."""
    flags = {
        "run_id": args.run_id,
        "runs_dir": args.runs_dir,
        "budget_minutes": args.budget_minutes,
        "services.nats_url": os.environ.get("LEAFE_NATS_URL") or None,
    }
    return resolve_run_config(args.preset, files=[args.config], overrides=flags)


async def run(
    config: RunConfig, *, live: bool = True, console: Console | None = None, fresh: bool = False
) -> Path:
    """Run the pipeline; returns the run directory (with ``report.md``)."""
    console = console or Console(stderr=True, soft_wrap=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = RunContext(config=config, console=console, stop=stop, live=live and console.is_terminal)
    try:
        await run_stages(ctx, fresh=fresh)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return ctx.run_dir


def main(argv: list[str]) -> int:
    """Entry point of ``leafe run``."""
    args = _parser().parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)  # a piped line stays one line (logs, `| tee`)
    try:
        config = resolve(args)
    except (ConfigError, OSError, ValueError) as e:
        console.print(f"[red]leafe run: {e}[/red]")
        return 2
    started = time.time()
    try:
        run_dir = asyncio.run(run(config, live=not args.no_live, console=console, fresh=args.fresh))
    except (
        ConfigError,
        RunLocked,
    ) as e:  # the run directory belongs to another run, or it is running
        console.print(f"[red]leafe run: {e}[/red]")
        return 2
    except ServiceError as e:
        console.print(f"[red]leafe run failed: {e}[/red]")
        return 1
    report = run_dir / "report.md"
    if report.is_file():
        sys.stdout.write(report.read_text(encoding="utf-8"))
    console.print(f"run directory: {run_dir} ({(time.time() - started) / 60:.1f} min)")
    return 0
