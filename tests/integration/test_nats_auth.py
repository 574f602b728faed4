"""NATS least privilege on a real nats-server running deploy/base/nats/permissions.json (the session
server of tests/conftest.py: every role an nkey user of its own).

Nobody gets in without a known identity; each role is refused every subject it must not touch (the
server reports a permissions violation naming the subject, and nothing happens: no message stored,
no stream or consumer created, changed or deleted); the admin may do all of it (so the probes would
notice a permitted action). That each service's real code does its whole job under its own role is
test_nats_roles.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.errors import NoServersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError

from leafe.protocol.codec import encode, headers_for
from leafe.protocol.subjects import EVENTS, SAMPLES, TASKS, WEIGHTS, event_subject
from leafe.services.actor import service as actor_service
from leafe.services.admin.streams import durables_for_run
from leafe.services.bus import (
    NatsOptions,
    Publisher,
    connect,
    ensure_durables,
    ensure_streams,
    wait_for_streams,
)
from leafe.services.bus.auth import (
    STREAMS_ACCOUNT,
    load_permissions,
    nkey_users,
    role_options,
    write_role_keys,
)
from leafe.services.bus.durables import DurableSpec, consumer_config
from leafe.services.bus.nats_server import EmbeddedNats, NatsServerError
from leafe.services.bus.pull import Puller
from leafe.services.learner import service as learner_service
from leafe.services.replayer import service as replayer_service
from leafe.services.weight_sync import service as weight_sync_service
from tests.support.nats_auth import RoleClient, stored
from tests.support.strategies import make_episode

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

SERVICES = ("actor", "replayer", "learner", "weight-sync")


@pytest.fixture
async def scratch(admin_client: RoleClient, run_id: str) -> AsyncIterator[str]:
    """A stream of this test's own (one message in it) to try administering: never a LEAFE
    stream."""
    name = f"T_{run_id.replace('-', '_')}"[:60]
    await admin_client.js.add_stream(
        StreamConfig(name=name, subjects=[f"leafe.{run_id}.scratch.>"])
    )
    await admin_client.js.publish(f"leafe.{run_id}.scratch.a", b"keep me")
    yield name
    await admin_client.js.delete_stream(name)


async def consumer_exists(js: Any, stream: str, name: str) -> bool:
    try:
        await js.consumer_info(stream, name)
    except NotFoundError:
        return False
    return True


def _probe_consumer(stream: str, run_id: str) -> tuple[ConsumerConfig, str]:
    name = f"probe-{run_id}"[:60]
    config = ConsumerConfig(name=name, durable_name=name, ack_policy=AckPolicy.EXPLICIT)
    return config, name


async def attempt(c: RoleClient, kind: str, target: str, run_id: str) -> str:
    """Try ``kind`` on ``target`` as ``c``; returns the subject the server must refuse."""
    if kind == "publish":
        await c.nc.publish(target, b"x")
        return target
    if kind == "subscribe":
        await c.nc.subscribe(target)
        return target
    calls: dict[str, tuple[str, Callable[[], Awaitable[Any]]]] = {
        "create-stream": (
            f"$JS.API.STREAM.CREATE.{target}",
            lambda: c.probe.add_stream(StreamConfig(name=target, subjects=[f"leafe.{run_id}.u"])),
        ),
        "update-stream": (
            f"$JS.API.STREAM.UPDATE.{target}",
            lambda: c.probe.update_stream(
                StreamConfig(name=target, subjects=[f"leafe.{run_id}.scratch.>", "more"])
            ),
        ),
        "delete-stream": (f"$JS.API.STREAM.DELETE.{target}", lambda: c.probe.delete_stream(target)),
        "purge-stream": (f"$JS.API.STREAM.PURGE.{target}", lambda: c.probe.purge_stream(target)),
        "create-consumer": (
            f"$JS.API.CONSUMER.CREATE.{target}.{_probe_consumer(target, run_id)[1]}",
            lambda: c.probe.add_consumer(target, _probe_consumer(target, run_id)[0]),
        ),
        "get-msg": (f"$JS.API.STREAM.MSG.GET.{target}", lambda: c.probe.get_msg(target, seq=1)),
    }
    subject, call = calls[kind]
    with pytest.raises(NatsTimeoutError):  # a refused request is never answered
        await call()
    return subject


async def no_effect(admin_client: RoleClient, kind: str, target: str, run_id: str) -> None:
    """What the refused attempt would have done, checked as the admin: it did not happen."""
    if kind == "publish":
        assert await stored(admin_client.js, target) == 0, target
    elif kind == "create-stream":
        with pytest.raises(NotFoundError):
            await admin_client.js.stream_info(target)
    elif kind in ("update-stream", "delete-stream", "purge-stream"):
        info = await admin_client.js.stream_info(target)
        assert (info.config.subjects, info.state.messages) == ([f"leafe.{run_id}.scratch.>"], 1), (
            info
        )
    elif kind == "create-consumer":
        assert not await consumer_exists(
            admin_client.js, target, _probe_consumer(target, run_id)[1]
        )


async def test_clients_without_a_known_identity_are_refused(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """No anonymous access: a bare URL and a seed the server does not know are both refused."""
    stranger = write_role_keys(tmp_path, ["stranger"])["stranger"]
    for opts in (
        NatsOptions(url=nats_server.url),
        NatsOptions(url=nats_server.url, nkey=stranger.seed_file),
    ):
        errors: list[str] = []

        async def seen(e: Exception, errors: list[str] = errors) -> None:
            errors.append(str(e))

        with pytest.raises((NoServersError, ConnectionError)):
            await connect(opts, connect_attempts=1, error_cb=seen)
        assert any("authorization violation" in e.lower() for e in errors), (opts, errors)


ADMINISTRATION = [
    (role, kind, "U_{run}" if kind == "create-stream" else "scratch")
    for role in SERVICES
    for kind in ("create-stream", "update-stream", "delete-stream", "purge-stream")
]
DENIED = [
    ("actor", "publish", "leafe.{run}.weights"),
    ("actor", "publish", "leafe.{run}.samples.cf"),
    ("actor", "publish", "leafe.{run}.tasks"),
    ("actor", "publish", "leafe.{run}.dead.leafe_events"),
    ("actor", "subscribe", "leafe.{run}.events.>"),
    ("actor", "subscribe", "leafe.{run}.samples.>"),
    ("actor", "create-consumer", EVENTS.name),
    ("actor", "create-consumer", SAMPLES.name),
    ("replayer", "publish", "leafe.{run}.weights"),
    ("replayer", "publish", "leafe.{run}.events.step"),
    ("replayer", "publish", "leafe.{run}.tasks"),
    ("replayer", "subscribe", "leafe.{run}.weights"),
    ("replayer", "create-consumer", TASKS.name),
    ("replayer", "create-consumer", SAMPLES.name),
    ("learner", "publish", "leafe.{run}.events.step"),
    ("learner", "publish", "leafe.{run}.samples.cf"),
    ("learner", "publish", "leafe.{run}.tasks"),
    ("learner", "create-consumer", EVENTS.name),
    ("weight-sync", "publish", "leafe.{run}.weights"),
    ("weight-sync", "publish", "leafe.{run}.events.step"),
    ("weight-sync", "publish", "leafe.{run}.samples.cf"),
    ("weight-sync", "publish", "leafe.{run}.tasks"),
    ("weight-sync", "publish", "leafe.{run}.dead.leafe_tasks"),
    ("weight-sync", "create-consumer", WEIGHTS.name),
    ("weight-sync", "get-msg", EVENTS.name),
    # an actor (`actor` is actor-0's own user) publishes events on its own subject token only
    ("actor", "publish", "leafe.{run}.events.step.actor-1"),
    ("actor", "publish", "leafe.{run}.events.episode_started.forged-9"),
    ("actor", "publish", "leafe.{run}.events.step"),
    ("actor", "publish", "leafe.{run}.events.step.actor-0.x"),
    # inboxes: pull deliveries and JetStream API replies; each role (each actor) reads only its own
    # prefix
    ("actor", "subscribe", "_INBOX_actor.actor-1.>"),
    ("actor", "subscribe", "_INBOX_actor.>"),
    ("actor", "subscribe", "_INBOX_learner.>"),
    ("actor", "subscribe", "_INBOX.>"),
    ("actor", "subscribe", ">"),
    ("replayer", "subscribe", "_INBOX_actor.>"),
    ("learner", "subscribe", "_INBOX_replayer.*.*"),
    ("weight-sync", "subscribe", "_INBOX_learner.>"),
    ("log-import", "subscribe", "_INBOX_actor.>"),
    ("log-import", "subscribe", "_INBOX.>"),
    *ADMINISTRATION,
]


def _target(template: str, run_id: str, scratch: str) -> str:
    return scratch if template == "scratch" else template.format(run=run_id)


@pytest.mark.parametrize(("role", "kind", "template"), DENIED)
async def test_each_role_is_refused_what_it_must_not_touch(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    scratch: str,
    run_id: str,
    role: str,
    kind: str,
    template: str,
) -> None:
    """Only the learner publishes weights, only the actor events, only the replayer samples, only
    the admin tasks; no service creates, updates, deletes or purges a stream or reads another role's
    stream: the server reports the violation naming the subject, and the attempt leaves no trace."""
    target = _target(template, run_id, scratch)
    async with RoleClient(nats_roles[role]) as client:
        subject = await attempt(client, kind, target, run_id)
        assert await client.violated(subject), (role, kind, subject, client.violations)
    await no_effect(admin_client, kind, target, run_id)


@pytest.mark.parametrize(
    ("kind", "template"),
    [
        ("publish", "leafe.{run}.tasks"),
        ("create-consumer", EVENTS.name),
        ("create-stream", "U_{run}"),
        ("purge-stream", "scratch"),
    ],
)
async def test_the_admin_may_do_what_the_services_may_not(
    admin_client: RoleClient, scratch: str, run_id: str, kind: str, template: str
) -> None:
    """The same probes as the admin take effect without a violation (so a refusal above is the
    server's permissions at work, not a probe that could never succeed)."""
    target = _target(template, run_id, scratch)
    if kind == "publish":
        await admin_client.js.publish(target, b"x")
        assert await stored(admin_client.js, target) == 1
    elif kind == "create-consumer":
        config, name = _probe_consumer(target, run_id)
        await admin_client.js.add_consumer(target, config)
        assert await consumer_exists(admin_client.js, target, name)
        await admin_client.js.delete_consumer(target, name)
    elif kind == "create-stream":
        await admin_client.js.add_stream(StreamConfig(name=target, subjects=[f"leafe.{run_id}.u"]))
        assert (await admin_client.js.stream_info(target)).config.name == target
        await admin_client.js.delete_stream(target)
    else:
        await admin_client.js.purge_stream(target)
        assert (await admin_client.js.stream_info(target)).state.messages == 0
    assert admin_client.violations == []


@pytest.mark.parametrize(
    ("role", "module"),
    [
        ("actor", actor_service),
        ("replayer", replayer_service),
        ("learner", learner_service),
        ("weight-sync", weight_sync_service),
    ],
)
async def test_each_service_may_read_the_streams_it_waits_for(
    nats_roles: dict[str, NatsOptions], role: str, module: Any
) -> None:
    """A service's start-up check of its streams (``STREAMS_USED``) is within its role's rights."""
    async with RoleClient(nats_roles[role]) as client:
        await wait_for_streams(client.js, module.STREAMS_USED, timeout_s=5.0)
        assert client.violations == []


async def test_each_role_pulls_and_asks_jetstream_through_its_own_inbox(
    nats_roles: dict[str, NatsOptions], admin_client: RoleClient, run_id: str
) -> None:
    """Every service role's client makes its inboxes under ``_INBOX_<role>``, where its JetStream
    API replies and pull deliveries arrive: the learner pulls a message through it, while the actor,
    listening on the learner's prefix, is refused and sees nothing (it once read the learner's
    pulled samples on ``_INBOX.>``)."""
    for role, opts in nats_roles.items():
        want = {"admin": b"_INBOX", "actor": b"_INBOX_actor.actor-0"}.get(
            role, f"_INBOX_{role}".encode()
        )
        async with RoleClient(opts) as client:
            assert bytes(client.nc._inbox_prefix) == want and client.nc.new_inbox().startswith(
                want.decode()
            )
            if role != "log-import":  # it may ask the JetStream API nothing at all
                await client.js.stream_info(WEIGHTS.name if role != "replayer" else EVENTS.name)
            assert client.violations == [], role
    durable = f"inbox-{run_id}"[:60]
    subject = f"leafe.{run_id}.samples.cf"
    await admin_client.js.add_consumer(
        SAMPLES.name,
        ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, filter_subject=subject),
    )
    await admin_client.js.publish(subject, b"a learner's sample")
    try:
        async with (
            RoleClient(nats_roles["actor"]) as spy,
            RoleClient(nats_roles["learner"]) as learner,
        ):
            seen: list[bytes] = []

            async def snoop(msg: Any) -> None:
                seen.append(msg.data)

            await spy.nc.subscribe("_INBOX_learner.>", cb=snoop)
            assert await spy.violated("_INBOX_learner.>")
            puller = Puller(learner.js, SAMPLES.name, durable)
            await puller.start()
            [msg] = await puller.pull(1, 2.0)
            assert msg.data == b"a learner's sample" and msg.subject == subject
            await msg.ack()
            await puller.close()
            await spy.nc.flush()
            assert seen == [] and learner.violations == []
    finally:
        await admin_client.js.delete_consumer(SAMPLES.name, durable)


async def test_each_actor_publishes_events_only_under_its_own_id(
    nats_roles: dict[str, NatsOptions], admin_client: RoleClient, run_id: str
) -> None:
    """Two actors, each with its own nkey user (``actor.<id>``, as ``leafe run`` makes them): each
    one's events are stored on its own subject token; actor-0 publishing actor-1's event (the
    Publisher puts it on actor-1's token) or a made-up token is refused by the server, and nothing
    is stored, so the token the replayer caps open episodes by is one no actor can forge."""
    theirs = msgspec.structs.replace(make_episode(run_id, f"{run_id}-b")[0], actor_id="actor-1")
    mine = make_episode(run_id, f"{run_id}-a")[0]
    assert mine.actor_id == "actor-0"
    async with (
        RoleClient(nats_roles["actor.actor-0"]) as a,
        RoleClient(nats_roles["actor.actor-1"]) as b,
    ):
        for client, event in ((a, mine), (b, theirs)):
            async with Publisher(client.js) as pub:
                await pub.publish_event(event)
            assert (
                await stored(
                    admin_client.js, event_subject(run_id, "episode_started", event.actor_id)
                )
                == 1
            )
        forged = make_episode(run_id, f"{run_id}-f")[0]
        for token in ("actor-1", "mallory"):
            subject = event_subject(run_id, "episode_started", token)
            await a.nc.publish(
                subject,
                encode(msgspec.structs.replace(forged, actor_id=token)),
                headers=headers_for(forged),
            )
            assert await a.violated(subject), (token, a.violations)
        assert b.violations == []
    assert await stored(admin_client.js, event_subject(run_id, "episode_started", "actor-1")) == 1
    assert await stored(admin_client.js, event_subject(run_id, "episode_started", "mallory")) == 0


def _changed(spec: DurableSpec, change: str) -> tuple[ConsumerConfig, str]:
    """A create request that would rewrite ``spec``'s durable, and the API subject nats-py sends it
    on."""
    config = consumer_config(spec)
    if change == "max_deliver 1":
        config.max_deliver = 1
        return config, f"$JS.API.CONSUMER.CREATE.{spec.stream}.{spec.name}.{spec.filter_subject}"
    if change == "no filter":
        config.filter_subject = None
        return config, f"$JS.API.CONSUMER.CREATE.{spec.stream}.{spec.name}"
    config.name = None  # the legacy durable API
    config.ack_wait = 1.0
    return config, f"$JS.API.CONSUMER.DURABLE.CREATE.{spec.stream}.{spec.name}"


@pytest.mark.parametrize(
    ("role", "which", "change"),
    [
        ("actor", 0, "max_deliver 1"),
        ("actor", 0, "no filter"),
        ("actor", 0, "legacy ack_wait 1"),
        ("replayer", 1, "max_deliver 1"),
        ("replayer", 1, "delete"),
        ("learner", 2, "no filter"),
        ("learner", 2, "delete"),
        ("replayer", 0, "delete"),
    ],
)
async def test_no_service_may_change_or_delete_a_durable(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    role: str,
    which: int,
    change: str,
) -> None:
    """The run's durables are the admin's (`leafe streams ensure --run`): an actor once set the
    shared task durable's filter to nothing (the run starves) or max_deliver to 1 (tasks lost), and
    the replayer could delete any run's durable. Now each attempt is refused and the durable stays
    exactly as made."""
    specs = durables_for_run(run_id)
    await ensure_durables(admin_client.js, specs)
    spec = specs[which]
    before = (await admin_client.js.consumer_info(spec.stream, spec.name)).config
    async with RoleClient(nats_roles[role]) as client:
        if change == "delete":
            subject = f"$JS.API.CONSUMER.DELETE.{spec.stream}.{spec.name}"
            with pytest.raises(NatsTimeoutError):
                await client.probe.delete_consumer(spec.stream, spec.name)
        else:
            config, subject = _changed(spec, change)
            with pytest.raises(NatsTimeoutError):
                await client.probe.add_consumer(spec.stream, config)
        assert await client.violated(subject), (role, change, client.violations)
    after = (await admin_client.js.consumer_info(spec.stream, spec.name)).config
    assert (
        (after.filter_subject, after.max_deliver, after.ack_wait)
        == (
            before.filter_subject,
            before.max_deliver,
            before.ack_wait,
        )
        == (spec.filter_subject, -1, spec.ack_wait_s)
    )


async def test_a_store_made_before_accounts_keeps_its_streams(tmp_path: Path) -> None:
    """A run's store written by a server without accounts (its streams in the global account
    ``$G``, as every ``leafe run`` made them before) is adopted by the streams' account on the next
    start: the resumed run finds its streams, messages and durables. A store that has both is
    refused naming the directories, never silently half-used."""
    store = tmp_path / "nats"
    with EmbeddedNats(store) as old:
        nc = await connect(old.url)
        await ensure_streams(nc.jetstream())
        await nc.jetstream().publish("leafe.r1.tasks", b"task")
        await nc.close()
    keys = write_role_keys(tmp_path / "keys")
    users = nkey_users(keys, load_permissions(), run="r1")
    with EmbeddedNats(store, users=users) as new:
        nc = await connect(role_options(new.url, keys)["admin"])
        assert (await nc.jetstream().stream_info(TASKS.name)).state.messages == 1
        await nc.close()
    assert not (store / "jetstream" / "$G").exists()
    assert (store / "jetstream" / STREAMS_ACCOUNT).is_dir()
    (store / "jetstream" / "$G").mkdir()
    with pytest.raises(NatsServerError, match=r"\$G holds streams"):
        EmbeddedNats(store, users=users).start()
