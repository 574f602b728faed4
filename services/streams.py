"""``leafe streams``: create, update or check the LEAFE JetStream streams (the NATS admin's job alone).

Services never create streams (their NATS users may not); they wait for the ones they use and exit
non-zero naming them when they do not appear (``--streams-timeout``). This verb makes them, from
``protocol.subjects.STREAMS``, idempotently: deploy/ runs it as the Job ``leafe-streams`` with the admin
user, ``leafe run`` and the tests do the same before starting any service.

```
leafe streams ensure --nats URL --nats-user admin --nats-password-file F --stream-replicas 3
leafe streams check  --nats URL ...    # exit 1 if a stream is missing or differs from its spec
```
"""

from __future__ import annotations

import argparse
import asyncio

from services.bus import (
    NatsOptions,
    StreamMismatchError,
    add_nats_arguments,
    check_streams,
    connect,
    ensure_streams,
    nats_options,
)
from services.logsetup import configure_logging

__all__ = ["main"]


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
    return p


async def _run(cmd: str, nats: NatsOptions, replicas: int) -> int:
    nc = await connect(nats, name=f"leafe-streams-{cmd}")
    try:
        js = nc.jetstream()
        if cmd == "ensure":
            try:
                done = await ensure_streams(js, replicas=replicas)
            except StreamMismatchError as e:
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
    return asyncio.run(_run(args.cmd, nats, args.stream_replicas))
