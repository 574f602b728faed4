"""A 3-node nats-server cluster with R3 streams: SIGKILL the leader of LEAFE_EVENTS while a
Publisher streams events, restart it. Acked events survive, the rest are reported and republished,
nothing is stored twice, and the restarted replica catches up. The time from the kill to the next
acked event is printed (the figure, not an assertion: speed belongs in bench/)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
import pytest

from leafe.protocol.codec import MSG_ID_HEADER
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import EVENTS, STREAMS, event_subject
from leafe.services.bus import Publisher, PublishError, connect, ensure_streams, read_stream
from leafe.services.bus.nats_cluster import NatsCluster
from leafe.services.bus.pull import ConsumerError
from tests.support.cluster import replicas_current, stream_leader
from tests.support.strategies import make_episode

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

RUN = "cluster"
N_EPISODES = 200  # 15 events each: 3000 events of ~1 KB


async def _publish_all(
    pub: Publisher, events: list[EpisodeEvent], reported: dict[str, str]
) -> None:
    """Publish every event, collecting whatever the publisher reports instead of stopping at the
    first."""
    for event in events:
        try:
            await pub.publish_event(event)
        except PublishError as e:
            reported.update(e.reasons)
            await asyncio.sleep(0.01)  # the connection is down: don't spin
    try:
        await pub.flush()
    except PublishError as e:
        reported.update(e.reasons)


async def _first_ack_after(js: object, killed_at: float) -> float:
    """Publish one probe event at a time until JetStream acks one; seconds from the kill to that
    ack."""
    n = 0
    while True:
        n += 1
        try:
            await js.publish(  # type: ignore[attr-defined]
                event_subject(RUN, "probe", "a0"),
                b"probe",
                headers={MSG_ID_HEADER: f"{RUN}.probe.{n}"},
                timeout=0.5,
            )
            return time.monotonic() - killed_at
        except Exception:  # no leader yet, or reconnecting: try again
            await asyncio.sleep(0.02)


async def _stored_ids(url: str, deadline_s: float = 60.0) -> list[str]:
    """Every stored event id. Right after a node's restart the cluster may not yet answer the read's
    consumer create within the client's timeout (seen: nats: timeout in make test), or the new
    consumer may deliver nothing for 10 s (seen: ConsumerError "after 0 of 2801 messages"), so the
    whole read is retried; the stored data is what the test judges, not how fast the first read
    is."""
    deadline = time.monotonic() + deadline_s
    while True:
        nc = await connect(url)
        try:
            msgs = [
                m
                async for m in read_stream(
                    nc.jetstream(), stream=EVENTS.name, filter_subject=f"leafe.{RUN}.>"
                )
            ]
            return [
                (m.headers or {})[MSG_ID_HEADER] for m in msgs if m.subject.split(".")[3] != "probe"
            ]
        except (TimeoutError, nats.errors.TimeoutError, ConsumerError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
        finally:
            await nc.close()


async def test_leader_sigkill_loses_and_duplicates_nothing(
    nats_cluster: NatsCluster, replicated: int
) -> None:
    """SIGKILL of the LEAFE_EVENTS leader mid-publish: a new leader takes over, every event not
    reported unacked is stored once, republishing the reported ones completes the log, and the
    restarted node is a current replica again."""
    events = [e for i in range(N_EPISODES) for e in make_episode(RUN, f"ep{i:04d}", obs_chars=900)]
    ids = [e.event_id for e in events]
    reported: dict[str, str] = {}
    nc = await connect(nats_cluster.url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, replicas=replicated)
        info = await js.stream_info(EVENTS.name)
        assert info.config.num_replicas == replicated == 3
        victim = nats_cluster.index_of(await stream_leader(js, EVENTS.name))
        ours = (
            "the node this client is connected to"
            if nc.connected_url and nc.connected_url.port == nats_cluster.nodes[victim].port
            else "another node than this client's"
        )
        pub = Publisher(js, max_pending=256, ack_timeout_s=3.0)
        task = asyncio.create_task(_publish_all(pub, events, reported))
        while pub.acked < 500 and not task.done():  # noqa: ASYNC110 (polling a counter the publisher owns)
            await asyncio.sleep(0.005)
        nats_cluster.kill(victim)
        killed_at = time.monotonic()
        published_at_kill = pub.published
        recovery_s = await asyncio.wait_for(_first_ack_after(js, killed_at), 60)
        new_leader = await stream_leader(js, EVENTS.name)
        nats_cluster.restart(victim)
        catch_up_s = await asyncio.to_thread(nats_cluster.wait_healthy, victim, 60.0)
        await asyncio.wait_for(task, 120)
        print(
            f"\nleader n{victim} ({ours}) killed after {published_at_kill} publishes: next acked "
            "event after "
            f"{recovery_s:.2f}s (new leader {new_leader}); restarted node healthy after "
            f"{catch_up_s:.2f}s; "
            f"{len(reported)} events reported unacked"
        )
        assert published_at_kill < len(events), (
            "the kill came after the last publish; nothing was tested"
        )
        assert new_leader != f"n{victim}"
        assert pub.acked + len(reported) == len(ids), (
            "every publish ends acked or reported, exactly once"
        )
        async with Publisher(js) as again:  # what was reported may or may not be stored: republish
            for event in events:
                if event.event_id in reported:
                    await again.publish_event(event)
        deadline = time.monotonic() + 30
        while not await replicas_current(js, EVENTS.name):
            assert time.monotonic() < deadline, "the restarted replica never caught up"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
    stored = await _stored_ids(nats_cluster.url)
    assert len(stored) == len(set(stored)), "an event was stored twice"
    assert sorted(stored) == sorted(ids)


async def test_streams_are_replicated_on_three_nodes(nats_cluster: NatsCluster) -> None:
    """``ensure_streams`` with R3 specs places every LEAFE stream on all three nodes, and an R1
    stream of the same name is scaled up to R3 in place."""
    nc = await connect(nats_cluster.url)
    try:
        js = nc.jetstream()
        await ensure_streams(js)  # R1, as a single-server run creates them
        await ensure_streams(js, [msgspec.structs.replace(s, replicas=3) for s in STREAMS])
        for spec in STREAMS:
            info = await js.stream_info(spec.name)
            assert info.config.num_replicas == 3, spec.name
            deadline = time.monotonic() + 30  # scaling up places the new replicas asynchronously
            while not await replicas_current(js, spec.name):
                assert time.monotonic() < deadline, f"{spec.name} never got 3 current replicas"
                await asyncio.sleep(0.1)
            info = await js.stream_info(spec.name)
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, spec.name
    finally:
        await nc.close()
    for i in range(3):
        assert nats_cluster.jsz(i)["streams"] == len(STREAMS), f"n{i} does not hold every stream"


def test_cluster_url_lists_every_node(tmp_path: Path) -> None:
    """The cluster URL names each node's client port once, and names are unique (JetStream
    placement)."""
    cluster = NatsCluster(tmp_path, size=3)
    urls = cluster.url.split(",")
    assert len(set(urls)) == 3 and all(u.startswith("nats://127.0.0.1:") for u in urls)
    assert [n.server_name for n in cluster.nodes] == ["n0", "n1", "n2"]
    assert cluster.index_of("n2") == 2
    with pytest.raises(KeyError, match="n7"):
        cluster.index_of("n7")


def test_a_route_port_taken_before_its_node_binds_restarts_the_cluster_on_new_ports(
    tmp_path: Path,
) -> None:
    """A port that was free when picked but taken by the time its node binds (seen in make test)
    makes the cluster start again on fresh ports instead of failing the test that needed it."""
    import socket

    cluster = NatsCluster(tmp_path / "nats", size=3)
    taken = cluster.nodes[2].cluster.port  # type: ignore[union-attr]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert all(node.cluster.port != taken for node in cluster.nodes)  # type: ignore[union-attr]
            assert all(cluster.health(i)[0] for i in range(3))
