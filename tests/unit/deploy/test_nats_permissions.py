"""NATS least privilege: deploy/base/nats/permissions.json is the one list of per-role subject
permissions; the server's authorization block (authorization.conf, in the rendered nats-config) must
say exactly the same, and the rendered configs must pass `nats-server -t` (gpu's with TLS
certificates in place).

The semantic tests read permissions.json with NATS's own matching rules (deny wins) and pin the
roles: only the learner publishes weights, only admin manages streams, actors cannot read samples,
and so on. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from leafe.services.bus.auth import (
    ANY_RUN,
    STREAMS_ACCOUNT,
    account_links,
    account_of,
    load_accounts,
    permissions_for,
)
from tests.support.manifests import (
    DEPLOY,
    KUSTOMIZATIONS,
    NATS_ROLES,
    OVERLAYS,
    config_map_value,
    container_named,
    containers,
    find,
)
from tests.support.policies import nats_allows, subject_matches

Docs = list[dict[str, Any]]
PERMISSIONS: dict[str, Any] = json.loads(
    (DEPLOY / "base/nats/permissions.json").read_text(encoding="utf-8")
)
_spec = importlib.util.spec_from_file_location(
    "sync_permissions", DEPLOY / "base/nats/sync_permissions.py"
)
assert _spec is not None and _spec.loader is not None
SYNC = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SYNC)
ACTOR_IDS = [f"actor-{i}" for i in range(SYNC.ACTOR_SLOTS)]
"""The actor StatefulSet's pod names: each pod's actor id and NATS user (``ACTOR_<i>``)."""
USERS: dict[str, Any] = {
    **{
        role.upper().replace("-", "_"): perms
        for role, perms in PERMISSIONS.items()
        if role != "actor"
    },
    **{
        f"ACTOR_{i}": permissions_for(f"actor.{a}", PERMISSIONS, run=ANY_RUN)
        for i, a in enumerate(ACTOR_IDS)
    },
}
"""Every NATS user of the cluster (its variable prefix) and its permissions, as services/bus/auth.py
(what ``leafe run`` and the tests' server use) derives them: the roles, and one pinned user per
actor pod."""
_USER = re.compile(r"\{nkey: \$(\w+)_NKEY, permissions: \$(\w+)\}")
ACCOUNTS: dict[str, Any] = json.loads(
    (DEPLOY / "base/nats/accounts.json").read_text(encoding="utf-8")
)


def _variable(role: str) -> str:
    return role.upper().replace("-", "_")


def _user_accounts(text: str) -> dict[str, str]:
    """User variable prefix -> the account whose ``users`` list it is in."""
    out: dict[str, str] = {}
    account = ""
    for line in text.split("\naccounts {\n", 1)[1].splitlines():
        if m := re.fullmatch(r"  (\w+) \{", line):
            account = m.group(1)
        elif m := _USER.search(line):
            out[m.group(1)] = account
    return out


def _role(user: str) -> str:
    """The role of a user variable prefix (``ACTOR_<i>``: ``actor.actor-<i>``)."""
    if user.startswith("ACTOR_"):
        return f"actor.actor-{user.removeprefix('ACTOR_')}"
    return next(r for r in PERMISSIONS if _variable(r) == user)


def _parse_authorization(text: str) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """``({ROLE_PERMISSIONS variable: permissions}, {ROLE: (nkey variable, permissions
    variable)})``."""
    decoder = json.JSONDecoder()
    variables = {}
    for match in re.finditer(r"^\s*(\w+_PERMISSIONS) = ", text, re.MULTILINE):
        variables[match.group(1)], _ = decoder.raw_decode(text, match.end())
    users = {m.group(1): (f"{m.group(1)}_NKEY", m.group(2)) for m in _USER.finditer(text)}
    return variables, users


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_server_authorization_equals_permissions_json(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """The rendered authorization.conf defines one nkey user per role of permissions.json but the
    actor, and one per actor pod (ACTOR_<i>, its events pinned to actor-<i>), whose public key is a
    variable of its own (<USER>_NKEY), with exactly the permissions services/bus/auth.py gives it;
    no shared actor user and no password user is left; nats.conf includes it."""
    docs = rendered[overlay]
    variables, users = _parse_authorization(
        config_map_value(docs, "nats-config", "authorization.conf")
    )
    text = config_map_value(docs, "nats-config", "authorization.conf")
    assert set(users) == set(USERS) and "password" not in text and "ACTOR" not in users
    for user, perms in USERS.items():
        nkey, permissions = users[user]
        assert (nkey, permissions) == (f"{user}_NKEY", f"{user}_PERMISSIONS")
        assert variables[permissions] == perms, user
    assert [s for s in variables["ACTOR_3_PERMISSIONS"]["publish"]["allow"] if ".events." in s] == [
        "leafe.*.events.*.actor-3"
    ]
    accounts = load_accounts()
    assert _user_accounts(text) == {u: account_of(_role(u), accounts) for u in USERS}
    assert re.search(
        r"^include authorization\.conf$", config_map_value(docs, "nats-config", "nats.conf"), re.M
    )


def test_the_generator_agrees_with_the_committed_authorization_conf() -> None:
    """`sync_permissions.py --check` (what to run after editing permissions.json) finds nothing to
    change."""
    script = DEPLOY / "base/nats/sync_permissions.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_the_generator_pins_actors_to_one_run_as_leafe_run_does(tmp_path: Path) -> None:
    """`sync_permissions.py --run r1 --out FILE` gives each actor pod exactly what
    services/bus/auth.py gives an actor pinned to r1 (its run's events and durable only), and leaves
    the other roles as committed; `--run` without `--out` is refused (the committed file serves any
    run)."""
    script, out = DEPLOY / "base/nats/sync_permissions.py", tmp_path / "authorization.conf"
    proc = subprocess.run(
        [sys.executable, str(script), "--run", "r1", "--out", str(out)], timeout=60
    )
    assert proc.returncode == 0 and out.read_text() == SYNC.render(PERMISSIONS, "r1")
    table = SYNC.users(PERMISSIONS, "r1")
    for i, actor in enumerate(ACTOR_IDS):
        assert table[f"ACTOR_{i}"] == permissions_for(f"actor.{actor}", PERMISSIONS, run="r1")
    assert {k: v for k, v in table.items() if not k.startswith("ACTOR_")} == {
        k: v for k, v in USERS.items() if not k.startswith("ACTOR_")
    }
    assert not nats_allows(
        table["ACTOR_0"], "publish", "$JS.API.CONSUMER.MSG.NEXT.LEAFE_TASKS.actors-r2"
    )
    refused = subprocess.run(
        [sys.executable, str(script), "--run", "r1"], capture_output=True, timeout=60
    )
    assert refused.returncode == 2


def test_the_generator_and_the_embedded_server_link_the_same_accounts() -> None:
    """sync_permissions.py (the cluster) and services/bus/auth.py (``leafe run``, the tests) turn
    accounts.json into the same exports and imports; the streams' account is the only one with
    JetStream and the only exporter, and each export may be imported only by its importers."""
    links = SYNC.links(ACCOUNTS)
    assert links == account_links(load_accounts())
    assert [n for n, link in links.items() if link["jetstream"]] == [STREAMS_ACCOUNT]
    assert [n for n, link in links.items() if link["exports"]] == [STREAMS_ACCOUNT]
    for export in links[STREAMS_ACCOUNT]["exports"]:
        subject = export.get("service") or export["stream"]
        importers = [
            n
            for n, link in links.items()
            for i in link["imports"]
            if (i.get("service") or i["stream"])["subject"] == subject
        ]
        assert export["accounts"] == sorted(importers), export


def _widened(role: str) -> dict[str, Any]:
    """A role's permissions for any run and (the actor) any actor: what its account must serve."""
    return SYNC.pinned(PERMISSIONS[role], "*", ANY_RUN)  # type: ignore[no-any-return]


def test_each_account_imports_exactly_what_its_roles_use() -> None:
    """An account without streams imports (services) every subject its roles may publish, and
    (streams) every subject they may subscribe to outside their inboxes, and nothing else but
    ``$JS.API.INFO`` (which keeps the server's own "JetStream not enabled" responder out) and the
    acks of the durables they pull (answered as responses only, ``allow_responses``). A role that
    could ask for more than its account imports would be refused by nobody but the import; one
    whose account imported more would hold a door its permissions alone keep shut."""
    for name, spec in ACCOUNTS.items():
        if spec["jetstream"]:
            assert spec["imports"] == [] and "actor" not in spec["roles"]
            continue
        publish = {s for r in spec["roles"] for s in _widened(r)["publish"]["allow"]}
        subscribe = {
            s for r in spec["roles"] for s in _widened(r)["subscribe"]["allow"] if "_INBOX" not in s
        }
        pulls = {s.split(".")[5] for s in publish if s.startswith("$JS.API.CONSUMER.MSG.NEXT.")}
        extra = {"$JS.API.INFO"} if any(s.startswith("$JS.API.") for s in publish) else set()
        extra |= {f"$JS.ACK.{stream}.>" for stream in pulls}
        services = {i["service"] for i in spec["imports"] if "service" in i}
        streams = {i["stream"] for i in spec["imports"] if "stream" in i}
        assert services == publish | extra, name
        assert streams == subscribe, name
        streamed = {i["service"] for i in spec["imports"] if i.get("response") == "stream"}
        assert streamed == {s for s in publish if ".MSG.NEXT." in s}, name


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_user_the_manifests_use_is_a_role(rendered: dict[str, Docs], name: str) -> None:
    """LEAFE_NATS_NKEY always names a role's seed file (``<role>.nk``, a role of permissions.json),
    or in the actor pods ``actor.$(POD_NAME).nk``, the pod's own user; no client uses a password;
    dev generates every user's nkey on both sides: the public key in the server's env, and in the
    client Secret the seed of exactly that key (the actors' in leafe-nats-actors, key actor-<i>)."""
    docs = rendered[name]
    for c in containers(docs):
        names = {e["name"]: e.get("value") for e in c.spec.get("env") or []}
        assert not {"LEAFE_NATS_USER", "LEAFE_NATS_PASSWORD_FILE"} & set(names), c.where
        if "LEAFE_NATS_NKEY" in names:
            stem = Path(names["LEAFE_NATS_NKEY"]).name.removesuffix(".nk")
            assert stem in set(PERMISSIONS) - {"actor"} or stem == "actor.$(POD_NAME)", c.where
    if name == "dev":
        import nkeys

        server = {
            k: base64.b64decode(v).decode()
            for k, v in find(docs, "Secret", "nats-auth")["data"].items()
        }
        assert set(server) == {f"{user}_NKEY" for user in USERS}
        actors = find(docs, "Secret", "leafe-nats-actors")["data"]
        assert set(actors) == set(ACTOR_IDS)
        for user in USERS:
            if user.startswith("ACTOR_"):
                seed = base64.b64decode(actors[f"actor-{user.removeprefix('ACTOR_')}"])
            else:
                role = next(r for r in PERMISSIONS if _variable(r) == user)
                seed = base64.b64decode(find(docs, "Secret", f"leafe-nats-{role}")["data"]["seed"])
            public = nkeys.from_seed(bytearray(seed)).public_key.decode()
            assert public == server[f"{user}_NKEY"] and public.startswith("U"), user
    assert set(NATS_ROLES.values()) <= set(PERMISSIONS)


def test_subject_matching_follows_nats_wildcards() -> None:
    """`*` is one token, a final `>` one or more; deny wins over allow."""
    assert subject_matches("leafe.*.events.>", "leafe.r1.events.step")
    assert not subject_matches("leafe.*.events.>", "leafe.r1.events")
    assert not subject_matches("leafe.*.weights", "leafe.r1.weights.x")
    assert subject_matches(
        "$JS.API.CONSUMER.CREATE.LEAFE_TASKS.>",
        "$JS.API.CONSUMER.CREATE.LEAFE_TASKS.actors-r1.leafe.r1.tasks",
    )
    perms = {"publish": {"allow": ["a.>"], "deny": ["a.b"]}}
    assert nats_allows(perms, "publish", "a.c") and not nats_allows(perms, "publish", "a.b")


def _who(action: str, subject: str) -> set[str]:
    """The roles allowed ``action`` on ``subject``; ``actor`` is the user of pod actor-0."""
    table = {**PERMISSIONS, "actor": permissions_for("actor.actor-0", PERMISSIONS, run="r1")}
    return {role for role, perms in table.items() if nats_allows(perms, action, subject)}


@pytest.mark.parametrize(
    ("action", "subject", "roles"),
    [
        ("publish", "leafe.r1.events.step.actor-0", {"actor", "log-import", "admin"}),
        ("publish", "leafe.r1.events.episode_started.actor-0", {"actor", "log-import", "admin"}),
        ("publish", "leafe.r1.events.step.actor-1", {"log-import", "admin"}),
        ("publish", "leafe.r1.events.step", {"log-import", "admin"}),
        ("publish", "leafe.r1.events.step.actor-0.x", {"log-import", "admin"}),
        ("publish", "leafe.r1.tasks", {"admin"}),
        ("publish", "leafe.r1.samples.cf", {"replayer", "admin"}),
        ("publish", "leafe.r1.weights", {"learner", "admin"}),
        ("publish", "leafe.r1.dead.leafe_events.7", {"replayer", "admin"}),
        ("publish", "leafe.r1.dead.leafe_tasks.actor-0.7", {"actor", "admin"}),
        ("publish", "leafe.r1.dead.leafe_tasks.actor-1.7", {"admin"}),
        ("publish", "leafe.r1.dead.leafe_tasks", {"admin"}),
        ("publish", "leafe.r1.dead.leafe_samples.7", {"learner", "admin"}),
        ("publish", "leafe.r1.dead.redriven.7", {"admin"}),
        ("publish", "leafe.r2.events.step.actor-0", {"log-import", "admin"}),
        ("subscribe", "leafe.r1.weights", {"weight-sync", "admin"}),
        ("subscribe", "leafe.r1.samples.cf", {"admin"}),
        ("subscribe", "leafe.r1.events.step", {"admin"}),
        ("subscribe", "_INBOX.abc.1", {"admin"}),
        *(
            ("subscribe", f"_INBOX_{role}.abc.1", {role})
            for role in PERMISSIONS
            if role not in ("admin", "actor")
        ),
        ("subscribe", "_INBOX_actor.actor-0.abc.1", {"actor"}),
        ("subscribe", "_INBOX_actor.actor-1.abc.1", set()),
        ("subscribe", "_INBOX_admin.abc.1", set()),
        ("publish", "$JS.API.STREAM.CREATE.LEAFE_EVENTS", {"admin"}),
        ("publish", "$JS.API.STREAM.UPDATE.LEAFE_TASKS", {"admin"}),
        ("publish", "$JS.API.STREAM.DELETE.LEAFE_WEIGHTS", {"admin"}),
        ("publish", "$JS.API.STREAM.PURGE.LEAFE_SAMPLES", {"admin"}),
        ("publish", "$JS.API.STREAM.MSG.DELETE.LEAFE_EVENTS", {"admin"}),
        ("publish", "$JS.API.CONSUMER.CREATE.LEAFE_TASKS.actors-r1.leafe.r1.tasks", {"admin"}),
        ("publish", "$JS.API.CONSUMER.CREATE.LEAFE_TASKS.actors-r1", {"admin"}),
        ("publish", "$JS.API.CONSUMER.DURABLE.CREATE.LEAFE_TASKS.actors-r1", {"admin"}),
        ("publish", "$JS.API.CONSUMER.CREATE.LEAFE_TASKS", {"admin"}),
        ("publish", "$JS.API.CONSUMER.INFO.LEAFE_TASKS.actors-r1", {"actor", "admin"}),
        ("publish", "$JS.API.CONSUMER.MSG.NEXT.LEAFE_TASKS.actors-r1", {"actor", "admin"}),
        ("publish", "$JS.API.CONSUMER.MSG.NEXT.LEAFE_TASKS.actors-r2", {"admin"}),
        ("publish", "$JS.ACK.LEAFE_TASKS.actors-r1.1.2.3.4.5", {"admin"}),  # actors: responses only
        (
            "publish",
            "$JS.API.CONSUMER.CREATE.LEAFE_EVENTS.replayer-r1-leafe.leafe.r1.events.>",
            {"admin"},
        ),
        ("publish", "$JS.API.CONSUMER.DELETE.LEAFE_EVENTS.leafe-read-x", {"admin"}),
        ("publish", "$JS.API.STREAM.MSG.GET.LEAFE_EVENTS", {"replayer", "admin"}),
        ("publish", "$JS.ACK.LEAFE_EVENTS.replayer-r1-leafe.1.2.3.4.5", {"replayer", "admin"}),
        ("publish", "$JS.API.CONSUMER.DELETE.LEAFE_SAMPLES.learner-r1", {"admin"}),
        (
            "publish",
            "$JS.API.CONSUMER.CREATE.LEAFE_SAMPLES.learner-r1.leafe.r1.samples.>",
            {"admin"},
        ),
        ("publish", "$JS.API.CONSUMER.MSG.NEXT.LEAFE_SAMPLES.learner-r1", {"learner", "admin"}),
        ("publish", "$JS.API.STREAM.MSG.GET.LEAFE_WEIGHTS", {"actor", "weight-sync", "admin"}),
        # a letter's writer reads back only its own letter subjects (dead_letters.store_once)
        (
            "publish",
            "$JS.API.DIRECT.GET.LEAFE_DEAD.leafe.r1.dead.leafe_events.7",
            {"replayer", "admin"},
        ),
        (
            "publish",
            "$JS.API.DIRECT.GET.LEAFE_DEAD.leafe.r1.dead.leafe_samples.7",
            {"learner", "admin"},
        ),
        (
            "publish",
            "$JS.API.DIRECT.GET.LEAFE_DEAD.leafe.r1.dead.leafe_tasks.actor-0.7",
            {"actor", "admin"},
        ),
        ("publish", "$JS.API.DIRECT.GET.LEAFE_DEAD.leafe.r2.dead.leafe_tasks.actor-0.7", {"admin"}),
        ("publish", "$JS.API.DIRECT.GET.LEAFE_DEAD.leafe.r1.dead.leafe_tasks.actor-1.7", {"admin"}),
        ("publish", "$JS.API.DIRECT.GET.LEAFE_DEAD.leafe.r1.dead.redriven.7", {"admin"}),
        ("publish", "$JS.API.DIRECT.GET.LEAFE_EVENTS.leafe.r1.events.step.actor-1", {"admin"}),
        ("publish", "$JS.API.CONSUMER.CREATE.LEAFE_WEIGHTS.x", {"admin"}),
        ("publish", "$JS.FC.LEAFE_EVENTS.abc.def", {"admin"}),  # ordered consumers' flow control
    ],
)
def test_each_role_may_do_exactly_its_part(action: str, subject: str, roles: set[str]) -> None:
    """Who may publish or subscribe where (a run id `r1`; the actor pinned to it): events from
    actors, samples from the replayer, weights from the learner, tasks and stream administration
    from admin only; an actor acks only as a response to a delivery it received
    (``allow_responses``), never by subject."""
    assert _who(action, subject) == roles


def _openssl_certificate(directory: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a test certificate for the TLS config")
    directory.mkdir(parents=True)
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=nats",
            "-keyout",
            str(directory / "tls.key"),
            "-out",
            str(directory / "tls.crt"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    shutil.copy(directory / "tls.crt", directory / "ca.crt")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_config_is_accepted_by_nats_server(
    rendered: dict[str, Docs], overlay: str, tmp_path: Path
) -> None:
    """The rendered nats-config (with its includes, TLS files where gpu reads them, every public
    nkey variable in the environment as nats-auth provides it) passes `nats-server -t`."""
    from leafe.services.bus.nats_server import find_nats_server

    docs = rendered[overlay]
    nats = container_named(docs, "nats", "nats")
    mounts = {m["name"]: m["mountPath"] for m in nats.spec["volumeMounts"]}
    config_dir = tmp_path / mounts["config"].lstrip("/")
    config_dir.mkdir(parents=True)
    tls_dir = tmp_path / mounts["tls"].lstrip("/")
    _openssl_certificate(tls_dir)
    for key, text in find(docs, "ConfigMap", "nats-config")["data"].items():
        (config_dir / key).write_text(text.replace(mounts["tls"], str(tls_dir)), encoding="utf-8")
    secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "nats-auth"]
    if secrets:  # dev generates it; gpu expects it from the operator (deploy/README.md)
        env = {k: base64.b64decode(v).decode() for k, v in secrets[0]["data"].items()}
    else:
        import nkeys

        env = {
            f"{user}_NKEY": nkeys.from_seed(
                bytearray(nkeys.encode_seed(bytes([i]) * 32, nkeys.PREFIX_BYTE_USER))
            ).public_key.decode()
            for i, user in enumerate(USERS)
        }
    proc = subprocess.run(
        [str(find_nats_server()), "-c", str(config_dir / "nats.conf"), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env | {"POD_NAME": "nats-0"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    missing = subprocess.run(
        [str(find_nats_server()), "-c", str(config_dir / "nats.conf"), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"POD_NAME": "nats-0"},
    )
    assert missing.returncode != 0 and "_NKEY" in missing.stdout + missing.stderr
