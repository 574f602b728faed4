"""One actor's credential against the other actors' tasks and another run's, on a real nats-server
whose users are what ``leafe run`` makes: one nkey user per actor, pinned to its run
(``leafe.services.bus.auth.nkey_users(..., run=RUN)``, deploy/base/nats/permissions.json).

An actor acks a task only through the reply subject of a delivery it received (``allow_responses``);
it has no ``$JS.ACK`` subject of its own, so guessing another actor's ack subject (the timestamp in
it was never checked) is refused. It may pull, read and ack only its own run's task durable
(``actors-<run>``), and publish events and dead letters only under its run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from leafe.protocol.subjects import TASKS, actors_durable, event_subject, task_subject
from leafe.services.admin.streams import durables_for_run
from leafe.services.bus import NatsOptions, ensure_durables, ensure_streams
from leafe.services.bus.auth import (
    key_names,
    load_permissions,
    nkey_users,
    role_options,
    write_role_keys,
)
from leafe.services.bus.nats_server import EmbeddedNats
from leafe.services.bus.pull import Puller
from tests.support.nats_auth import RoleClient

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

RUN, OTHER = "hostile-tasks", "other-run"


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NatsOptions]]:
    """A server whose actors ``a0``, ``a1`` are pinned to RUN and ``b0`` to OTHER (two runs, two
    keys sets, one server, as two `leafe run`s sharing a cluster would be); yields every user's
    options."""
    keys = write_role_keys(tmp_path_factory.mktemp("keys"), key_names(["a0", "a1"]))
    other = write_role_keys(tmp_path_factory.mktemp("other-keys"), key_names(["b0"]))
    other = {k: v for k, v in other.items() if k.startswith("actor.")}
    users = [
        *nkey_users(keys, load_permissions(), run=RUN),
        *nkey_users(other, load_permissions(), run=OTHER),
    ]
    store = tmp_path_factory.mktemp("js")
    with EmbeddedNats(store, log_file=store / "nats.log", users=users) as server:
        yield {**role_options(server.url, keys), **role_options(server.url, other)}


@pytest.fixture
async def admin(pinned: dict[str, NatsOptions]) -> AsyncIterator[RoleClient]:
    """The admin, with both runs' streams and durables made and one task queued in each run."""
    async with RoleClient(pinned["admin"]) as client:
        await ensure_streams(client.js)
        for run in (RUN, OTHER):
            await ensure_durables(client.js, durables_for_run(run))
            await client.js.purge_stream(TASKS.name, subject=task_subject(run))
            await client.js.publish(task_subject(run), f"task of {run}".encode())
        yield client


async def _pending(admin: RoleClient, run: str) -> tuple[int, int]:
    info = await admin.js.consumer_info(TASKS.name, actors_durable(run))
    return int(info.num_pending), int(info.num_ack_pending)


async def _take(client: RoleClient, run: str) -> Any:
    puller = Puller(client.js, TASKS.name, actors_durable(run))
    await puller.start()
    [msg] = await puller.pull(1, 5.0)
    await puller.close()
    return msg


async def test_an_actor_cannot_ack_or_terminate_a_task_delivered_to_another(
    pinned: dict[str, NatsOptions], admin: RoleClient
) -> None:
    """a1 holds a task; a0, knowing the exact ack subject of that delivery, publishes an ack and a
    termination on it: both refused, the task stays in flight with a1. a1's own in-progress acks and
    ack (many responses to one delivery) go through, and the task is gone."""
    async with RoleClient(pinned["actor.a1"]) as owner, RoleClient(pinned["actor.a0"]) as thief:
        msg = await _take(owner, RUN)
        assert msg.reply.startswith(f"$JS.ACK.{TASKS.name}.{actors_durable(RUN)}.")
        for verb in (b"+ACK", b"+TERM"):
            await thief.nc.publish(msg.reply, verb)
            assert await thief.violated(msg.reply), thief.violations
            thief.violations.clear()
        assert await _pending(admin, RUN) == (0, 1)
        for _ in range(5):
            await msg.in_progress()
        # A plain ack is applied by the server after its publish is read (CI saw (0, 1) after a
        # flush); the double ack returns once the consumer has applied it.
        await msg.ack_sync(timeout=5.0)
        assert owner.violations == []
    assert await _pending(admin, RUN) == (0, 0)


@pytest.mark.parametrize(
    "subject",
    [
        f"$JS.API.CONSUMER.MSG.NEXT.{TASKS.name}.{actors_durable(OTHER)}",
        f"$JS.API.CONSUMER.INFO.{TASKS.name}.{actors_durable(OTHER)}",
        f"$JS.API.CONSUMER.MSG.NEXT.{TASKS.name}.probe-{RUN}",
        f"$JS.ACK.{TASKS.name}.{actors_durable(OTHER)}.1.1.1.1.0",
        event_subject(OTHER, "step", "a0"),
        f"leafe.{OTHER}.dead.leafe_tasks.a0.1",
    ],
)
async def test_an_actor_reaches_nothing_of_another_run(
    pinned: dict[str, NatsOptions], admin: RoleClient, subject: str
) -> None:
    """a0 (pinned to RUN) may not pull, read or ack OTHER's task durable (or any durable but its
    run's), nor publish events or dead letters into OTHER: the server refuses each, and OTHER's task
    is untouched."""
    async with RoleClient(pinned["actor.a0"]) as a0:
        await a0.nc.publish(subject, b"{}", reply=a0.nc.new_inbox())
        assert await a0.violated(subject), a0.violations
    assert await _pending(admin, OTHER) == (1, 0)


async def test_each_actor_serves_its_own_run(
    pinned: dict[str, NatsOptions], admin: RoleClient
) -> None:
    """The same users do their own work unrefused: b0 reads and pulls OTHER's durable and acks its
    task, and publishes an event of its run (so the refusals above are the pinning, not a broken
    user)."""
    async with RoleClient(pinned["actor.b0"]) as b0:
        await b0.js.consumer_info(TASKS.name, actors_durable(OTHER))
        msg = await _take(b0, OTHER)
        await msg.ack_sync(timeout=5.0)
        ack = await b0.js.publish(event_subject(OTHER, "step", "b0"), b"an event")
        assert ack.stream == "LEAFE_EVENTS"
        with pytest.raises(NatsTimeoutError):  # a refused request is never answered
            await b0.probe.consumer_info(TASKS.name, actors_durable(RUN))
        assert b0.violations and all(actors_durable(RUN) in v for v in b0.violations)
    assert await _pending(admin, OTHER) == (0, 0)


def test_a_pinned_actor_user_names_its_run_and_has_no_ack_subject(tmp_path: Path) -> None:
    """What `leafe run` gives each actor (its run id as `run`): subjects of that run, no `$JS.ACK`
    grant."""
    keys = write_role_keys(tmp_path, key_names([f"{RUN}-actor-0"]))
    users = dict(zip(keys, nkey_users(keys, load_permissions(), run=RUN), strict=True))
    actor = users[f"actor.{RUN}-actor-0"]
    allow = actor.permissions["publish"]["allow"]
    assert f"leafe.{RUN}.events.*.{RUN}-actor-0" in allow
    assert f"$JS.API.CONSUMER.MSG.NEXT.{TASKS.name}.{actors_durable(RUN)}" in allow
    assert not [s for s in allow if s.startswith("$JS.ACK")]
