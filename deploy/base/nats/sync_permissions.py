"""Write the NATS users and accounts (authorization.conf) from permissions.json and accounts.json,
or check that it matches.

permissions.json is the one source of the per-role subject permissions: the NATS server config
includes the generated authorization.conf, and the integration tests run a real nats-server with the
same rules. Run it after every change to permissions.json (stdlib only, from the repository root):

    python deploy/base/nats/sync_permissions.py           # rewrite authorization.conf
    python deploy/base/nats/sync_permissions.py --check   # exit 1 if authorization.conf is stale
    python deploy/base/nats/sync_permissions.py --run dev \\
        --out /tmp/authorization.conf                     # actors pinned to dev

Each role becomes one nkey user whose public key is the variable ``<ROLE>_NKEY`` (e.g.
``WEIGHT_SYNC_NKEY``), an environment variable of nats-server from Secret nats-auth; the role's pods
hold the matching seed (Secret leafe-nats-<role>, mounted as ``<role>.nk``), as ``leafe run`` gives
each of its services one.

Except the actor: there is no shared actor user. Each of :data:`ACTOR_SLOTS` actor pods (the
StatefulSet's ``actor-0`` ... ``actor-<N-1>``, whose pod name is its actor id) is a user of its own,
``ACTOR_<i>_NKEY``, with the actor role's permissions where ``{actor}`` is ``actor-<i>``: it
publishes events only on ``leafe.*.events.*.actor-<i>`` and reads only ``_INBOX_actor.actor-<i>``,
so no actor can publish under another's identity (the replayer caps open episodes per that
identity). Its seed is key ``actor-<i>`` of Secret leafe-nats-actors, which an init container copies
to ``actor.actor-<i>.nk`` for that pod alone.

Accounts (accounts.json): the streams live in account ``LEAFE`` (JetStream enabled: replayer,
learner, admin); actors, weight sync and log import live in accounts of their own that import from
it only the subjects they use. A NATS request names the subject its answer goes to and the server
publishes the answer there without checking the requester's publish permissions: in the streams'
account an actor could once have any answer stored on a dead letter's, a redrive marker's, the
weights', the samples' or the tasks' subject. In its own account no stream exists. See
services/bus/auth.py, which builds the embedded server's accounts from the same file
(``account_links`` there and :func:`links` here must agree: tests/unit/deploy checks it). Upgrading
a cluster whose streams were made before accounts: they live in the global account (``$G``), which
this config no longer uses; export each run first (``leafe log export``) and import it after
(deploy/README.md).

The committed file serves any run: every subject token naming the run (``{run}``, e.g.
``actors-{run}``) is ``*``, so an actor pod may publish events into, and pull the task durable of,
any run of the cluster (as before run pinning). ``--run RUN --out FILE`` writes the same users
pinned to one run, as ``leafe run`` pins its actors: mount that file as the nats-config's
authorization.conf where a cluster serves one run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "permissions.json"
ACCOUNTS = HERE / "accounts.json"
TARGET = HERE / "authorization.conf"
STREAMS_ACCOUNT = "LEAFE"
"""The account that holds the streams, which every other account imports from."""
ACTOR_SLOTS = 16
"""Actor pods that have a NATS user (``actor-0`` ... ``actor-15``): the most actor replicas
(keda-actors' maxReplicaCount). Raising it needs that many more keys in Secrets nats-auth and
leafe-nats-actors."""
ACTOR_PLACEHOLDER = "{actor}"
RUN_PLACEHOLDER = "{run}"
ANY_RUN = "*"
_HEADER = (
    "# GENERATED from permissions.json by sync_permissions.py: edit permissions.json, then run\n"
    "#   python deploy/base/nats/sync_permissions.py\n"
    "# (tests/unit/deploy checks that the two agree). One NATS nkey user per role, "
    "with exactly the subjects\n"
    "# that role uses, and one per actor pod (ACTOR_<i>: events only under its own id, actor-<i>); "
    "every public\n"
    "# key is an environment variable <ROLE>_NKEY of nats-server (Secret nats-auth). Each user "
    "lives in the NATS\n"
    "# account accounts.json gives its role: the streams in LEAFE, actors, weight sync and log "
    "import in accounts\n"
    "# of their own that import only what they use, so no answer to their requests lands in a "
    "stream.\n"
)


def variable(role: str) -> str:
    """The config variable prefix of a role: ``weight-sync`` -> ``WEIGHT_SYNC``."""
    return role.upper().replace("-", "_")


def actor_id(slot: int) -> str:
    """The actor id of StatefulSet pod ``slot``: its pod name."""
    return f"actor-{slot}"


def pinned(value: Any, actor: str, run: str) -> Any:
    """``value`` (an actor role's permissions) with ``{actor}`` and ``{run}`` filled in, token by
    token as services/bus/auth.py does: a token naming the run becomes the run, or ``*`` for any
    run."""
    if isinstance(value, dict):
        return {k: pinned(v, actor, run) for k, v in value.items()}
    if isinstance(value, list):
        return [pinned(v, actor, run) for v in value]
    if not isinstance(value, str):
        return value
    tokens = [
        (run if run == ANY_RUN else t.replace(RUN_PLACEHOLDER, run)) if RUN_PLACEHOLDER in t else t
        for t in value.split(".")
    ]
    return ".".join(tokens).replace(ACTOR_PLACEHOLDER, actor)


def users(permissions: dict[str, Any], run: str = ANY_RUN) -> dict[str, Any]:
    """User variable prefix -> permissions: each role but ``actor``, and ``ACTOR_<i>`` per actor
    slot."""
    out = {variable(role): perms for role, perms in permissions.items() if role != "actor"}
    for slot in range(ACTOR_SLOTS):
        out[f"ACTOR_{slot}"] = pinned(permissions["actor"], actor_id(slot), run)
    return out


def links(accounts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each account's ``jetstream``, ``exports`` and ``imports`` as the server config says them:
    every import is an export of the streams' account that only its importers may import."""
    exports: dict[tuple[str, str, str], list[str]] = {}
    out: dict[str, dict[str, Any]] = {}
    for name, spec in accounts.items():
        imports = []
        for i in spec.get("imports", []):
            kind = "service" if i.get("service") else "stream"
            exports.setdefault((kind, i[kind], i.get("response", "")), []).append(name)
            imports.append({kind: {"account": STREAMS_ACCOUNT, "subject": i[kind]}})
        out[name] = {"jetstream": bool(spec.get("jetstream")), "exports": [], "imports": imports}
    for (kind, subject, response), importers in exports.items():
        export: dict[str, Any] = {kind: subject, "accounts": sorted(importers)}
        if response:
            export["response_type"] = response
        out[STREAMS_ACCOUNT]["exports"].append(export)
    return out


def account_of(user: str, permissions: dict[str, Any], accounts: dict[str, Any]) -> str:
    """The account of a user variable prefix (``ACTOR_<i>``: the actor role's)."""
    role = (
        "actor"
        if user.startswith("ACTOR_")
        else next(r for r in permissions if variable(r) == user)
    )
    return next(name for name, spec in accounts.items() if role in spec["roles"])


def render(
    permissions: dict[str, Any], run: str = ANY_RUN, accounts: dict[str, Any] | None = None
) -> str:
    """The authorization.conf text for a role -> permissions mapping (actors pinned to ``run``),
    each user in its account (``accounts``: accounts.json)."""
    if accounts is None:
        accounts = json.loads(ACCOUNTS.read_text(encoding="utf-8"))
    table = users(permissions, run)
    lines = [_HEADER]
    for v, perms in table.items():
        body = json.dumps(perms, indent=2)
        lines.append(f"{v}_PERMISSIONS = {body}")
    lines.append("accounts {")
    for name, link in links(accounts).items():
        lines.append(f"  {name} {{")
        if link["jetstream"]:
            lines.append("    jetstream: enabled")
        lines.append("    users = [")
        for v in table:
            if account_of(v, permissions, accounts) == name:
                lines.append(f"      {{nkey: ${v}_NKEY, permissions: ${v}_PERMISSIONS}}")
        lines.append("    ]")
        for key in ("exports", "imports"):
            if link[key]:
                lines.append(f"    {key} = [")
                lines += [f"      {json.dumps(x, sort_keys=True)}" for x in link[key]]
                lines.append("    ]")
        lines.append("  }")
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Rewrite authorization.conf, or with ``--check`` report whether it is up to date."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if authorization.conf is out of date"
    )
    parser.add_argument(
        "--run", default=ANY_RUN, help="pin every actor user to this run (default: any run)"
    )
    parser.add_argument("--out", type=Path, help="write here instead (required with --run)")
    args = parser.parse_args(argv)
    if args.run != ANY_RUN and (args.out is None or args.check):
        parser.error(
            "--run writes a file of its own: give --out FILE (the committed file serves any run)"
        )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}|\*", args.run):
        parser.error(f"invalid run id {args.run!r}")
    text = render(json.loads(SOURCE.read_text(encoding="utf-8")), args.run)
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    (args.out or TARGET).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
