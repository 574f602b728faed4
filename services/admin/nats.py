"""``leafe nats``: run an embedded nats-server with JetStream (or a local cluster) until Ctrl-C or
SIGTERM.

    leafe nats --store DIR [--port 4222]          # one server
    leafe nats --store DIR --cluster 3            # three clustered nodes on free loopback ports

For local use and demos; deployments run the real NATS cluster of ``deploy/``. Either signal stops
the server(s) gracefully (JetStream flushes), so a supervisor's SIGTERM never leaves a nats-server
behind.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from types import FrameType

from leafe.services.bus.nats_cluster import NatsCluster
from leafe.services.bus.nats_server import EmbeddedNats

__all__ = ["main"]


class _Stop(Exception):
    """SIGTERM, turned into an exception so the ``finally`` that stops the server runs."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _wait(alive: list[EmbeddedNats]) -> None:
    while all(node.pid is not None for node in alive):
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    """Entry point of ``leafe nats``."""
    parser = argparse.ArgumentParser(
        prog="leafe nats", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--store", type=Path, required=True, help="JetStream store directory")
    parser.add_argument("--port", type=int, default=4222, help="client port (default 4222)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="N", help="run N clustered nodes instead"
    )
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C explicitly too: a process started in the background by a shell inherits SIGINT ignored,
    # and Python then never raises KeyboardInterrupt (this test hung under `make test &`)
    previous_int = signal.signal(signal.SIGINT, _on_sigterm)
    try:
        if args.cluster:
            cluster = NatsCluster(args.store, size=args.cluster, host=args.host)
            try:  # a signal while starting must stop what already runs too
                cluster.start()
                print(
                    f"{args.cluster}-node nats cluster with JetStream: {cluster.url}; "
                    "Ctrl-C to stop"
                )
                print(
                    "create replicated streams: "
                    "leafe streams ensure --nats URL --stream-replicas 3",
                    flush=True,
                )
                _wait(list(cluster.nodes))
            finally:
                cluster.stop()
            return 0
        server = EmbeddedNats(args.store, port=args.port, host=args.host)
        try:  # a signal while starting must stop what already runs too
            server.start()
            print(
                f"nats-server with JetStream at {server.url} (store {args.store}); Ctrl-C to stop",
                flush=True,
            )
            _wait([server])
        finally:
            server.stop()
        return 0
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
