"""``leafe eval``: Pass@k of one or more models or weight versions, side by side.

For each ``--model`` (``tiny``, ``smollm2-135m-instruct`` or an HF directory such as an exported
weight version) CPU inference servers are started, one child process per free core with one thread
each (``services/inference/fleet.py``; ``--servers N`` sets how many, ``--in-process`` serves from
this process with ``--threads``), ``leafe.actors.evaluate.evaluate`` runs n plain ``mode="eval"``
rollouts of every task through them (the actors' client and prompts, episodes spread by affinity),
and the servers are stopped. With ``--engine URL[,URL]`` the running servers (SGLang or ``leafe
inference``) are evaluated once instead. The output directory gets ``eval.json`` (every figure),
``eval.md`` (the Pass@k table and a line per model: wall time, parse failures, prompt tokens per
step) and ``passk.png`` (the curves); the table is also printed. With ``--nats URL --run RUN`` the
eval episodes are published to the run's log too. When the ``tensorboard`` package is installed
(extra ``tb``), ``<out>/tensorboard/<label>/`` gets each model's Pass@k as scalars
(:func:`write_passk_scalars`; ``tensorboard --logdir <out>/tensorboard`` overlays the models).

```
leafe eval --model tiny --model runs/r1/weights/v000040 --env sokoban --split test --tasks 16 \\
           --samples 16 --k 1,2,4,8,16 --concurrency 16 --out runs/r1/eval
leafe eval --engine http://127.0.0.1:30000 --tokenizer smollm2-135m-instruct --env sokoban --out
/tmp/ev
```
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from leafe.actors.client import SGLangClient
from leafe.actors.engine import Engine, EngineError
from leafe.actors.episode import EventSink
from leafe.actors.evaluate import EvalRequest, EvalResult, evaluate
from leafe.envs.base import EnvError
from leafe.envs.registry import make_env
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.subjects import EVENTS, validate_run_id
from leafe.protocol.tasks import task_slug
from leafe.services.actor.service import PublisherSink
from leafe.services.bus import (
    Publisher,
    add_nats_arguments,
    connect,
    nats_options,
    wait_for_streams,
)
from leafe.services.config import parse_key_value
from leafe.services.eval.progress import EvalProgress
from leafe.services.eval.scalars import write_passk_scalars
from leafe.services.logsetup import configure_logging

__all__ = [
    "EvalReport",
    "Target",
    "main",
    "report_markdown",
    "run_eval",
    "write_report",
]

log = structlog.get_logger(__name__)


class EvalReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``eval.json`` holds: the setting and one result per model, in command-line order."""

    env: str
    """Environment registry name."""
    env_options: dict[str, Any]
    """Environment options."""
    split: str
    """Task split."""
    run_id: str
    """Run the eval episodes belong to."""
    samples: int
    """n: rollouts per task."""
    ks: list[int]
    """k values scored (those <= n)."""
    task_ids: list[str]
    """Tasks evaluated."""
    rollout_overrides: dict[str, Any]
    """Rollout config overrides given on the command line."""
    results: list[EvalResult]
    """One per model / engine."""


@dataclass(frozen=True, slots=True)
class Target:
    """One thing to evaluate: a model to serve in-process, or running engine URLs."""

    label: str
    model: str | None = None
    urls: tuple[str, ...] = ()


def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--k {text!r}: expected comma-separated integers"
        ) from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"--k {text!r}: need at least one k, all >= 1")
    return ks


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leafe eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model", action="append", help="tiny | smollm2-135m-instruct | HF dir (repeatable)"
    )
    what.add_argument("--engine", help="running server URL(s), comma-separated, evaluated once")
    p.add_argument(
        "--label", action="append", default=[], help="name per --model / for --engine, in order"
    )
    p.add_argument(
        "--tokenizer", default=None, help="with --engine: model name or dir of the tokenizer"
    )
    p.add_argument("--env", default="sokoban", help="environment name (default sokoban)")
    p.add_argument(
        "--env-option", action="append", type=parse_key_value, default=[], help="KEY=VALUE"
    )
    p.add_argument(
        "--rollout-option",
        action="append",
        type=parse_key_value,
        default=[],
        help="RolloutConfig K=V",
    )
    p.add_argument("--split", default="test", help="task split (default test)")
    p.add_argument("--tasks", type=int, default=16, help="number of tasks (default 16)")
    p.add_argument("--task-offset", type=int, default=0, help="first task index of the split")
    p.add_argument("--samples", type=int, default=16, help="n: rollouts per task (default 16)")
    p.add_argument("--k", type=_ks, default=[1, 2, 4, 8, 16], help="k values, e.g. 1,2,4,8,16")
    p.add_argument(
        "--concurrency", type=int, default=0, help="rollouts in flight at once (0 = 16 per server)"
    )
    p.add_argument("--seed", type=int, default=0, help="base sampling seed")
    p.add_argument(
        "--seeds-honoured",
        choices=("yes", "no", "unknown"),
        default="unknown",
        help="with --engine: does it honour sampling_seed "
        "(SGLang: only with --enable-deterministic-inference)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds one /generate may take"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="directory for eval.json, eval.md, passk.png"
    )
    p.add_argument(
        "--tensorboard-dir",
        type=Path,
        default=None,
        help="Pass@k scalars (default <out>/tensorboard)",
    )
    p.add_argument(
        "--max-batch", type=int, default=0, help="batch per server (0 = its share of --concurrency)"
    )
    p.add_argument(
        "--servers",
        type=int,
        default=0,
        help="server processes, one core and thread each (0 = the free cores)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="serving dtype"
    )
    p.add_argument(
        "--in-process", action="store_true", help="one server in this process (tests, debugging)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per server (0 = 1 per server process; --in-process: the free cores)",
    )
    p.add_argument("--run", default=None, help="run id of the episodes (default eval)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log-level", default="warning", help="log level (default warning)")
    add_nats_arguments(p)
    p.set_defaults(nats="")  # publishing is opt-in: $LEAFE_NATS_URL alone does not turn it on
    return p


def _default_label(model: str) -> str:
    return task_slug(Path(model).name if "/" in model or Path(model).is_dir() else model) or "model"


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    """The models/engine to evaluate, each with a unique key-safe label."""
    if args.engine:
        urls = tuple(u.strip() for u in args.engine.split(",") if u.strip())
        if len(args.label) > 1:
            raise ValueError(f"--label given {len(args.label)} times for one --engine")
        return [Target(label=task_slug(args.label[0]) if args.label else "engine", urls=urls)]
    if len(args.label) > len(args.model):
        raise ValueError(f"{len(args.label)} --label for {len(args.model)} --model")
    out: list[Target] = []
    for i, model in enumerate(args.model):
        label = task_slug(args.label[i]) if i < len(args.label) else _default_label(model)
        taken = {t.label for t in out}
        unique, n = label, 2
        while unique in taken:
            unique, n = f"{label}-{n}", n + 1
        out.append(Target(label=unique, model=model))
    return out


def _manifest_version(path: Path) -> str:
    """An exported weight version's own name (``manifest.json``), so its events carry it."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "default"
    return str(json.loads(manifest.read_text(encoding="utf-8")).get("version") or "default")


@asynccontextmanager
async def _engine_for(
    target: Target, args: argparse.Namespace
) -> AsyncIterator[tuple[Engine, ChatTokenizer]]:
    """An engine and the matching tokenizer: a fresh in-process server for a model, else the
    URLs."""
    from leafe.learner.model_io import HFChatTokenizer, resolve_model
    from leafe.services.inference.fleet import FleetConfig, ServerFleet
    from leafe.services.inference.server import InferenceConfig, InferenceServer

    if target.model is None:
        async with SGLangClient(list(target.urls), timeout_s=args.request_timeout) as client:
            name = args.tokenizer or str((await client.model_info()).get("tokenizer_path", ""))
            if args.tokenizer is None and not await asyncio.to_thread(Path(name).is_dir):
                raise ValueError(
                    f"the engine's tokenizer_path {name!r} is not a local directory: pass "
                    "--tokenizer"
                )
            yield client, HFChatTokenizer.from_dir(resolve_model(name))
        return
    path = resolve_model(target.model)
    if not args.in_process:
        fleet = FleetConfig(
            model=str(path),
            servers=args.servers,
            dtype=args.dtype,
            max_batch=args.max_batch or -(-args.concurrency // args.servers),
            threads=args.threads or 1,
            served_model_name=target.label,
            weight_version=_manifest_version(path),
        )
        async with (
            ServerFleet(fleet) as servers,
            SGLangClient(
                servers.urls, timeout_s=args.request_timeout, api_key_file=servers.api_key_file
            ) as client,
        ):
            yield client, HFChatTokenizer.from_dir(path)
        return
    config = InferenceConfig(
        model=str(path),
        port=0,
        max_batch=args.max_batch or args.concurrency,
        threads=_threads(args.threads),
        dtype=args.dtype,
        served_model_name=target.label,
        weight_version=_manifest_version(path),
    )
    async with (
        InferenceServer(config) as server,
        SGLangClient(server.url, timeout_s=args.request_timeout) as client,
    ):
        yield client, HFChatTokenizer.from_dir(path)


def _size_servers(args: argparse.Namespace) -> None:
    """Fill in ``--servers`` (0: one per free core; 1 with ``--in-process``; the URLs with
    ``--engine``) and ``--concurrency`` (0: 16 per server), and log what was chosen and why."""
    from leafe.services.threads import free_cores

    why = "as requested"
    if args.engine:
        args.servers, why = (
            len([u for u in args.engine.split(",") if u.strip()]),
            "one per --engine URL",
        )
    elif args.in_process:
        args.servers, why = 1, "--in-process"
    elif args.servers == 0:
        args.servers, why = free_cores()
    args.concurrency = args.concurrency or 16 * args.servers
    log.info("eval.servers", servers=args.servers, concurrency=args.concurrency, why=why)


def _threads(requested: int) -> int:
    from leafe.services.threads import default_threads

    threads, why = default_threads(requested)
    log.info("eval.threads", threads=threads, why=why)
    return threads


async def _open_publisher(stack: AsyncExitStack, args: argparse.Namespace) -> Publisher | None:
    """A publisher on the run's log when ``--nats`` is given, else ``None`` (events are dropped)."""
    if not args.nats:
        return None
    nats = nats_options(args)
    nc = await connect(nats, name="leafe-eval")
    stack.push_async_callback(nc.close)
    js = nc.jetstream()
    await wait_for_streams(js, [EVENTS.name], timeout_s=nats.streams_timeout_s)
    return await stack.enter_async_context(Publisher(js))


async def run_eval(
    args: argparse.Namespace, task_ids: Sequence[str], ks: list[int]
) -> list[EvalResult]:
    """Evaluate every target in turn (one in-process server at a time)."""
    targets = targets_from_args(args)
    env_options, overrides = dict(args.env_option), dict(args.rollout_option)
    results: list[EvalResult] = []
    progress = EvalProgress(not args.no_progress, live=sys.stderr.isatty())
    try:
        async with AsyncExitStack() as stack:
            publisher = await _open_publisher(stack, args)
            sink: EventSink | None = None if publisher is None else PublisherSink(publisher)
            for target in targets:
                async with _engine_for(target, args) as (engine, tokenizer):
                    request = EvalRequest(
                        env=args.env,
                        env_options=env_options,
                        task_ids=list(task_ids),
                        split=args.split,
                        samples=args.samples,
                        ks=ks,
                        run_id=args.run or "eval",
                        label=target.label,
                        concurrency=args.concurrency,
                        seed=args.seed,
                        rollout_overrides=overrides,
                        seeds_honoured="yes" if target.model is not None else args.seeds_honoured,
                    )
                    result = await evaluate(
                        request,
                        engine=engine,
                        tokenizer=tokenizer,
                        sink=sink,
                        on_episode=progress.track(target.label, len(task_ids) * args.samples),
                    )
                if publisher is not None:
                    await publisher.flush()
                results.append(result)
    finally:
        progress.stop()
    return results


def report_markdown(report: EvalReport) -> str:
    """``eval.md``: the Pass@k table and one line per model with its cost figures."""
    from leafe.services.figures import passk_markdown

    head = (
        f"# Pass@k: {report.env}, split {report.split}\n\n"
        f"{len(report.task_ids)} tasks x {report.samples} samples, run `{report.run_id}`; "
        f"env options {report.env_options or '{}'}; rollout overrides "
        f"{report.rollout_overrides or '{}'}\n\n"
    )
    table = passk_markdown({r.label: r.passk for r in report.results})
    return head + table + "\n" + "\n".join(map(_cost_line, report.results)) + "\n"


def _cost_line(r: EvalResult) -> str:
    solved = sum(map(sum, r.successes.values()))
    errors = f"; {r.env_errors} env errors" if r.env_errors else ""
    return (
        f"- `{r.label}` (weight version {r.weight_version}): {solved}/{r.episodes} rollouts "
        "solved; "
        f"{r.mean_steps:.1f} steps/rollout; parse failures {100 * r.parse_failure_rate:.1f}% of "
        "actions; "
        f"{r.mean_prompt_tokens:.0f} prompt tokens/step; wall {r.wall_s:.1f} s{errors}; "
        f"reproducible: {r.reproducible}"
    )


def write_report(report: EvalReport, out: Path) -> list[Path]:
    """Write ``eval.json``, ``eval.md`` and ``passk.png`` into ``out``; returns their paths."""
    from leafe.services.figures import plot_passk

    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n"
    )
    (out / "eval.md").write_text(report_markdown(report), encoding="utf-8")
    title = (
        f"Pass@k on {report.env} ({report.split}, {len(report.task_ids)} tasks, n={report.samples})"
    )
    plot_passk({r.label: r.passk for r in report.results}, out / "passk.png", title=title)
    return [out / "eval.json", out / "eval.md", out / "passk.png"]


def _task_ids(args: argparse.Namespace) -> list[str]:
    env = make_env(args.env, **dict(args.env_option))
    try:
        catalogue = env.tasks(args.split)
    finally:
        env.close()
    chosen = catalogue[args.task_offset : args.task_offset + args.tasks]
    if len(chosen) < args.tasks:
        raise ValueError(
            f"--tasks {args.tasks} --task-offset {args.task_offset}: split {args.split!r} of "
            f"{args.env!r} "
            f"has only {len(catalogue)} tasks"
        )
    return chosen


def main(argv: list[str]) -> int:
    """Entry point of ``leafe eval``."""
    p = _parser()
    args = p.parse_args(argv)
    configure_logging(json=False, level=args.log_level)
    if args.nats and not args.run:
        p.error("--nats needs --run (the run whose log receives the eval episodes)")
    if min(args.tasks, args.samples, args.concurrency + 1, args.servers + 1) < 1:
        counts = f"--tasks {args.tasks}, --samples {args.samples}, --concurrency {args.concurrency}"
        p.error(f"{counts}, --servers {args.servers}: each must be >= 1 (or 0 for the last two)")
    _size_servers(args)
    ks = [k for k in args.k if k <= args.samples]
    if not ks:
        p.error(f"every --k {args.k} exceeds --samples {args.samples}")
    if ks != args.k:
        print(
            f"leafe eval: k > n={args.samples} left out: {sorted(set(args.k) - set(ks))}",
            file=sys.stderr,
        )
    try:
        validate_run_id(args.run or "eval")
        targets_from_args(args)
        task_ids = _task_ids(args)
        results = asyncio.run(run_eval(args, task_ids, ks))
    except (
        ValueError,
        OSError,
        EnvError,
        EngineError,
    ) as e:  # bad option, model, env or server: say which
        print(f"leafe eval: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    report = EvalReport(
        env=args.env,
        env_options=dict(args.env_option),
        split=args.split,
        run_id=args.run or "eval",
        samples=args.samples,
        ks=ks,
        task_ids=task_ids,
        rollout_overrides=dict(args.rollout_option),
        results=results,
    )
    write_report(report, args.out)
    for result in results:
        write_passk_scalars(
            (args.tensorboard_dir or args.out / "tensorboard") / result.label, result
        )
    print(report_markdown(report))
    print(f"wrote {args.out / 'eval.json'}, {args.out / 'eval.md'}, {args.out / 'passk.png'}")
    return 0
