"""Write the NATS authorization block (authorization.conf) from permissions.json, or check that it matches.

permissions.json is the one source of the per-role subject permissions: the NATS server config includes the
generated authorization.conf, and the integration tests run a real nats-server with the same rules. Run it
after every change to permissions.json (stdlib only, from the repository root):

    python deploy/base/nats/sync_permissions.py           # rewrite authorization.conf
    python deploy/base/nats/sync_permissions.py --check   # exit 1 if authorization.conf is out of date

Each role becomes one nkey user whose public key is the variable ``<ROLE>_NKEY`` (e.g. ``WEIGHT_SYNC_NKEY``),
an environment variable of nats-server from Secret nats-auth; the role's pods hold the matching seed (Secret
leafe-nats-<role>, mounted as ``<role>.nk``), as ``leafe run`` gives each of its services one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "permissions.json"
TARGET = HERE / "authorization.conf"
_HEADER = """\
# GENERATED from permissions.json by sync_permissions.py: edit permissions.json, then run
#   python deploy/base/nats/sync_permissions.py
# (tests/unit/deploy checks that the two agree). One NATS nkey user per role, with exactly the subjects
# that role uses; every public key is an environment variable <ROLE>_NKEY of nats-server (Secret nats-auth).
"""


def variable(role: str) -> str:
    """The config variable prefix of a role: ``weight-sync`` -> ``WEIGHT_SYNC``."""
    return role.upper().replace("-", "_")


def render(permissions: dict[str, dict[str, dict[str, list[str]]]]) -> str:
    """The authorization.conf text for a role -> permissions mapping."""
    lines = [_HEADER, "authorization {"]
    for role, perms in permissions.items():
        body = json.dumps(perms, indent=2).replace("\n", "\n  ")
        lines.append(f"  {variable(role)}_PERMISSIONS = {body}")
    lines.append("  users = [")
    for role in permissions:
        v = variable(role)
        lines.append(f"    {{nkey: ${v}_NKEY, permissions: ${v}_PERMISSIONS}}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Rewrite authorization.conf, or with ``--check`` report whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if authorization.conf is out of date")
    args = parser.parse_args(argv)
    text = render(json.loads(SOURCE.read_text(encoding="utf-8")))
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
