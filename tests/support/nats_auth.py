"""NATS identities for the test suite's server: every role of deploy's permissions.json as an nkey
user (what ``leafe run`` does too), plus one password user with the admin's permissions whose URL
``nats_url`` hands to the tests that are not about permissions (a URL carrying credentials reaches
every verb and subprocess unchanged: ``connect(url)``, ``--nats URL``, ``$LEAFE_NATS_URL``). The
fixtures are in tests/conftest.py.

Each actor is a user of its own (``actor.<id>``, publishing events only on its id's subject token),
as ``leafe run`` makes them: the server has :data:`TEST_ACTORS`, and ``options(url)["actor"]`` is
the first. Unlike ``leafe run``'s, they serve any run (``ANY_RUN``: every test has a run id of its
own); pinning an actor to its run is tests/integration/test_hostile_tasks.py, on a server of its
own.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leafe.services.bus import NatsOptions, connect
from leafe.services.bus.auth import (
    ANY_RUN,
    STREAMS_ACCOUNT,
    NatsUser,
    RoleKey,
    actor_key_name,
    key_names,
    load_permissions,
    nkey_users,
    role_options,
    write_role_keys,
)

__all__ = [
    "SEED_PATTERN",
    "TEST_ACTORS",
    "NatsIdentities",
    "RoleClient",
    "make_identities",
    "stored",
]

TEST_ACTORS = ("actor-0", "actor-1")
"""The actors with users of their own on the test server (``actor-0`` is the fake episodes'
default)."""

SEED_PATTERN = re.compile(r"SU[A-Z2-7]{56}")
"""An encoded user nkey seed (``SU`` + base32): what must never appear in a log."""


@dataclass(frozen=True)
class NatsIdentities:
    """The users of the test server and how to reach it as each of them."""

    keys: dict[str, RoleKey]
    """Each role's nkey (seed file and public key), and each test actor's (``actor.<id>``)."""
    admin_password: str
    """Password of the ``admin`` password user (the ``nats_url`` identity)."""
    permissions: dict[str, dict[str, Any]]
    """permissions.json, by role."""

    def users(self) -> list[NatsUser]:
        """Every role as an nkey user in its account (accounts.json), and ``admin`` with a password
        in the streams' account."""
        admin = NatsUser(
            user="admin",
            password=self.admin_password,
            permissions=self.permissions["admin"],
            account=STREAMS_ACCOUNT,
        )
        return [*nkey_users(self.keys, self.permissions, run=ANY_RUN), admin]

    def options(self, url: str) -> dict[str, NatsOptions]:
        """Each role's client options on the server at ``url`` (its seed file); ``actor.<id>`` for
        each of :data:`TEST_ACTORS`, and ``actor`` for the first of them."""
        options = role_options(url, self.keys)
        return {**options, "actor": options[actor_key_name(TEST_ACTORS[0])]}

    def admin_url(self, url: str) -> str:
        """``url`` carrying the admin password user's credentials."""
        scheme, rest = url.split("://", 1)
        return f"{scheme}://admin:{self.admin_password}@{rest}"

    def secrets(self) -> list[str]:
        """Every secret of these identities: each seed and the admin password."""
        seeds = [Path(k.seed_file).read_text(encoding="utf-8").strip() for k in self.keys.values()]
        return [*seeds, self.admin_password]


def make_identities(directory: Path) -> NatsIdentities:
    """Fresh nkeys for every role in ``directory`` and a random admin password."""
    permissions = load_permissions()
    return NatsIdentities(
        keys=write_role_keys(directory, key_names(TEST_ACTORS)),
        admin_password=secrets.token_urlsafe(24),
        permissions=permissions,
    )


class RoleClient:
    """A connection as one role that records every permissions violation the server reports."""

    def __init__(self, opts: NatsOptions) -> None:
        self.opts = opts
        self.violations: list[str] = []

    async def __aenter__(self) -> RoleClient:
        async def on_error(e: Exception) -> None:
            if "permissions violation" in str(e).lower():
                self.violations.append(str(e).lower())

        self.nc = await connect(self.opts, name="test-role", error_cb=on_error)
        self.js = self.nc.jetstream()
        self.probe = self.nc.jetstream(timeout=1.0)
        """For calls that are expected to go unanswered (a denied request gets no reply)."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def violated(self, subject: str) -> bool:
        """Whether the server reported a violation naming ``subject`` (waits up to 10 s for the
        report)."""
        needle = f'"{subject.lower()}"'
        deadline = time.monotonic() + 10.0
        while not any(needle in v for v in self.violations):
            if time.monotonic() > deadline:
                return False
            await self.nc.flush()
            await asyncio.sleep(0.02)
        return True


async def stored(js: Any, subject: str) -> int:
    """Messages on ``subject`` in whichever stream holds it."""
    stream = await js.find_stream_name_by_subject(subject)
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())
