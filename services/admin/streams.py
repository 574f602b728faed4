"""``leafe streams``: create, update or check the LEAFE JetStream streams and a run's durable
consumers (the NATS admin's job alone).

Services never create streams (their NATS users may not); they wait for the ones they use and exit
non-zero naming them when they do not appear (``--streams-timeout``). This verb makes them, from
``leafe.protocol.subjects.STREAMS``, idempotently: deploy/ runs it as the Job ``leafe-streams`` with
the admin user, ``leafe run`` and the tests do the same before starting any service.

```
leafe streams ensure --nats URL --nats-user admin --nats-password-file F --stream-replicas 3
leafe streams check  --nats URL ...    # exit 1 if a stream is missing or differs from its spec
leafe streams ensure --nats URL ... --run RUN [--materializer leafe] [--learner-durable NAME]
```

With ``--run`` ``ensure`` also makes the run's durable consumers (services/bus/durables.py): the
actors' shared one on LEAFE_TASKS, the replayer's per materializer on LEAFE_EVENTS and the learner's
on LEAFE_SAMPLES, with the settings of the services' default configs. No service may create or
change a consumer: each binds its durable and waits for it, as it waits for its streams.
"""

from __future__ import annotations

import argparse
import asyncio

from leafe.actors.config import ActorServiceConfig
from leafe.learner.config import LearnerConfig
from leafe.protocol.subjects import (
    EVENTS,
    SAMPLES,
    TASKS,
    actors_durable,
    events_filter,
    learner_durable,
    replayer_durable,
    samples_filter,
    task_subject,
)
from leafe.services.bus import (
    DurableMismatchError,
    DurableSpec,
    NatsOptions,
    StreamMismatchError,
    add_nats_arguments,
    check_streams,
    connect,
    ensure_durables,
    ensure_streams,
    nats_options,
)
from leafe.services.logsetup import configure_logging
from leafe.services.replayer.config import ReplayerConfig

__all__ = ["durables_for_run", "main"]


def durables_for_run(
    run_id: str,
    *,
    materializers: tuple[str, ...] = ("leafe",),
    actor: ActorServiceConfig | None = None,
    replayer: ReplayerConfig | None = None,
    learner: LearnerConfig | None = None,
) -> list[DurableSpec]:
    """The durables of ``run_id``'s services, each with the settings its service asks for under
    these configs (the defaults when None): what the service then binds without changing it."""
    actor, replayer, learner = (
        actor or ActorServiceConfig(),
        replayer or ReplayerConfig(),
        learner or LearnerConfig(),
    )
    specs = [
        DurableSpec(
            stream=TASKS.name,
            name=actors_durable(run_id, actor.durable),
            filter_subject=task_subject(run_id),
            ack_wait_s=actor.ack_wait_s,
            max_ack_pending=max(4096, actor.concurrency),
        )
    ]
    specs += [
        DurableSpec(
            stream=EVENTS.name,
            name=replayer_durable(run_id, m),
            filter_subject=events_filter(run_id),
            ack_wait_s=replayer.ack_wait_s,
            max_ack_pending=replayer.max_ack_pending,
        )
        for m in materializers
    ]
    specs.append(
        DurableSpec(
            stream=SAMPLES.name,
            name=learner_durable(run_id, learner.durable),
            filter_subject=samples_filter(run_id),
            ack_wait_s=learner.ack_wait_s,
            max_ack_pending=learner.max_ack_pending,
        )
    )
    return specs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe streams", description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("ensure", "create missing streams, update changed ones (as the NATS admin)"),
        ("check", "report each stream against its spec; exit 1 if one is missing or differs"),
    ):
        s = sub.add_parser(name, help=help_)
        add_nats_arguments(s)
        s.add_argument(
            "--stream-replicas",
            type=int,
            default=1,
            help="replicas of every stream (3 on a 3-node JetStream cluster; default 1)",
        )
        s.add_argument("--log-level", default="warning")
    ensure = sub.choices["ensure"]
    ensure.add_argument("--run", default=None, help="also make this run's durable consumers")
    ensure.add_argument(
        "--materializer",
        action="append",
        default=None,
        help="a replayer materializer of the run (repeatable; default leafe)",
    )
    ensure.add_argument(
        "--actors-durable", default="actors", help="actors' durable prefix (default actors)"
    )
    ensure.add_argument(
        "--learner-durable", default="", help="learner durable name (default learner-<run>)"
    )
    return p


async def _run(cmd: str, nats: NatsOptions, replicas: int, durables: list[DurableSpec]) -> int:
    nc = await connect(nats, name=f"leafe-streams-{cmd}")
    try:
        js = nc.jetstream()
        if cmd == "ensure":
            try:
                done = await ensure_streams(js, replicas=replicas)
                done.update(await ensure_durables(js, durables))
            except (StreamMismatchError, DurableMismatchError) as e:
                print(f"leafe streams ensure: {e}")
                return 1
            for name, what in done.items():
                print(f"{name}: {what}")
            return 0
        state = await check_streams(js, replicas=replicas)
        for name, what in state.items():
            print(f"{name}: {what}")
        return 0 if all(v == "ok" for v in state.values()) else 1
    finally:
        await nc.close()


def main(argv: list[str]) -> int:
    """Entry point of ``leafe streams``."""
    p = _parser()
    args = p.parse_args(argv)
    try:
        nats = nats_options(args)
        configure_logging(json=False, level=args.log_level)
    except ValueError as e:
        p.error(str(e))
    if not nats.url:
        p.error("give --nats URL or set LEAFE_NATS_URL")
    if not 1 <= args.stream_replicas <= 5:
        p.error(f"--stream-replicas {args.stream_replicas}: expected 1 to 5")
    durables: list[DurableSpec] = []
    if args.cmd == "ensure" and args.run is not None:
        try:
            durables = durables_for_run(
                args.run,
                materializers=tuple(args.materializer or ["leafe"]),
                actor=ActorServiceConfig(durable=args.actors_durable),
                learner=LearnerConfig(durable=args.learner_durable),
            )
        except ValueError as e:
            p.error(str(e))
    return asyncio.run(_run(args.cmd, nats, args.stream_replicas, durables))
