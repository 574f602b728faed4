"""Embedded-server identities (services/bus/auth.py): per-role nkey seeds written privately, server
config blocks that nats-server accepts, permissions read from deploy's permissions.json and nowhere
else."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path
from typing import Any

import nkeys
import pytest

from leafe.services.bus.auth import (
    ACCOUNTS_FILE,
    ANY_RUN,
    PERMISSIONS_FILE,
    ROLES,
    STREAMS_ACCOUNT,
    NatsUser,
    ServerTls,
    account_of,
    actor_key_name,
    authorization_config,
    key_names,
    load_accounts,
    load_permissions,
    nkey_users,
    permissions_for,
    role_options,
    tls_config,
    write_role_keys,
)
from leafe.services.bus.nats_server import find_nats_server


def test_each_role_gets_a_private_seed_matching_its_public_key(tmp_path: Path) -> None:
    """One seed file per role, mode 0600 in a 0700 directory, holding a user seed (SU...) whose
    public key is the one the server config names; a second call makes new keys (no key outlives a
    start)."""
    keys = write_role_keys(tmp_path / "keys")
    assert set(keys) == set(ROLES) - {"actor"}  # actors have users of their own (below)
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    for role, key in keys.items():
        path = Path(key.seed_file)
        assert path.name == f"{role}.nk" and stat.S_IMODE(path.stat().st_mode) == 0o600
        seed = path.read_bytes()
        assert (
            seed.startswith(b"SU")
            and nkeys.from_seed(bytearray(seed)).public_key.decode() == key.public_key
        )
    again = write_role_keys(tmp_path / "keys")
    assert {k.public_key for k in again.values()}.isdisjoint(k.public_key for k in keys.values())


def test_role_options_give_each_role_its_own_seed_only(tmp_path: Path) -> None:
    """A role's options carry the URL and that role's seed file, and no other identity."""
    keys = write_role_keys(tmp_path)
    options = role_options("nats://127.0.0.1:4222", keys, tls_ca="/ca.crt")
    for role, opts in options.items():
        assert (opts.nkey, opts.creds, opts.user, opts.tls_ca) == (
            keys[role].seed_file,
            "",
            "",
            "/ca.crt",
        )


def test_the_server_accepts_the_generated_config(tmp_path: Path) -> None:
    """permissions.json's roles as nkey users, a password user, and a TLS block pass `nats-server
    -t`."""
    users = [
        *nkey_users(
            write_role_keys(tmp_path / "keys", key_names(["a0", "a1"])),
            load_permissions(),
            run="r1",
        ),
        NatsUser(
            user="admin",
            password="pw",
            permissions=load_permissions()["admin"],
            account=STREAMS_ACCOUNT,
        ),
    ]
    for name in ("a.crt", "a.key", "ca.crt"):
        (tmp_path / name).write_text("placeholder", encoding="utf-8")
    text = authorization_config(users)
    assert text.count("nkey:") == len(ROLES) - 1 + 2 and 'user: "admin", password: "pw"' in text
    assert text.startswith("accounts {") and "jetstream: enabled" in text
    conf = tmp_path / "nats.conf"
    conf.write_text('listen: "127.0.0.1:4222"\n' + text, encoding="utf-8")
    proc = subprocess.run(
        [str(find_nats_server()), "-c", str(conf), "-t"], capture_output=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    tls = tls_config(ServerTls(cert_file="/c.crt", key_file="/c.key", ca_file="/ca.crt"))
    assert tls.splitlines() == [
        "tls {",
        '  cert_file: "/c.crt"',
        '  key_file: "/c.key"',
        '  ca_file: "/ca.crt"',
        "  verify: true",
        "}",
    ]


def test_permissions_come_from_deploy_and_must_name_every_role(tmp_path: Path) -> None:
    """The embedded server's permissions are deploy/base/nats/permissions.json; a file without every
    role, or a missing file, is refused naming it."""
    assert PERMISSIONS_FILE.parts[-4:] == ("deploy", "base", "nats", "permissions.json")
    assert set(load_permissions()) == set(ROLES)
    partial = tmp_path / "permissions.json"
    partial.write_text(json.dumps({"actor": {}}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"permissions.json defines roles \['actor'\]"):
        load_permissions(partial)
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        load_permissions(tmp_path / "nope.json")


def test_a_user_is_an_nkey_or_a_name_with_a_password() -> None:
    """Both, neither, a non-user key or a name without password are refused."""
    with pytest.raises(ValueError, match="not both or neither"):
        NatsUser(nkey="UABC", user="x", password="p", permissions={})
    with pytest.raises(ValueError, match="not a user public key"):
        NatsUser(nkey="ABC", permissions={})
    with pytest.raises(ValueError, match="needs a password"):
        NatsUser(user="x", permissions={})


def test_each_service_role_gets_an_inbox_prefix_of_its_own() -> None:
    """``_INBOX_<role>`` from the user name or the seed file ``<role>.nk``; the admin and unknown
    identities keep ``_INBOX``; an explicit prefix wins, and one that is not a subject prefix is
    refused."""
    from leafe.services.bus.connection import NatsOptions, inbox_prefix

    url = "nats://h:4222"
    assert inbox_prefix(NatsOptions(url=url, user="actor", password_file="/p")) == "_INBOX_actor"
    assert inbox_prefix(NatsOptions(url=url, nkey="/k/weight-sync.nk")) == "_INBOX_weight-sync"
    assert inbox_prefix(NatsOptions(url=url, nkey="/k/admin.nk")) == "_INBOX"
    assert inbox_prefix(NatsOptions(url=url, nkey="/k/me.seed")) == "_INBOX"
    assert inbox_prefix(NatsOptions(url=url)) == "_INBOX"
    assert inbox_prefix(NatsOptions(url=url, nkey="/k/actor.nk", inbox_prefix="_I.x")) == "_I.x"
    assert (
        inbox_prefix(NatsOptions(url=url, nkey="/k/actor.r1-actor-0.nk"))
        == "_INBOX_actor.r1-actor-0"
    )
    assert (
        inbox_prefix(NatsOptions(url=url, user="actor.a1", password_file="/p")) == "_INBOX_actor.a1"
    )
    with pytest.raises(ValueError, match="inbox_prefix"):
        NatsOptions(url=url, inbox_prefix="_INBOX.>")


def test_each_actor_is_a_user_pinned_to_its_own_event_token(tmp_path: Path) -> None:
    """``actor.<id>`` gets the actor role's permissions with ``{actor}`` replaced by its id and
    ``{run}`` by its run: events only on ``leafe.<run>.events.*.<id>``, the task durable
    ``actors-<run>`` only, inboxes only ``_INBOX_actor.<id>``, acks only as responses; for any run
    (``ANY_RUN``) each token naming the run is ``*``. There is no shared actor user, and an id that
    is no subject token (a dot, a wildcard, the reserved ``legacy``) or a run that is none is
    refused naming it."""
    from leafe.services.bus.connection import NatsOptions, credential_actor_id

    table = load_permissions()
    perms = permissions_for(actor_key_name("r1-actor-3"), table, run="r1")
    events = [s for s in perms["publish"]["allow"] if ".events." in s]
    assert events == ["leafe.r1.events.*.r1-actor-3"]
    assert "$JS.API.CONSUMER.MSG.NEXT.LEAFE_TASKS.actors-r1" in perms["publish"]["allow"]
    assert perms["subscribe"]["allow"] == ["_INBOX_actor.r1-actor-3.>"]
    assert perms["allow_responses"] == {"max": -1, "expires": "24h"}
    assert not [s for s in perms["publish"]["allow"] if s.startswith("$JS.ACK")]
    assert "{actor}" not in json.dumps(perms) and "{actor}" in json.dumps(table["actor"])
    assert "{run}" not in json.dumps(perms) and "{run}" in json.dumps(table["actor"])
    anyrun = permissions_for(actor_key_name("a0"), table, run=ANY_RUN)["publish"]["allow"]
    assert "leafe.*.events.*.a0" in anyrun and "$JS.API.CONSUMER.MSG.NEXT.LEAFE_TASKS.*" in anyrun
    with pytest.raises(ValueError, match="no shared user"):
        permissions_for("actor", table, run="r1")
    with pytest.raises(ValueError, match="invalid run id"):
        permissions_for(actor_key_name("a0"), table, run="r1.>")
    for bad in ("a.b", "*", ">", "legacy", "-x", ""):
        with pytest.raises(ValueError, match="invalid actor id"):
            actor_key_name(bad)
    keys = write_role_keys(tmp_path, key_names(["a0"]))
    assert Path(keys["actor.a0"].seed_file).name == "actor.a0.nk"
    opts = role_options("nats://h:4222", keys)["actor.a0"]
    assert (
        credential_actor_id(opts) == "a0"
        and credential_actor_id(role_options("nats://h", keys)["learner"]) is None
    )
    assert credential_actor_id(NatsOptions(url="nats://h", nkey="/k/actor.nk")) is None


def test_each_role_lives_in_the_account_accounts_json_gives_it(tmp_path: Path) -> None:
    """The streams' account holds the replayer, the learner and the admin; every actor's user,
    weight sync and log import live in accounts of their own, without JetStream, importing from it
    only what they use; a mix of users with and without an account is refused (one would be left
    out of the config)."""
    accounts = load_accounts()
    assert ACCOUNTS_FILE.parent == PERMISSIONS_FILE.parent
    assert {name: account_of(name, accounts) for name in (*ROLES, "actor.a0")} == {
        "actor": "ACTORS",
        "actor.a0": "ACTORS",
        "replayer": STREAMS_ACCOUNT,
        "learner": STREAMS_ACCOUNT,
        "admin": STREAMS_ACCOUNT,
        "weight-sync": "WEIGHT_SYNC",
        "log-import": "LOG_IMPORT",
    }
    assert [n for n, a in accounts.items() if a.jetstream] == [STREAMS_ACCOUNT]
    keys = write_role_keys(tmp_path, key_names(["a0"]))
    users = nkey_users(keys, load_permissions(), run="r1")
    assert {u.account for u in users} == set(accounts)
    with pytest.raises(ValueError, match="every user names an account"):
        authorization_config([*users, NatsUser(user="x", password="p", permissions={})])
    plain = authorization_config([NatsUser(user="x", password="p", permissions={})])
    assert plain.startswith("authorization {") and "accounts" not in plain


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda t: t["ACTORS"]["roles"].clear(), "expected each of"),
        (lambda t: t["LOG_IMPORT"]["roles"].append("actor"), "expected each of"),
        (lambda t: t["ACTORS"].update(jetstream=True), "JetStream belongs to account LEAFE"),
        (lambda t: t["LEAFE"]["imports"].append({"service": "x"}), "imports nothing"),
        (lambda t: t["WEIGHT_SYNC"]["imports"].pop(0), r"not \$JS.API.INFO"),
        (
            lambda t: t["ACTORS"]["imports"].append({"stream": "a", "response": "stream"}),
            "services",
        ),
        (lambda t: t["ACTORS"]["imports"].append({"service": "a", "stream": "b"}), "not both"),
        (lambda t: t.update(actors=t.pop("ACTORS")), "account name 'actors'"),
        (lambda t: t["ACTORS"].update(extra=1), "unknown field"),
    ],
)
def test_accounts_json_is_checked(tmp_path: Path, change: Any, error: str) -> None:
    """A role in no account or in two, JetStream outside the streams' account, an account that asks
    the JetStream API without importing ``$JS.API.INFO`` (the server would answer it itself: "not
    enabled"), a malformed import: refused naming the file."""
    table = json.loads(ACCOUNTS_FILE.read_text(encoding="utf-8"))
    change(table)
    path = tmp_path / "accounts.json"
    path.write_text(json.dumps(table), encoding="utf-8")
    with pytest.raises(ValueError, match=error):
        load_accounts(path)
