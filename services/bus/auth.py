"""NATS users and TLS for an embedded nats-server: one nkey user per role, from deploy's
permissions.json.

``deploy/base/nats/permissions.json`` is the one list of what each role may publish and subscribe to
(deploy/README.md, "NATS: one user per role"); the cluster's ``authorization.conf`` is generated
from it, and so is the ``authorization`` block of every embedded server (``leafe run``, the tests),
so a service runs with the same rights on a laptop as in a cluster. Each role gets a fresh nkey pair
per start: the seed goes to ``<dir>/<role>.nk`` (mode 0600 in a 0700 directory), the public key into
the server config. A service is given its own seed file only (``--nats-nkey``); ``leafe run``'s
supervisor uses ``admin``.

Actors are the exception: every actor process is a user of its own, ``actor.<id>`` (seed file
``actor.<id>.nk``), whose permissions are the ``actor`` role's with ``{actor}`` replaced by its id
and ``{run}`` by the run it serves: it may publish events only on ``leafe.<run>.events.*.<id>``,
pull only the run's task durable ``actors-<run>``, ack only the tasks delivered to it
(``allow_responses``, no ``$JS.ACK`` subject of its own) and read only its inboxes
``_INBOX_actor.<id>``. The event subject's last token is thus an identity no actor can forge (the
replayer caps open episodes per that token, ``leafe.protocol.codec.admit_event``). There is no
shared ``actor`` user. A user for any run (``run=ANY_RUN``: every subject token naming the run
becomes ``*``) is what the test suite's shared server and the cluster's generated config without
``--run`` use.

    keys = write_role_keys(run_dir / "nats-keys", key_names(["r1-actor-0", "r1-actor-1"]))
    server = EmbeddedNats(store, users=nkey_users(keys, load_permissions(), run="r1")).start()
    options = role_options(server.url, keys)          # {"actor": NatsOptions(url, nkey=...), ...}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nkeys

from leafe.protocol.subjects import validate_actor_id, validate_run_id
from leafe.services.bus.connection import ROLES, NatsOptions, inbox_prefix

__all__ = [
    "ACTOR_PLACEHOLDER",
    "ANY_RUN",
    "PERMISSIONS_FILE",
    "ROLES",
    "RUN_PLACEHOLDER",
    "NatsUser",
    "RoleKey",
    "ServerTls",
    "actor_key_name",
    "authorization_config",
    "key_names",
    "load_permissions",
    "nkey_users",
    "permissions_for",
    "role_options",
    "tls_config",
    "write_role_keys",
]

PERMISSIONS_FILE = (
    Path(__file__).resolve().parents[2] / "deploy" / "base" / "nats" / "permissions.json"
)
"""The per-role permissions, in the source tree (the container image runs no embedded server)."""
ACTOR_PLACEHOLDER = "{actor}"
"""Stands for an actor's id in the ``actor`` role's subjects of permissions.json."""
RUN_PLACEHOLDER = "{run}"
"""Stands for the run an actor serves in the ``actor`` role's subjects (inside a token:
``actors-{run}``)."""
ANY_RUN = "*"
"""``run`` of an actor user that serves every run: each token holding :data:`RUN_PLACEHOLDER`
becomes ``*``."""


class NatsUser(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry of a server's ``authorization.users``: an nkey user, or a user with a password."""

    permissions: dict[str, Any]
    """``{"publish": {"allow": [...], "deny": [...]}, "subscribe": {...}}`` as in
    permissions.json."""
    nkey: str = ""
    """The user's public nkey (``U...``); empty for a password user."""
    user: str = ""
    """User name of a password user (tests only: a URL carrying it reaches every verb unchanged)."""
    password: str = ""
    """That user's password, in clear text in the server config (a temp dir)."""

    def __post_init__(self) -> None:
        if bool(self.nkey) == bool(self.user):
            raise ValueError(
                f"a NATS user has an nkey or a user name, not both or neither: {self.user!r}"
            )
        if self.nkey and not self.nkey.startswith("U"):
            raise ValueError(f"nkey {self.nkey!r} is not a user public key (U...)")
        if bool(self.user) != bool(self.password):
            raise ValueError(f"user {self.user!r} needs a password")


class ServerTls(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The server's ``tls`` block: its certificate, and the CA that client certificates must chain
    to."""

    cert_file: str
    """Server certificate (PEM)."""
    key_file: str
    """Server private key (PEM)."""
    ca_file: str = ""
    """CA bundle for client certificates; empty = clients are not asked for one."""
    verify: bool = True
    """Require a client certificate signed by ``ca_file`` (mutual TLS)."""


class RoleKey(msgspec.Struct, frozen=True, kw_only=True):
    """A role's generated nkey: where its seed is and its public key (the seed itself is never
    held)."""

    role: str
    """The role of permissions.json, or ``actor.<id>`` for one actor's own user."""
    seed_file: str
    """Path of the seed file (mode 0600)."""
    public_key: str
    """``U...``: what the server config names."""


def load_permissions(path: Path = PERMISSIONS_FILE) -> dict[str, dict[str, Any]]:
    """permissions.json, checked to hold exactly :data:`ROLES`; raises naming the file and the
    roles."""
    if not path.is_file():
        raise FileNotFoundError(
            f"NATS permissions file {path} not found: the embedded server's users come from "
            "deploy/ "
            "in the source tree"
        )
    table: dict[str, dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    if set(table) != set(ROLES):
        raise ValueError(f"{path} defines roles {sorted(table)}; expected {sorted(ROLES)}")
    return table


def actor_key_name(actor_id: str) -> str:
    """The user (and seed file stem) of one actor: ``actor.<id>`` (the id checked as a subject
    token)."""
    return f"actor.{validate_actor_id(actor_id)}"


def key_names(actor_ids: Iterable[str]) -> list[str]:
    """Every role but the shared ``actor`` (which has no user), and one ``actor.<id>`` per actor."""
    return [*(r for r in ROLES if r != "actor"), *(actor_key_name(a) for a in actor_ids)]


def _subject(text: str, actor_id: str, run: str) -> str:
    """``{actor}`` and ``{run}`` filled in, token by token: a token naming the run is the run's own,
    or ``*`` for :data:`ANY_RUN` (``actors-{run}`` cannot be half a wildcard)."""
    tokens = [
        (ANY_RUN if run == ANY_RUN else t.replace(RUN_PLACEHOLDER, run))
        if RUN_PLACEHOLDER in t
        else t
        for t in text.split(".")
    ]
    return ".".join(tokens).replace(ACTOR_PLACEHOLDER, actor_id)


def _substituted(value: Any, actor_id: str, run: str) -> Any:
    if isinstance(value, str):
        return _subject(value, actor_id, run)
    if isinstance(value, list):
        return [_substituted(v, actor_id, run) for v in value]
    if isinstance(value, dict):
        return {k: _substituted(v, actor_id, run) for k, v in value.items()}
    return value


def permissions_for(
    name: str, permissions: Mapping[str, dict[str, Any]], *, run: str
) -> dict[str, Any]:
    """The permissions of user ``name``: a role's, or for ``actor.<id>`` the actor role's with
    ``{actor}`` replaced by the id and ``{run}`` by ``run`` (:data:`ANY_RUN`: any run); the shared
    ``actor`` is refused (it would publish as any actor)."""
    role, dot, actor_id = name.partition(".")
    if role == "actor":
        if not dot:
            raise ValueError(
                "the actor role has no shared user: give each actor its own, actor.<id> "
                "(key_names), so "
                "its events are pinned to its id"
            )
        pinned = run if run == ANY_RUN else validate_run_id(run)
        return _substituted(permissions["actor"], validate_actor_id(actor_id), pinned)  # type: ignore[no-any-return]
    if dot or role not in permissions:
        raise ValueError(f"no NATS role {name!r} (roles: {sorted(permissions)}, or actor.<id>)")
    return permissions[role]


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode on O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)


def write_role_keys(directory: Path, roles: Iterable[str] | None = None) -> dict[str, RoleKey]:
    """A fresh user nkey per name of ``roles`` (default :func:`key_names` of no actor: every role
    but the shared ``actor``); each seed in ``directory/<name>.nk`` (0600, directory 0700)."""
    roles = key_names(()) if roles is None else roles
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    keys: dict[str, RoleKey] = {}
    for role in roles:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        pair = nkeys.from_seed(bytearray(seed))
        path = directory / f"{role}.nk"
        _write_secret(path, bytes(seed))
        keys[role] = RoleKey(role=role, seed_file=str(path), public_key=pair.public_key.decode())
        pair.wipe()
    return keys


def nkey_users(
    keys: Mapping[str, RoleKey], permissions: Mapping[str, dict[str, Any]], *, run: str
) -> list[NatsUser]:
    """One nkey user per role of ``keys``, with that role's permissions (:func:`permissions_for`);
    the actors' pinned to ``run`` (:data:`ANY_RUN`: a server shared by many runs, e.g. the test
    suite's)."""
    return [
        NatsUser(nkey=key.public_key, permissions=permissions_for(role, permissions, run=run))
        for role, key in keys.items()
    ]


def role_options(url: str, keys: Mapping[str, RoleKey], **options: Any) -> dict[str, NatsOptions]:
    """Each role's client options: ``url``, its own seed file and its inbox prefix (``options``: TLS
    files, timeouts)."""
    out = {}
    for role, key in keys.items():
        opts = NatsOptions(url=url, nkey=key.seed_file, **options)
        out[role] = msgspec.structs.replace(opts, inbox_prefix=inbox_prefix(opts))
    return out


def _quoted(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid nats-server config string


def authorization_config(users: Sequence[NatsUser]) -> str:
    """The server config's ``authorization`` block for ``users`` (permissions written as JSON, which
    the nats-server config format accepts)."""
    lines = ["authorization {", "  users = ["]
    for u in users:
        who = (
            f"nkey: {_quoted(u.nkey)}"
            if u.nkey
            else f"user: {_quoted(u.user)}, password: {_quoted(u.password)}"
        )
        lines.append(f"    {{{who}, permissions: {json.dumps(u.permissions, sort_keys=True)}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def tls_config(tls: ServerTls) -> str:
    """The server config's ``tls`` block."""
    fields = [f"cert_file: {_quoted(tls.cert_file)}", f"key_file: {_quoted(tls.key_file)}"]
    if tls.ca_file:
        fields.append(f"ca_file: {_quoted(tls.ca_file)}")
    fields.append(f"verify: {'true' if tls.verify and tls.ca_file else 'false'}")
    return "tls {\n" + "".join(f"  {f}\n" for f in fields) + "}\n"
