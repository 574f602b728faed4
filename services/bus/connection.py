"""Connecting to NATS: one set of options for every verb, turned into a client that reconnects forever.

Every verb that talks to NATS takes the same options (:func:`add_nats_arguments`), each defaulting to
an environment variable. The variables carry only a URL and the *paths* of secret files, never a
secret itself, so nothing sandboxed code could read from the environment grants access:

| flag                     | environment               | what                                        |
|--------------------------|---------------------------|---------------------------------------------|
| `--nats URL`             | `LEAFE_NATS_URL`          | server URL(s), comma-separated for a cluster |
| `--nats-creds FILE`      | `LEAFE_NATS_CREDS`        | NATS JWT `.creds` file                       |
| `--nats-nkey FILE`       | `LEAFE_NATS_NKEY`         | nkey seed file                               |
| `--nats-user NAME`       | `LEAFE_NATS_USER`         | user name (with a password file)             |
| `--nats-password-file F` | `LEAFE_NATS_PASSWORD_FILE`| file holding that user's password            |
| `--nats-tls-ca FILE`     | `LEAFE_NATS_TLS_CA`       | CA bundle that signed the server's cert      |
| `--nats-tls-cert FILE`   | `LEAFE_NATS_TLS_CERT`     | client certificate (mutual TLS)              |
| `--nats-tls-key FILE`    | `LEAFE_NATS_TLS_KEY`      | client key                                   |
| `--stream-replicas N`    |                           | replicas of streams this verb creates        |

A URL with credentials in it (``nats://user:pass@host``) still works, but is never logged: every log
line carries :func:`redact` of the URL.
"""

from __future__ import annotations

import argparse
import os
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import nats
import structlog
from nats.aio.client import Client

__all__ = ["NatsOptions", "add_nats_arguments", "connect", "nats_options", "redact"]

log = structlog.get_logger(__name__)


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
    stream_replicas: int = 1
    """Replicas of the streams this process creates (3 on a clustered JetStream)."""

    def __post_init__(self) -> None:
        if not 1 <= self.stream_replicas <= 5:
            raise ValueError(f"stream_replicas = {self.stream_replicas}: expected 1 to 5")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if bool(self.user) != bool(self.password_file):
            raise ValueError("user and password_file go together: give both or neither")


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def add_nats_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The NATS flags every verb shares (defaults from the environment, see the module docstring)."""
    g = parser.add_argument_group("NATS")
    url = _env("LEAFE_NATS_URL")
    g.add_argument(
        "--nats", default=url, required=required and not url, help="NATS URL(s) (default $LEAFE_NATS_URL)"
    )
    g.add_argument("--nats-creds", "--creds", default=_env("LEAFE_NATS_CREDS"), help="JWT .creds file")
    g.add_argument("--nats-nkey", default=_env("LEAFE_NATS_NKEY"), help="nkey seed file")
    g.add_argument("--nats-user", default=_env("LEAFE_NATS_USER"), help="user (with --nats-password-file)")
    g.add_argument("--nats-password-file", default=_env("LEAFE_NATS_PASSWORD_FILE"), help="password file")
    g.add_argument("--nats-tls-ca", default=_env("LEAFE_NATS_TLS_CA"), help="CA bundle (turns TLS on)")
    g.add_argument("--nats-tls-cert", default=_env("LEAFE_NATS_TLS_CERT"), help="client certificate")
    g.add_argument("--nats-tls-key", default=_env("LEAFE_NATS_TLS_KEY"), help="client key")
    g.add_argument("--stream-replicas", type=int, default=1, help="replicas of streams created (default 1)")


def nats_options(args: argparse.Namespace) -> NatsOptions:
    """The :class:`NatsOptions` of parsed arguments (raises ``ValueError`` naming a bad combination)."""
    return NatsOptions(
        url=args.nats or "",
        creds=args.nats_creds or "",
        nkey=args.nats_nkey or "",
        user=args.nats_user or "",
        password_file=args.nats_password_file or "",
        tls_ca=args.nats_tls_ca or "",
        tls_cert=args.nats_tls_cert or "",
        tls_key=args.nats_tls_key or "",
        stream_replicas=args.stream_replicas,
    )


def redact(url: str) -> str:
    """``url`` with any user info replaced by ``***`` (for logs); each comma-separated URL separately."""
    out = []
    for part in url.split(","):
        part = part.strip()
        try:
            split = urlsplit(part)
        except ValueError:
            out.append("<unparseable URL>")
            continue
        if split.username is not None or split.password is not None:
            host = split.hostname or ""
            netloc = f"***@{host}" + (f":{split.port}" if split.port else "")
            part = urlunsplit((split.scheme, netloc, split.path, split.query, split.fragment))
        out.append(part)
    return ",".join(out)


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
        password = Path(_existing(opts.password_file, "password")).read_text(encoding="utf-8").strip()
        kwargs.update(user=opts.user, password=password)
    if opts.tls_ca or opts.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        if opts.tls_ca:
            context.load_verify_locations(_existing(opts.tls_ca, "TLS CA"))
        if opts.tls_cert:
            context.load_cert_chain(_existing(opts.tls_cert, "TLS cert"), _existing(opts.tls_key, "TLS key"))
        kwargs["tls"] = context
    return kwargs


async def connect(
    nats_opts: NatsOptions | str,
    *,
    name: str = "leafe",
    connect_attempts: int = 3,
    **options: Any,
) -> Client:
    """Connect with ``nats_opts`` (or a bare URL); the first connection is tried ``connect_attempts``
    times, then raises; once connected the client reconnects forever (a restarted server or cluster
    node is waited for, with events logged). ``options`` go to ``nats.connect`` unchanged."""
    opts = NatsOptions(url=nats_opts) if isinstance(nats_opts, str) else nats_opts
    if not opts.url:
        raise ValueError("no NATS URL: pass --nats URL or set LEAFE_NATS_URL")
    shown = redact(opts.url)
    client: list[Client] = []

    async def on_error(e: Exception) -> None:
        log.warning("bus.nats.error", url=shown, error=redact(f"{type(e).__name__}: {e}"))

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
        **_auth_kwargs(opts),
    }
    kwargs.update(options)
    nc = await nats.connect(**kwargs)
    client.append(nc)
    if "max_reconnect_attempts" not in options:
        nc.options["max_reconnect_attempts"] = -1  # after the first connection: reconnect forever
    return nc
