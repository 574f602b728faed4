"""Connecting to NATS: one set of options for every verb, turned into a client that reconnects
forever.

Every verb that talks to NATS takes the same options (:func:`add_nats_arguments`), each defaulting
to an environment variable. The variables carry only a URL and the *paths* of secret files, never a
secret itself, so nothing sandboxed code could read from the environment grants access:

| flag                     | environment                | what                                     |
|--------------------------|----------------------------|------------------------------------------|
| `--nats URL`             | `LEAFE_NATS_URL`           | URL(s), comma-separated for a cluster    |
| `--nats-creds FILE`      | `LEAFE_NATS_CREDS`         | NATS JWT `.creds` file                   |
| `--nats-nkey FILE`       | `LEAFE_NATS_NKEY`          | nkey seed file                           |
| `--nats-user NAME`       | `LEAFE_NATS_USER`          | user name (with a password file)         |
| `--nats-password-file F` | `LEAFE_NATS_PASSWORD_FILE` | file holding that user's password        |
| `--nats-tls-ca FILE`     | `LEAFE_NATS_TLS_CA`        | CA bundle that signed the server's cert  |
| `--nats-tls-cert FILE`   | `LEAFE_NATS_TLS_CERT`      | client certificate (mutual TLS)          |
| `--nats-tls-key FILE`    | `LEAFE_NATS_TLS_KEY`       | client key                               |
| `--nats-inbox-prefix P`  | `LEAFE_NATS_INBOX_PREFIX`  | inbox prefix (default: role's, below)    |
| `--streams-timeout S`    |                            | how long a service waits for its streams |

At most one identity: a ``.creds`` file, an nkey seed, or a user with a password file. A URL with
credentials in it (``nats://user:pass@host``) still works, but is never logged: every log line
carries :func:`redact` of the URL, and error messages are redacted the same way (a URL's user info
anywhere in the text). Streams are created by ``leafe streams ensure`` alone (the NATS admin);
services only wait for theirs (:func:`leafe.services.bus.streams.wait_for_streams`, bounded by
``--streams-timeout``).

Inboxes: pull deliveries and JetStream API replies arrive on a client's inbox subjects, so each
service role may subscribe only to its own prefix, ``_INBOX_<role>`` (permissions.json), and makes
every inbox under it (nats-py's ``inbox_prefix``: ``new_inbox()``, requests, JetStream acks and
pulls all use it). The role is taken from the identity when ``--nats-inbox-prefix`` is not given:
the user name, or the nkey seed file's name ``<role>.nk`` (how ``leafe run`` and deploy/ name them);
the admin and any other identity keep nats-py's ``_INBOX`` (the admin's permissions allow
``_INBOX.>``, which no service prefix falls under).

Actors: each actor has credentials of its own, pinned to its actor id (``services/bus/auth.py``):
the user ``actor.<id>``, or the seed file ``actor.<id>.nk``. Such an actor's inboxes are under
``_INBOX_actor.<id>`` (one actor cannot read another's deliveries) and :func:`credential_actor_id`
is the id ``leafe actor`` publishes as (the server refuses event subjects with any other actor
token).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import ssl
from pathlib import Path
from typing import Any

import msgspec
import nats
import structlog
from nats.aio.client import Client

__all__ = [
    "ROLES",
    "SERVICE_ROLES",
    "NatsOptions",
    "add_nats_arguments",
    "confined_role",
    "connect",
    "credential_actor_id",
    "inbox_prefix",
    "nats_options",
    "redact",
]

log = structlog.get_logger(__name__)
ROLES = ("actor", "replayer", "learner", "weight-sync", "log-import", "admin")
"""The NATS roles of deploy/base/nats/permissions.json: one per service, the log importer, and the
admin."""
SERVICE_ROLES = frozenset(ROLES) - {"admin"}
"""The roles confined to an inbox prefix of their own (:func:`inbox_prefix`)."""
DEFAULT_INBOX_PREFIX = "_INBOX"


class NatsOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to reach NATS (see the module docstring for the flags and variables)."""

    url: str = ""
    """Server URL(s), comma-separated; empty = none given (the verb decides: error, or embedded)."""
    creds: str = ""
    """Path of a NATS JWT ``.creds`` file; empty = none."""
    nkey: str = ""
    """Path of an nkey seed file; empty = none."""
    user: str = ""
    """User name for password authentication (the password comes from ``password_file``)."""
    password_file: str = ""
    """Path of the file holding ``user``'s password."""
    tls_ca: str = ""
    """CA bundle to verify the server with; setting any TLS field turns TLS on."""
    tls_cert: str = ""
    """Client certificate for mutual TLS (with ``tls_key``)."""
    tls_key: str = ""
    """Client private key."""
    streams_timeout_s: float = 120.0
    """How long a service waits for the streams it uses to exist before it exits non-zero
    (seconds)."""
    inbox_prefix: str = ""
    """Prefix of every inbox the client makes; empty = its role's (:func:`inbox_prefix`)."""

    def __post_init__(self) -> None:
        if not self.streams_timeout_s > 0:
            raise ValueError(
                f"streams_timeout_s = {self.streams_timeout_s}: expected a positive number"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if bool(self.user) != bool(self.password_file):
            raise ValueError("user and password_file go together: give both or neither")
        given = [
            name
            for name, v in (("creds", self.creds), ("nkey", self.nkey), ("user", self.user))
            if v
        ]
        if len(given) > 1:
            raise ValueError(f"NATS identity given twice ({' and '.join(given)}): give exactly one")
        if self.inbox_prefix and not _PREFIX.fullmatch(self.inbox_prefix):
            raise ValueError(
                f"inbox_prefix {self.inbox_prefix!r}: expected dot-separated [A-Za-z0-9_-] tokens"
            )


_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _identity_name(opts: NatsOptions) -> str:
    """The user name, or the nkey seed file's name without ``.nk`` (``actor``, ``actor.a0``), else
    ``""``."""
    return opts.user or (
        Path(opts.nkey).name.removesuffix(".nk") if opts.nkey.endswith(".nk") else ""
    )


def credential_actor_id(opts: NatsOptions) -> str | None:
    """The actor id ``opts``' credentials are pinned to (user or seed file ``actor.<id>``), else
    None."""
    role, dot, actor = _identity_name(opts).partition(".")
    return actor if role == "actor" and dot and actor else None


def inbox_prefix(opts: NatsOptions) -> str:
    """The inbox prefix ``opts`` connects with: the explicit one, else ``_INBOX_<role>`` for a
    service role named by the user name or the nkey seed file (``<role>.nk``; ``_INBOX_actor.<id>``
    for an actor's own credentials, ``actor.<id>``), else nats-py's ``_INBOX``."""
    if opts.inbox_prefix:
        return opts.inbox_prefix
    actor = credential_actor_id(opts)
    if actor is not None and _PREFIX.fullmatch(actor):
        return f"{DEFAULT_INBOX_PREFIX}_actor.{actor}"
    role = _identity_name(opts)
    return f"{DEFAULT_INBOX_PREFIX}_{role}" if role in SERVICE_ROLES else DEFAULT_INBOX_PREFIX


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def add_nats_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The NATS flags every verb shares (defaults from the environment, see the module
    docstring)."""
    g = parser.add_argument_group("NATS")
    url = _env("LEAFE_NATS_URL")
    g.add_argument(
        "--nats",
        default=url,
        required=required and not url,
        help="NATS URL(s) (default $LEAFE_NATS_URL)",
    )
    g.add_argument(
        "--nats-creds", "--creds", default=_env("LEAFE_NATS_CREDS"), help="JWT .creds file"
    )
    g.add_argument("--nats-nkey", default=_env("LEAFE_NATS_NKEY"), help="nkey seed file")
    g.add_argument(
        "--nats-user", default=_env("LEAFE_NATS_USER"), help="user (with --nats-password-file)"
    )
    g.add_argument(
        "--nats-password-file", default=_env("LEAFE_NATS_PASSWORD_FILE"), help="password file"
    )
    g.add_argument(
        "--nats-tls-ca", default=_env("LEAFE_NATS_TLS_CA"), help="CA bundle (turns TLS on)"
    )
    g.add_argument(
        "--nats-tls-cert", default=_env("LEAFE_NATS_TLS_CERT"), help="client certificate"
    )
    g.add_argument("--nats-tls-key", default=_env("LEAFE_NATS_TLS_KEY"), help="client key")
    g.add_argument(
        "--nats-inbox-prefix",
        default=_env("LEAFE_NATS_INBOX_PREFIX"),
        help="inbox prefix (default: _INBOX_<role> for a service role's user or <role>.nk seed, "
        "else _INBOX)",
    )
    g.add_argument(
        "--streams-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the streams to exist (made by `leafe streams ensure`; "
        "default 120)",
    )


def nats_options(args: argparse.Namespace) -> NatsOptions:
    """The :class:`NatsOptions` of parsed arguments (raises ``ValueError`` naming a bad
    combination)."""
    return NatsOptions(
        url=args.nats or "",
        creds=args.nats_creds or "",
        nkey=args.nats_nkey or "",
        user=args.nats_user or "",
        password_file=args.nats_password_file or "",
        tls_ca=args.nats_tls_ca or "",
        tls_cert=args.nats_tls_cert or "",
        tls_key=args.nats_tls_key or "",
        inbox_prefix=args.nats_inbox_prefix or "",
        streams_timeout_s=args.streams_timeout,
    )


_USER_INFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^\s/,]*@")
"""A URL's scheme and user info: greedy up to the last ``@`` before the host, so a password holding
an unencoded ``@`` is covered too."""


def redact(text: str) -> str:
    """``text`` (a URL, comma-separated URLs, or an error message quoting them) with the user info
    of every URL in it replaced by ``***``."""
    return _USER_INFO.sub(r"\g<scheme>***@", text)


def confined_role(nc: Client) -> str | None:
    """The service role a connection is confined to (its inbox prefix is ``_INBOX_<role>``), else
    None (the admin, or an identity of its own): such a connection may not create or change
    consumers."""
    prefix = bytes(nc._inbox_prefix).decode()
    role = prefix.removeprefix(f"{DEFAULT_INBOX_PREFIX}_").split(".", 1)[0]
    return role if role != prefix and role in SERVICE_ROLES else None


def _existing(path: str, what: str) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(f"NATS {what} file {path!r} does not exist")
    return path


def _auth_kwargs(opts: NatsOptions) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if opts.creds:
        kwargs["user_credentials"] = _existing(opts.creds, "credentials")
    if opts.nkey:
        kwargs["nkeys_seed"] = _existing(opts.nkey, "nkey seed")
    if opts.user:
        password = (
            Path(_existing(opts.password_file, "password")).read_text(encoding="utf-8").strip()
        )
        kwargs.update(user=opts.user, password=password)
    if opts.tls_ca or opts.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        if opts.tls_ca:
            context.load_verify_locations(_existing(opts.tls_ca, "TLS CA"))
        if opts.tls_cert:
            context.load_cert_chain(
                _existing(opts.tls_cert, "TLS cert"), _existing(opts.tls_key, "TLS key")
            )
        kwargs["tls"] = context
    return kwargs


def _first_connect_limit(kwargs: dict[str, Any]) -> float | None:
    """How long the first connection may take: every server tried ``max_reconnect_attempts`` times,
    each ``connect_timeout`` + ``reconnect_time_wait``, plus slack; None when the attempts are
    unbounded."""
    attempts = int(kwargs["max_reconnect_attempts"])
    if attempts < 0:
        return None
    per_try = float(kwargs.get("connect_timeout", 2.0)) + float(kwargs["reconnect_time_wait"])
    return len(kwargs["servers"]) * max(1, attempts) * per_try + 5.0


async def connect(
    nats_opts: NatsOptions | str,
    *,
    name: str = "leafe",
    connect_attempts: int = 3,
    **options: Any,
) -> Client:
    """Connect with ``nats_opts`` (or a bare URL); the first connection is tried
    ``connect_attempts`` times, then raises; once connected the client reconnects forever (a
    restarted server or cluster node is waited for, with events logged). ``options`` go to
    ``nats.connect`` unchanged (an ``error_cb`` among them is called after ours, which logs the
    error redacted).

    The first connection is bounded in time: nats-py never returns from a failed TLS handshake (a
    server certificate it does not trust; nats-io/nats.py#718), so past the time its attempts could
    take this raises ``ConnectionError`` naming the URL (redacted) and the last error."""
    opts = NatsOptions(url=nats_opts) if isinstance(nats_opts, str) else nats_opts
    if not opts.url:
        raise ValueError("no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    shown = redact(opts.url)
    client: list[Client] = []
    last_error: list[str] = []
    also = options.pop("error_cb", None)

    async def on_error(e: Exception) -> None:
        last_error[:] = [redact(f"{type(e).__name__}: {e}")]
        log.warning("bus.nats.error", url=shown, error=last_error[0])
        if also is not None:
            await also(e)

    async def on_disconnect() -> None:
        if not (client and client[0].is_closed):  # a close() we asked for is not news
            log.warning("bus.nats.disconnected", url=shown)

    async def on_reconnect() -> None:
        log.info("bus.nats.reconnected", url=shown)

    kwargs: dict[str, Any] = {
        "servers": [u.strip() for u in opts.url.split(",") if u.strip()],
        "name": name,
        "reconnect_time_wait": 0.5,
        "max_reconnect_attempts": connect_attempts,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        "inbox_prefix": inbox_prefix(opts),
        **_auth_kwargs(opts),
    }
    kwargs.update(options)
    limit = _first_connect_limit(kwargs)
    try:
        async with asyncio.timeout(
            limit
        ):  # not wait_for: 3.11's drops a cancel that meets the connect
            nc = await nats.connect(**kwargs)
    except TimeoutError:
        why = last_error[0] if last_error else "no answer"
        raise ConnectionError(
            f"no NATS connection to {shown} within {limit:g}s; last error: {why}"
        ) from None
    client.append(nc)
    if "max_reconnect_attempts" not in options:
        nc.options["max_reconnect_attempts"] = -1  # after the first connection: reconnect forever
    return nc
