"""TLS end to end on a real nats-server with a throwaway CA (tests/support/tls.py): the server
requires TLS and a client certificate signed by the CA (``tls { verify: true }``) and holds the
actor's nkey user to its permissions. A client with ``--nats-tls-ca/cert/key`` and its seed connects
and publishes; a client that does not trust the CA, one without a client certificate, and one
speaking plaintext are refused."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.errors import NoServersError

from leafe.protocol.subjects import EVENTS
from leafe.services.bus import NatsOptions, connect, ensure_streams
from leafe.services.bus.auth import (
    NatsUser,
    ServerTls,
    key_names,
    load_permissions,
    nkey_users,
    role_options,
    write_role_keys,
)
from leafe.services.bus.nats_server import EmbeddedNats
from tests.support.tls import Pki, make_pki

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, pki: Pki
) -> Iterator[tuple[EmbeddedNats, dict]]:
    """A server with mutual TLS and the roles' nkey users; yields it and each role's options (with
    TLS)."""
    store = tmp_path_factory.mktemp("tls-js")
    keys = write_role_keys(tmp_path_factory.mktemp("tls-keys"), key_names(["a0"]))
    users: list[NatsUser] = nkey_users(keys, load_permissions(), run="tls")
    tls = ServerTls(
        cert_file=str(pki.server_cert), key_file=str(pki.server_key), ca_file=str(pki.ca)
    )
    with EmbeddedNats(store, log_file=store / "nats.log", users=users, tls=tls) as server:
        files = {
            "tls_ca": str(pki.ca),
            "tls_cert": str(pki.client_cert),
            "tls_key": str(pki.client_key),
        }
        yield server, role_options(server.url, keys, **files)


async def test_a_client_with_the_ca_and_its_certificate_connects_and_publishes(
    tls_server: tuple[EmbeddedNats, dict[str, NatsOptions]],
) -> None:
    """Over mutual TLS, the admin creates the streams and the actor publishes an event that is
    stored."""
    _, roles = tls_server
    admin = await connect(roles["admin"])
    await ensure_streams(admin.jetstream())
    actor = await connect(roles["actor.a0"])
    ack = await actor.jetstream().publish("leafe.tls.events.step.a0", b"over tls")
    assert ack.stream == EVENTS.name
    stored = await admin.jetstream().get_msg(EVENTS.name, seq=ack.seq)
    assert stored.data == b"over tls"
    await actor.close()
    await admin.close()


@pytest.mark.parametrize(
    ("who", "changes", "refusal"),
    [
        ("a client trusting another CA", {"tls_ca": "other_ca"}, "CERTIFICATE_VERIFY_FAILED"),
        # TLS 1.3: the server's alert may arrive as the alert, or as the connection dropped under
        # the client's next read or write (the server's log then says why: checked below)
        (
            "a client without a certificate",
            {"tls_cert": "", "tls_key": ""},
            "CERTIFICATE_REQUIRED|Connection|Broken pipe",
        ),
        (
            "a plaintext client",
            {"tls_ca": "", "tls_cert": "", "tls_key": ""},
            "CERTIFICATE_VERIFY_FAILED",
        ),
    ],
)
async def test_clients_without_the_ca_or_a_certificate_are_refused(
    tls_server: tuple[EmbeddedNats, dict[str, NatsOptions]],
    pki: Pki,
    who: str,
    changes: dict[str, str],
    refusal: str,
) -> None:
    """The seed alone is not enough: a client that does not trust our CA fails the server's
    certificate (a plaintext client is upgraded with the system's CAs), and the server refuses a
    client without a certificate of ours; connect() raises (it never hangs: nats-io/nats.py#718) and
    the TLS error is logged."""
    server, roles = tls_server
    if changes.get("tls_ca") == "other_ca":
        changes = {"tls_ca": str(pki.other_ca)}
    errors: list[str] = []

    async def seen(e: Exception) -> None:
        errors.append(str(e))

    with pytest.raises((NoServersError, ConnectionError)):
        await connect(
            msgspec.structs.replace(roles["actor.a0"], **changes), connect_attempts=1, error_cb=seen
        )
    assert any(re.search(refusal, e) for e in errors), (who, errors)
    if "tls_ca" not in changes and not any("CERTIFICATE_REQUIRED" in e for e in errors):
        assert server.log_file is not None
        assert "client didn't provide a certificate" in _read(server.log_file), (
            "the server says why"
        )


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def test_the_server_config_turns_verification_on(
    tls_server: tuple[EmbeddedNats, dict], pki: Pki
) -> None:
    """What the embedded server was given: TLS with the CA and `verify: true` (mutual TLS)."""
    server, _ = tls_server
    text = (Path(server.store_dir) / "nats-server.conf").read_text()
    assert f'ca_file: "{pki.ca}"' in text and "verify: true" in text
