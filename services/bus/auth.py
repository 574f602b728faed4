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

Accounts (``deploy/base/nats/accounts.json``): a NATS request names the subject its answer goes to,
and the server publishes the answer there without checking the requester's publish permissions, so
a stream bound to that subject would store it (an actor once filled the replayer's next dead-letter
subjects with stream-info answers, and the refused events were lost). So the streams live in one
account (``LEAFE``, JetStream enabled: the replayer, the learner, the admin), and the roles that
must not write there live in accounts of their own (``ACTORS``, ``WEIGHT_SYNC``, ``LOG_IMPORT``),
which import from it only the subjects they use: service imports of their own event subjects
(published with a PubAck), of the JetStream API requests they send, of the task durable's pull
(``response: stream``: one request, many messages) and of its acks; ``leafe.*.weights`` as a stream
import. Any reply subject such a role names is one of its own account, where no stream exists; its
users' permissions (permissions.json) still say which of the imported subjects each one may use.
An account without JetStream that imports JetStream API subjects must import ``$JS.API.INFO`` too:
otherwise the server adds its own responder for ``$JS.API.>`` there, which answers "JetStream not
enabled for account" before the import's answer arrives (checked on nats-server 2.15).

    keys = write_role_keys(run_dir / "nats-keys", key_names(["r1-actor-0", "r1-actor-1"]))
    server = EmbeddedNats(store, users=nkey_users(keys, load_permissions(), run="r1")).start()
    options = role_options(server.url, keys)          # {"actor": NatsOptions(url, nkey=...), ...}
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nkeys

from leafe.protocol.subjects import validate_actor_id, validate_run_id
from leafe.services.bus.connection import ROLES, NatsOptions, inbox_prefix

__all__ = [
    "ACCOUNTS_FILE",
    "ACTOR_PLACEHOLDER",
    "ANY_RUN",
    "PERMISSIONS_FILE",
    "ROLES",
    "RUN_PLACEHOLDER",
    "STREAMS_ACCOUNT",
    "Account",
    "AccountImport",
    "NatsUser",
    "RoleKey",
    "ServerTls",
    "account_links",
    "account_of",
    "actor_key_name",
    "authorization_config",
    "key_names",
    "load_accounts",
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
ACCOUNTS_FILE = PERMISSIONS_FILE.with_name("accounts.json")
"""Which NATS account each role lives in, and what the accounts without streams import."""
STREAMS_ACCOUNT = "LEAFE"
"""The account that holds the streams (JetStream enabled): the one every import comes from."""
_JS_API = "$JS.API."
_JS_INFO = "$JS.API.INFO"
_ACCOUNT_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,31}")
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
    account: str = ""
    """The NATS account the user lives in (accounts.json); empty: a server without accounts."""

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


class AccountImport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One subject an account imports from :data:`STREAMS_ACCOUNT`: a service (requests, answered
    back into the importer's account) or a stream (messages, for subscriptions)."""

    service: str = ""
    """Subject of a service import (a publish, a JetStream API request, an ack)."""
    stream: str = ""
    """Subject of a stream import (a subscription)."""
    response: str = ""
    """``stream`` for a service that answers one request with many messages (a pull), else
    empty."""

    def __post_init__(self) -> None:
        if bool(self.service) == bool(self.stream):
            raise ValueError(f"an import names a service or a stream, not both or neither: {self}")
        if self.response not in ("", "stream") or (self.response and not self.service):
            raise ValueError(f"an import's response is 'stream' (services only): {self}")


class Account(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One NATS account of accounts.json."""

    roles: list[str]
    """The roles whose users live in it (``actor``: every actor's user)."""
    jetstream: bool = False
    """JetStream enabled here: the account that holds the streams."""
    imports: list[AccountImport] = []
    """What it imports from :data:`STREAMS_ACCOUNT`."""


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


def load_accounts(path: Path = ACCOUNTS_FILE) -> dict[str, Account]:
    """accounts.json, checked: every role of :data:`ROLES` in exactly one account, JetStream in
    :data:`STREAMS_ACCOUNT` alone, which imports nothing, and ``$JS.API.INFO`` imported wherever
    another JetStream API subject is (see the module docstring); raises naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"NATS accounts file {path} not found (deploy/ in the source tree)")
    try:
        table = msgspec.json.decode(path.read_bytes(), type=dict[str, Account])
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    roles = [r for account in table.values() for r in account.roles]
    if sorted(roles) != sorted(ROLES):
        raise ValueError(
            f"{path} places roles {sorted(roles)}; expected each of {sorted(ROLES)} once"
        )
    for name, account in table.items():
        if not _ACCOUNT_NAME.fullmatch(name):
            raise ValueError(f"{path}: account name {name!r} is not [A-Z][A-Z0-9_]*")
        streams = name == STREAMS_ACCOUNT
        if account.jetstream != streams or (streams and account.imports):
            raise ValueError(
                f"{path}: JetStream belongs to account {STREAMS_ACCOUNT} alone, which imports "
                f"nothing ({name} has jetstream={account.jetstream})"
            )
        services = {i.service for i in account.imports if i.service}
        if any(s.startswith(_JS_API) for s in services) and _JS_INFO not in services:
            raise ValueError(
                f"{path}: account {name} imports JetStream API subjects but not {_JS_INFO}: the "
                "server would answer them itself with 'JetStream not enabled for account'"
            )
    if STREAMS_ACCOUNT not in table:
        raise ValueError(f"{path} has no account {STREAMS_ACCOUNT} (the streams' account)")
    return table


def account_of(name: str, accounts: Mapping[str, Account]) -> str:
    """The account of user ``name`` (a role, or ``actor.<id>``)."""
    role = name.partition(".")[0]
    for account, spec in accounts.items():
        if role in spec.roles:
            return account
    raise ValueError(f"role {role!r} is in no NATS account (accounts.json)")


def account_links(accounts: Mapping[str, Account]) -> dict[str, dict[str, Any]]:
    """Each account's ``jetstream``, ``exports`` and ``imports`` as the server config says them:
    every import of another account is an export of :data:`STREAMS_ACCOUNT` that only the
    importers may import (``accounts``)."""
    exports: dict[tuple[str, str, str], list[str]] = {}
    links: dict[str, dict[str, Any]] = {}
    for name, spec in accounts.items():
        imports = []
        for i in spec.imports:
            kind, subject = ("service", i.service) if i.service else ("stream", i.stream)
            exports.setdefault((kind, subject, i.response), []).append(name)
            imports.append({kind: {"account": STREAMS_ACCOUNT, "subject": subject}})
        links[name] = {"jetstream": spec.jetstream, "exports": [], "imports": imports}
    for (kind, subject, response), importers in exports.items():
        export: dict[str, Any] = {kind: subject, "accounts": sorted(importers)}
        if response:
            export["response_type"] = response
        links[STREAMS_ACCOUNT]["exports"].append(export)
    return links


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
    keys: Mapping[str, RoleKey],
    permissions: Mapping[str, dict[str, Any]],
    *,
    run: str,
    accounts: Mapping[str, Account] | None = None,
) -> list[NatsUser]:
    """One nkey user per role of ``keys``, with that role's permissions (:func:`permissions_for`),
    in that role's account (``accounts``, default accounts.json); the actors' pinned to ``run``
    (:data:`ANY_RUN`: a server shared by many runs, e.g. the test suite's)."""
    accounts = load_accounts() if accounts is None else accounts
    return [
        NatsUser(
            nkey=key.public_key,
            permissions=permissions_for(role, permissions, run=run),
            account=account_of(role, accounts),
        )
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


def _user_line(u: NatsUser) -> str:
    who = (
        f"nkey: {_quoted(u.nkey)}"
        if u.nkey
        else f"user: {_quoted(u.user)}, password: {_quoted(u.password)}"
    )
    return f"{{{who}, permissions: {json.dumps(u.permissions, sort_keys=True)}}}"


def authorization_config(
    users: Sequence[NatsUser], accounts: Mapping[str, Account] | None = None
) -> str:
    """The server config's ``accounts`` block for ``users`` (each in its account; exports and
    imports from ``accounts``, default accounts.json), or, when no user names an account, a plain
    ``authorization`` block (permissions written as JSON, which the nats-server config format
    accepts)."""
    if not any(u.account for u in users):
        lines = ["authorization {", "  users = ["]
        lines += [f"    {_user_line(u)}" for u in users]
        return "\n".join([*lines, "  ]", "}"]) + "\n"
    accounts = load_accounts() if accounts is None else accounts
    unknown = sorted({u.account for u in users} - set(accounts))
    if unknown:
        raise ValueError(
            f"users in accounts {unknown}, which accounts.json does not define (every user names "
            "an account, or none does)"
        )
    lines = ["accounts {"]
    for name, link in account_links(accounts).items():
        lines.append(f"  {name} {{")
        if link["jetstream"]:
            lines.append("    jetstream: enabled")
        members = [u for u in users if u.account == name]
        lines += ["    users = [", *(f"      {_user_line(u)}" for u in members), "    ]"]
        for key in ("exports", "imports"):
            if link[key]:
                lines.append(f"    {key} = [")
                lines += [f"      {json.dumps(x, sort_keys=True)}" for x in link[key]]
                lines.append("    ]")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def tls_config(tls: ServerTls) -> str:
    """The server config's ``tls`` block."""
    fields = [f"cert_file: {_quoted(tls.cert_file)}", f"key_file: {_quoted(tls.key_file)}"]
    if tls.ca_file:
        fields.append(f"ca_file: {_quoted(tls.ca_file)}")
    fields.append(f"verify: {'true' if tls.verify and tls.ca_file else 'false'}")
    return "tls {\n" + "".join(f"  {f}\n" for f in fields) + "}\n"
