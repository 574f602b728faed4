"""The bus on a real nats-server: streams, acked publishes, dedupe, durable consumers, dead
letters."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client

from leafe.protocol.codec import CODEC_HEADER, MSG_ID_HEADER, decode_event, encode
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import STREAMS, StreamSpec, dead_letter_subject, event_subject
from leafe.services.bus import (
    ERROR_HEADER,
    Consumer,
    ConsumerError,
    Delivery,
    NatsOptions,
    Publisher,
    PublishError,
    StreamMismatchError,
    connect,
    ensure_streams,
    read_stream,
)
from leafe.services.bus.dead_letters import letters_filter
from tests.support.acks import settled_counts
from tests.support.strategies import make_episode

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A connection to the session server with the LEAFE streams in place."""
    client = await connect(nats_url)
    await ensure_streams(client.jetstream())
    yield client
    await client.close()


def events_consumer(
    nc: Client, run_id: str, durable: str = "", **kw: object
) -> Consumer[EpisodeEvent]:
    """A consumer of the run's events; the durable defaults to the run id (one per test)."""
    return Consumer(
        nc.jetstream(),
        stream="LEAFE_EVENTS",
        durable=durable or run_id,
        filter_subject=f"leafe.{run_id}.events.>",
        decode=decode_event,
        dead_letter_subject=dead_letter_subject(run_id, "LEAFE_EVENTS"),
        **kw,  # type: ignore[arg-type]
    )


async def stored(nc: Client, stream: str, subject: str) -> list:
    return [m async for m in read_stream(nc.jetstream(), stream=stream, filter_subject=subject)]


async def test_ensure_streams_is_idempotent_and_applies_the_specs(nc: Client) -> None:
    """Creating the streams twice changes nothing; each stream has its spec's retention and dedupe
    window."""
    js = nc.jetstream()
    await ensure_streams(js)
    for spec in STREAMS:
        info = await js.stream_info(spec.name)
        assert info.config.subjects == spec.subjects
        assert info.config.retention == spec.retention
        assert info.config.storage == spec.storage
        assert info.config.duplicate_window == pytest.approx(spec.duplicate_window_s)


async def test_ensure_streams_updates_compatible_and_refuses_incompatible_changes(
    nc: Client, run_id: str
) -> None:
    """A changed max_age/subjects is applied in place; a storage change is refused naming the
    stream."""
    js = nc.jetstream()
    name = f"T_{run_id.replace('-', '_')}"[:60]
    spec = StreamSpec(name=name, subjects=[f"t.{run_id}.a"], duplicate_window_s=60.0)
    await ensure_streams(js, [spec])
    wider = StreamSpec(name=name, subjects=[f"t.{run_id}.a", f"t.{run_id}.b"], max_age_s=3600.0)
    await ensure_streams(js, [wider])
    info = await js.stream_info(name)
    assert sorted(info.config.subjects or []) == sorted(wider.subjects)
    assert info.config.max_age == pytest.approx(3600.0)
    assert info.config.duplicate_window == pytest.approx(
        3600.0
    )  # the default day, capped by max_age
    with pytest.raises(StreamMismatchError, match=rf"{name}.*storage"):
        await ensure_streams(js, [StreamSpec(name=name, subjects=wider.subjects, storage="memory")])
    await js.delete_stream(name)


async def test_10k_events_are_consumed_as_published_in_order_per_subject(
    nc: Client, run_id: str
) -> None:
    """10k events from one publisher come back from a durable consumer identical and in order per
    subject."""
    js = nc.jetstream()
    events = [e for i in range(800) for e in make_episode(run_id, f"{run_id}-ep{i:04d}")][:10_000]
    assert len(events) == 10_000
    async with Publisher(js, max_pending=512) as pub:
        for event in events:
            await pub.publish_event(event)
    assert pub.acked == 10_000 and pub.duplicates == 0 and pub.pending == 0

    got: list[Delivery[EpisodeEvent]] = []

    async def handler(delivery: Delivery[EpisodeEvent]) -> None:
        got.append(delivery)

    async with events_consumer(nc, run_id, batch=500) as consumer:
        assert await consumer.consume(handler, limit=10_000) == 10_000
        assert await consumer.fetch(timeout=0.2) == []
    assert [d.value for d in got] == events
    by_subject: dict[str, list[EpisodeEvent]] = defaultdict(list)
    for event in events:
        by_subject[
            event_subject(run_id, str(type(event).__struct_config__.tag), event.actor_id)
        ].append(event)
    assert {s: [d.value for d in got if d.subject == s] for s in by_subject} == by_subject
    assert [d.stream_seq for d in got] == sorted(d.stream_seq for d in got)
    assert await settled_counts(js, "LEAFE_EVENTS", run_id) == (0, 0)
    assert (await js.consumer_info("LEAFE_EVENTS", run_id)).num_redelivered == 0


async def test_publishing_the_same_event_twice_stores_it_once(nc: Client, run_id: str) -> None:
    """A retried publish (same Nats-Msg-Id), even from another publisher later, is stored exactly
    once."""
    js = nc.jetstream()
    event = make_episode(run_id, f"{run_id}-ep")[1]
    async with Publisher(js) as first:
        await first.publish_event(event)
        await first.publish_event(event)
    async with Publisher(js) as second:
        await second.publish_event(event)
    msgs = await stored(nc, "LEAFE_EVENTS", f"leafe.{run_id}.events.>")
    assert len(msgs) == 1
    assert msgs[0].headers[MSG_ID_HEADER] == event.event_id and msgs[0].headers[CODEC_HEADER] == "1"
    assert decode_event(msgs[0].data) == event
    assert (first.acked, first.duplicates, second.duplicates) == (2, 1, 1)


async def test_unacked_publishes_are_reported_never_hidden(nc: Client, run_id: str) -> None:
    """A publish no stream accepts is listed by id in the PublishError that flush raises."""
    js = nc.jetstream()
    event = make_episode(run_id, f"{run_id}-ep")[1]
    pub = Publisher(js, ack_timeout_s=5.0)
    await pub.publish_event(event)
    await pub.publish_raw(f"nowhere.{run_id}", b"x", {MSG_ID_HEADER: "orphan-1"})
    with pytest.raises(PublishError, match="orphan-1") as info:
        await pub.flush()
    assert info.value.unacked == ["orphan-1"]
    assert "orphan-1" in info.value.reasons
    assert pub.acked == 1
    assert await pub.flush() == 0  # reported once, then forgotten
    with pytest.raises(ValueError, match=MSG_ID_HEADER):
        await pub.publish_raw(f"nowhere.{run_id}", b"x", {})


async def test_malformed_payloads_are_dead_lettered_with_the_reason(
    nc: Client, run_id: str
) -> None:
    """Undecodable messages go to the dead-letter subject with Leafe-Error + origin headers, and are
    acked."""
    js = nc.jetstream()
    good = make_episode(run_id, f"{run_id}-ep")[1]
    subject = event_subject(run_id, "step", good.actor_id)
    async with Publisher(js) as pub:
        await pub.publish_raw(subject, b"\xc1garbage", {MSG_ID_HEADER: "bad-1", CODEC_HEADER: "1"})
        await pub.publish_raw(subject, encode(good), {MSG_ID_HEADER: "bad-2", CODEC_HEADER: "99"})
        await pub.publish_event(good)
    async with events_consumer(nc, run_id) as consumer:
        deliveries = await consumer.fetch(timeout=2.0)
        assert [d.value for d in deliveries] == [good]
        await deliveries[0].msg.ack_sync(timeout=5.0)  # applied before consumer_info reads it
        assert consumer.dead_letters == 2
    dead = await stored(
        nc, "LEAFE_DEAD", letters_filter(dead_letter_subject(run_id, "LEAFE_EVENTS"))
    )
    assert [m.data for m in dead] == [b"\xc1garbage", encode(good)]
    assert "msgpack" in dead[0].headers[ERROR_HEADER]
    assert "'99'" in dead[1].headers[ERROR_HEADER]
    assert dead[0].headers["Leafe-Original-Subject"] == subject
    assert dead[0].headers["Leafe-Original-Stream"] == "LEAFE_EVENTS"
    assert (
        int(dead[1].headers["Leafe-Original-Seq"]) == int(dead[0].headers["Leafe-Original-Seq"]) + 1
    )
    info = await js.consumer_info("LEAFE_EVENTS", run_id)
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_failed_dead_letter_raises_and_hands_the_batch_back(
    nc: Client, run_id: str
) -> None:
    """If the dead-letter publish fails, fetch raises naming it and naks the batch for prompt
    redelivery."""
    js = nc.jetstream()
    good = make_episode(run_id, f"{run_id}-ep")[1]
    async with Publisher(js) as pub:
        await pub.publish_event(good)
        await pub.publish_raw(
            event_subject(run_id, "step", "a0"), b"\xc1", {MSG_ID_HEADER: f"{run_id}-bad"}
        )
    broken = Consumer(
        js,
        stream="LEAFE_EVENTS",
        durable=run_id,
        filter_subject=f"leafe.{run_id}.events.>",
        decode=decode_event,
        dead_letter_subject=f"nowhere.{run_id}",  # no stream captures it
    )
    async with broken:
        with pytest.raises(ConsumerError, match=rf"cannot dead-letter .* to 'nowhere\.{run_id}'"):
            await broken.fetch(timeout=2.0)
    async with events_consumer(nc, run_id) as consumer:  # same durable, default 30 s ack_wait
        deliveries = await consumer.fetch(timeout=2.0)
        assert [(d.value, d.num_delivered) for d in deliveries] == [(good, 2)]
        assert consumer.dead_letters == 1
        await deliveries[0].ack()


async def test_a_message_is_acked_only_after_the_handler_succeeded(nc: Client, run_id: str) -> None:
    """A failing handler's message is nak'ed and redelivered; the others are acked once and not seen
    again."""
    js = nc.jetstream()
    events = make_episode(run_id, f"{run_id}-ep")[:4]
    async with Publisher(js) as pub:
        for event in events:
            await pub.publish_event(event)
    attempts: dict[str, list[int]] = defaultdict(list)

    async def flaky(delivery: Delivery[EpisodeEvent]) -> None:
        attempts[delivery.value.event_id].append(delivery.num_delivered)
        if delivery.value == events[2] and delivery.num_delivered == 1:
            raise RuntimeError("transient")

    async with events_consumer(nc, run_id) as consumer:
        assert await consumer.consume(flaky, limit=4, nak_delay_s=0.1) == 4
        assert consumer.handler_failures == 1
        assert await consumer.fetch(timeout=0.3) == []
    assert attempts[events[2].event_id] == [1, 2]
    assert all(attempts[e.event_id] == [1] for e in events if e != events[2])


async def test_an_unacked_delivery_is_redelivered_after_ack_wait(nc: Client, run_id: str) -> None:
    """Fetching without acking (a crashed handler) gets the message again after ack_wait; term()
    stops it."""
    js = nc.jetstream()
    event = make_episode(run_id, f"{run_id}-ep")[1]
    async with Publisher(js) as pub:
        await pub.publish_event(event)
    async with events_consumer(nc, run_id, ack_wait_s=1.0) as consumer:
        (first,) = await consumer.fetch(timeout=2.0)
        assert first.num_delivered == 1
        (again,) = await consumer.fetch(timeout=5.0)
        assert (
            again.value == event
            and again.num_delivered == 2
            and again.stream_seq == first.stream_seq
        )
        await again.term()  # terminated: never delivered again, although it was not acked
        assert await consumer.fetch(timeout=1.5) == []


async def test_in_progress_keeps_slow_work_from_being_redelivered(nc: Client, run_id: str) -> None:
    """consume() sends in-progress acks while a handler outlasts ack_wait, so nothing is delivered
    twice."""
    js = nc.jetstream()
    events = make_episode(run_id, f"{run_id}-ep")[:2]
    async with Publisher(js) as pub:
        for event in events:
            await pub.publish_event(event)
    seen: list[int] = []

    async def slow(delivery: Delivery[EpisodeEvent]) -> None:
        seen.append(delivery.num_delivered)
        await asyncio.sleep(1.8)

    async with events_consumer(nc, run_id, ack_wait_s=1.5) as consumer:
        assert (
            await consumer.consume(slow, limit=2) == 2
        )  # the second waits 1.8 s, handled for 3.6 s
        assert await consumer.fetch(timeout=1.7) == []
    assert seen == [1, 1]


async def test_durable_consumers_resume_and_refuse_conflicting_configs(
    nc: Client, run_id: str
) -> None:
    """A restarted consumer with the same durable resumes after the last ack; a changed policy is
    refused."""
    js = nc.jetstream()
    events = make_episode(run_id, f"{run_id}-ep")[:3]
    async with Publisher(js) as pub:
        for event in events:
            await pub.publish_event(event)
    async with events_consumer(nc, run_id, batch=1) as consumer:
        (d,) = await consumer.fetch(timeout=2.0)
        await d.ack()
    async with events_consumer(nc, run_id, batch=10) as consumer:
        assert [x.value for x in await consumer.fetch(timeout=2.0)] == events[1:]
    with pytest.raises(ConsumerError, match=rf"'{run_id}'.*deliver"):
        await events_consumer(nc, run_id, deliver_policy="new").start()
    other_filter = Consumer(
        js,
        stream="LEAFE_EVENTS",
        durable=run_id,
        filter_subject=f"leafe.{run_id}.events.step",
        decode=decode_event,
        dead_letter_subject=dead_letter_subject(run_id, "LEAFE_EVENTS"),
    )
    with pytest.raises(ConsumerError, match=r"exists with filter .*use another durable name"):
        await other_filter.start()
    with pytest.raises(ConsumerError, match="not started"):
        await events_consumer(nc, run_id, durable="other").fetch()


async def test_fetch_waits_for_new_messages_then_returns_the_burst(nc: Client, run_id: str) -> None:
    """An empty consumer parks until messages arrive, then returns them together (not one by
    one)."""
    js = nc.jetstream()
    events = make_episode(run_id, f"{run_id}-ep")
    async with events_consumer(nc, run_id) as consumer:
        assert await consumer.fetch(timeout=0.2) == []

        async def publish_later() -> None:
            await asyncio.sleep(0.3)
            async with Publisher(js) as pub:
                for event in events:
                    await pub.publish_event(event)

        task = asyncio.create_task(publish_later())
        got = await consumer.fetch(timeout=5.0)
        await task
        while len(got) < len(events):
            more = await consumer.fetch(timeout=2.0)
            assert more, "events went missing"
            got += more
        assert [d.value for d in got] == events


async def test_connect_names_a_missing_credentials_file(nats_url: str) -> None:
    """A creds path that does not exist fails before connecting, naming the path."""
    with pytest.raises(FileNotFoundError, match=r"no-such\.creds"):
        await connect(NatsOptions(url=nats_url, creds="/no/such/dir/no-such.creds"))
