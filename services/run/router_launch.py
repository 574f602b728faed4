"""sglang-router 0.3.2 started with its keys read from files, so no key is on a command line that
every local user can read in ``ps`` (the router itself takes keys only as flags).

    python -m leafe.services.run.router_launch --api-key-file ENGINE_KEY \\
        --control-key-file CONTROL_KEY -- --worker-urls http://127.0.0.1:30001 --port 30000 ...

``--api-key``: the engines' key; a client must present it (``/generate`` and the other proxied
routes are 401 without it) and the router sends it on its own calls to the workers.
``--control-plane-api-keys``: one admin key, the supervisor's (``leafe run``), for ``POST
/workers``, ``DELETE /workers/<id>``, ``/workers`` and ``/get_loads``; without it these answered
anyone, and with only ``--api-key`` every actor (whose key that is) could add a worker of its
choice, which then received the actors' requests and their ``Authorization`` header. Everything
after ``--`` is the router's own flags. Standard library and ``sglang_router`` only, so it starts as
fast as the router.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["CONTROL_KEY_ID", "main", "read_key"]

CONTROL_KEY_ID = "leafe-run:supervisor:admin"
"""``id:name:role`` of the control-plane key (the router's ``--control-plane-api-keys`` format,
``id:name:role:key``)."""


def read_key(path: str) -> str:
    """The key in ``path`` (whitespace stripped); an empty or unreadable file is an error."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        why = f"cannot read the key file {path!r}: {e.strerror}"
        raise SystemExit(f"router_launch: {why}") from None
    if not key:
        raise SystemExit(f"router_launch: the key file {path!r} is empty")
    return key


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m leafe.services.run.router_launch")
    p.add_argument("--api-key-file", required=True, help="the engines' API key")
    p.add_argument("--control-key-file", required=True, help="the router's control-plane key")
    p.add_argument("router_args", nargs=argparse.REMAINDER, help="-- then the router's own flags")
    a = p.parse_args(argv)
    rest = a.router_args[1:] if a.router_args[:1] == ["--"] else a.router_args
    for flag in ("--api-key", "--control-plane-api-keys"):
        if flag in rest:
            p.error(f"{flag} is read from its file here, not given as a flag")
    from sglang_router.launch_router import launch_router, parse_router_args

    keys = [
        "--api-key",
        read_key(a.api_key_file),
        "--control-plane-api-keys",
        f"{CONTROL_KEY_ID}:{read_key(a.control_key_file)}",
    ]
    launch_router(parse_router_args([*rest, *keys]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
