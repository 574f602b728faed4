"""``leafe tasks``: build task assignments and submit them to a run's work queue (``LEAFE_TASKS``).

Every assignment has a deterministic ``task_key`` (its ``Nats-Msg-Id``), so submitting the same
batch twice queues it once while JetStream remembers the id; :func:`submit` also skips keys whose
episode already finished (read from the log by the caller), which keeps resumption exact past the
dedupe window.

```
leafe tasks submit --run r1 --env sokoban --split train --count 8 --mode explore leafe tasks submit
--run r1 --env sokoban --split test --count 16 --samples 16 --mode eval --prefix eval-v0 leafe tasks
submit --run r1 --env sokoban --split train --count 64 --mode demo leafe tasks pending --run r1
```
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

from leafe.envs.registry import make_env
from leafe.protocol.events import Mode
from leafe.protocol.subjects import TASKS, task_subject, validate_run_id
from leafe.protocol.tasks import TaskAssignment, task_slug
from leafe.services.bus import (
    NatsOptions,
    Publisher,
    add_nats_arguments,
    connect,
    nats_options,
    wait_for_streams,
)
from leafe.services.config import parse_key_value

__all__ = ["main", "make_assignments", "pending", "submit"]


def make_assignments(
    *,
    run_id: str,
    env: str,
    task_ids: Sequence[str],
    mode: Mode,
    split: str,
    samples: int = 1,
    seed: int = 0,
    prefix: str = "",
    env_options: Mapping[str, Any] | None = None,
) -> list[TaskAssignment]:
    """``samples`` assignments per task id, keyed ``<run>-<prefix>-<task>-x<sample>``.

    With ``samples > 1`` the samples of one task form a group
    (GRPO's n rollouts, or Pass@k's n samples); seeds are ``seed + 1000 * task index + sample``."""
    validate_run_id(run_id)
    if mode == "demo" and split != "train":
        raise ValueError(
            f"mode demo needs the train split, got {split!r}: demonstrations never come from tests"
        )
    if samples < 1:
        raise ValueError(f"samples = {samples}: need at least 1 per task")
    # Keys carry the run id: runs share the streams, and JetStream dedupes on the id stream-wide.
    stem = f"{run_id}-{prefix or mode}"
    out = []
    for i, task_id in enumerate(task_ids):
        group = f"{stem}-{task_slug(task_id)}"
        for s in range(samples):
            out.append(
                TaskAssignment(
                    task_key=f"{group}-x{s}",
                    run_id=run_id,
                    env=env,
                    task_id=task_id,
                    split=split,
                    mode=mode,
                    seed=seed + 1000 * i + s,
                    group_id=group if samples > 1 else None,
                    group_size=samples,
                    env_options=dict(env_options or {}),
                )
            )
    return out


async def submit(
    js: Any, assignments: Iterable[TaskAssignment], *, skip: Iterable[str] = ()
) -> int:
    """Publish assignments (deduplicated by ``task_key``) on the existing ``LEAFE_TASKS`` stream,
    skipping the keys in ``skip``; returns the number published (JetStream may still drop exact
    duplicates it remembers)."""
    skipped = set(skip)
    count = 0
    async with Publisher(js) as pub:
        for a in assignments:
            if a.task_key in skipped:
                continue
            await pub.publish(task_subject(a.run_id), a)
            count += 1
    return count


async def pending(js: Any, run_id: str) -> int:
    """Assignments of ``run_id`` still in the work queue (not yet acked by an actor)."""
    info = await js.stream_info(TASKS.name, subjects_filter=task_subject(run_id))
    return int((info.state.subjects or {}).get(task_subject(run_id), 0))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe tasks", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="submit assignments for a slice of an environment's split")
    add_nats_arguments(s)
    s.add_argument("--run", required=True, help="run id")
    s.add_argument("--env", required=True, help="environment name (sokoban, scienceworld, ...)")
    s.add_argument(
        "--env-option", action="append", type=parse_key_value, default=[], help="KEY=VALUE"
    )
    s.add_argument("--split", default="train", help="train or test")
    s.add_argument("--offset", type=int, default=0, help="first task index of the split")
    s.add_argument("--count", type=int, required=True, help="number of tasks")
    s.add_argument(
        "--mode", choices=get_args(Mode), default="explore", help="demo: expert demonstrations"
    )
    s.add_argument("--samples", type=int, default=1, help="assignments per task (a group when > 1)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--prefix", default="", help="task key prefix (default: the mode)")
    q = sub.add_parser("pending", help="how many assignments are still queued")
    add_nats_arguments(q)
    q.add_argument("--run", required=True, help="run id")
    return p


async def _main(args: argparse.Namespace, nats: NatsOptions) -> int:
    nc = await connect(nats, name="leafe-tasks")
    try:
        js = nc.jetstream()
        if args.cmd == "pending":
            print(await pending(js, args.run))
            return 0
        options = dict(args.env_option)
        env = make_env(args.env, **options)
        try:
            ids = env.tasks(args.split)[args.offset : args.offset + args.count]
        finally:
            env.close()
        batch = make_assignments(
            run_id=args.run,
            env=args.env,
            task_ids=ids,
            mode=args.mode,
            split=args.split,
            samples=args.samples,
            seed=args.seed,
            prefix=args.prefix,
            env_options=options,
        )
        await wait_for_streams(js, [TASKS.name], timeout_s=nats.streams_timeout_s)
        n = await submit(js, batch)
        print(
            f"submitted {n} assignments ({len(ids)} tasks x {args.samples}) to "
            f"{task_subject(args.run)}"
        )
        return 0
    finally:
        await nc.drain()


def main(argv: list[str]) -> int:
    """Entry point of ``leafe tasks``."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        nats = nats_options(args)
    except ValueError as e:
        p.error(str(e))
    if not nats.url:
        p.error("give --nats or set LEAFE_NATS_URL")
    return asyncio.run(_main(args, nats))
