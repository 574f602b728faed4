"""Streams are the admin's: ``leafe streams ensure`` creates and updates them, ``leafe streams
check`` reports them, and a service only waits for its own, then exits non-zero naming the missing
streams and the command that creates them. Each test has its own nats-server (no streams, no users),
not the session one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from leafe.protocol.subjects import STREAMS, WEIGHTS
from leafe.services.admin import streams
from leafe.services.bus import (
    StreamsMissingError,
    connect,
    ensure_streams,
    stream_config,
    wait_for_streams,
)
from leafe.services.bus.nats_server import EmbeddedNats

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def empty_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server with JetStream and no stream at all."""
    with EmbeddedNats(tmp_path / "js", log_file=tmp_path / "nats.log") as server:
        yield server


def _streams(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, str]]:
    code = streams.main(list(argv))
    lines = [line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line]
    return code, {name: what for name, what in lines}


def test_streams_ensure_creates_then_changes_nothing_and_check_reports(
    empty_server: EmbeddedNats, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check` finds every stream missing (exit 1); `ensure` creates each, a second `ensure` leaves
    each unchanged; `check` then says ok (exit 0), and against another replica count names the field
    (exit 1)."""
    names = {s.name for s in STREAMS}
    nats = ("--nats", empty_server.url)
    assert _streams(capsys, "check", *nats) == (1, dict.fromkeys(names, "missing"))
    assert _streams(capsys, "ensure", *nats) == (0, dict.fromkeys(names, "created"))
    assert _streams(capsys, "ensure", *nats) == (0, dict.fromkeys(names, "unchanged"))
    assert _streams(capsys, "check", *nats) == (0, dict.fromkeys(names, "ok"))
    code, state = _streams(capsys, "check", *nats, "--stream-replicas", "3")
    assert code == 1 and set(state) == names
    assert all(v.startswith("differs: num_replicas is 1, spec 3") for v in state.values()), state


def test_a_service_without_its_streams_exits_naming_them(empty_server: EmbeddedNats) -> None:
    """`leafe weight-sync` on a server without LEAFE_WEIGHTS waits its --streams-timeout, then exits
    non-zero naming the stream and `leafe streams ensure`; it created nothing."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("LEAFE_NATS_URL", "LEAFE_NATS_CREDS", "LEAFE_NATS_NKEY", "LEAFE_NATS_USER"):
        env.pop(name, None)
    argv = [
        "weight-sync",
        "--nats",
        empty_server.url,
        "--run",
        "r1",
        "--server",
        "http://127.0.0.1:9",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "leafe.services.cli", *argv, "--streams-timeout", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "LEAFE_WEIGHTS (missing)" in last and "leafe streams ensure" in last, proc.stderr[-2000:]

    async def absent() -> None:
        nc = await connect(empty_server.url)
        with pytest.raises(NotFoundError):
            await nc.jetstream().stream_info(WEIGHTS.name)
        await nc.close()

    asyncio.run(absent())


def test_waiting_ends_when_the_admin_creates_the_streams(empty_server: EmbeddedNats) -> None:
    """A service that started first carries on as soon as the streams exist; with none, the wait
    ends in StreamsMissingError naming each missing stream."""

    async def scenario() -> None:
        nc = await connect(empty_server.url)
        js = nc.jetstream()
        with pytest.raises(
            StreamsMissingError, match=r"LEAFE_EVENTS \(missing\), LEAFE_SAMPLES \(missing\)"
        ):
            await wait_for_streams(
                js, ["LEAFE_EVENTS", "LEAFE_SAMPLES"], timeout_s=0.2, interval_s=0.1
            )
        waiting = asyncio.create_task(
            wait_for_streams(js, [WEIGHTS.name], timeout_s=60, interval_s=0.1)
        )
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await ensure_streams(js)
        await asyncio.wait_for(waiting, 30)
        await nc.close()

    asyncio.run(scenario())


def test_the_server_refuses_an_event_over_the_events_limit(empty_server: EmbeddedNats) -> None:
    """LEAFE_EVENTS holds at most ``EVENTS.max_msg_bytes`` (1 MiB, headers included) on the server
    itself, not only in the Publisher: a client that publishes raw is refused, and a stream made
    before the limit existed gets it from the next `ensure`."""
    import msgspec
    from nats.js.errors import APIError

    from leafe.protocol.subjects import EVENTS

    async def scenario() -> None:
        nc = await connect(empty_server.url)
        try:
            js = nc.jetstream()
            old = msgspec.structs.replace(
                EVENTS, max_msg_bytes=-1
            )  # what the spec made before the limit
            await js.add_stream(stream_config(old))
            assert (await ensure_streams(js))[EVENTS.name] == "updated: max_msg_size"
            info = await js.stream_info(EVENTS.name)
            assert info.config.max_msg_size == EVENTS.max_msg_bytes == 1024 * 1024
            await js.publish("leafe.r1.events.step", b"x" * (EVENTS.max_msg_bytes - 100))  # fits
            with pytest.raises(APIError, match="message size exceeds maximum allowed"):
                await js.publish("leafe.r1.events.step", b"x" * (EVENTS.max_msg_bytes + 1))
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_the_dead_letters_answer_direct_gets_after_ensure(empty_server: EmbeddedNats) -> None:
    """A letter's writer reads back the last message on its letter's subject with a direct get
    (``dead_letters.store_once``): LEAFE_DEAD answers them, and a LEAFE_DEAD made before that gets
    ``allow_direct`` from the next `ensure`; no other stream answers them."""
    from leafe.protocol.subjects import DEAD_LETTERS

    async def scenario() -> None:
        nc = await connect(empty_server.url)
        try:
            js = nc.jetstream()
            old = stream_config(DEAD_LETTERS)
            old.allow_direct = False  # what the spec made before
            await js.add_stream(old)
            done = await ensure_streams(js)
            assert done[DEAD_LETTERS.name] == "updated: allow_direct", done
            assert {k for k, v in done.items() if v != "created"} == {DEAD_LETTERS.name}
            for spec in STREAMS:
                info = await js.stream_info(spec.name)
                assert bool(info.config.allow_direct) == (spec is DEAD_LETTERS), spec.name
            await js.publish("leafe.r1.dead.leafe_events.7", b"a letter")
            last = await js.get_last_msg(
                DEAD_LETTERS.name, "leafe.r1.dead.leafe_events.7", direct=True
            )
            assert last.data == b"a letter"
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_ensure_with_a_run_makes_its_durables_which_a_service_binds_or_waits_for(
    empty_server: EmbeddedNats, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ensure --run r1` makes the run's durables (then leaves them unchanged); a service role binds
    its durable without creating it, waits for a missing one, and gives up naming the command that
    makes it."""
    from nats.js.api import ConsumerConfig

    from leafe.protocol.codec import decode_task
    from leafe.protocol.subjects import TASKS
    from leafe.services.bus import Consumer, NatsOptions
    from leafe.services.bus.pull import ConsumerError

    nats = ("--nats", empty_server.url)
    durables = {"actors-r1": "created", "replayer-r1-leafe": "created", "learner-r1": "created"}
    code, done = _streams(capsys, "ensure", *nats, "--run", "r1")
    assert code == 0 and {k: v for k, v in done.items() if k in durables} == durables
    code, done = _streams(capsys, "ensure", *nats, "--run", "r1")
    assert code == 0 and {k: done[k] for k in durables} == dict.fromkeys(durables, "unchanged")

    def task_consumer(js: object, durable: str) -> Consumer[object]:
        return Consumer(
            js,  # type: ignore[arg-type]
            stream=TASKS.name,
            durable=durable,
            filter_subject=f"leafe.{durable.split('-')[1]}.tasks",
            decode=decode_task,
            dead_letter_subject="leafe.r1.dead.leafe_tasks",
            ack_wait_s=5.0,
            bind_timeout_s=3.0,
        )

    async def scenario() -> None:
        admin = await connect(empty_server.url)
        actor = await connect(NatsOptions(url=empty_server.url, inbox_prefix="_INBOX_actor"))
        try:
            bound = task_consumer(actor.jetstream(), "actors-r1")
            await (
                bound.start()
            )  # the admin's durable: bound as it is (its ack_wait of 60 s adopted)
            assert bound.ack_wait_s == 60.0
            await bound.close()
            late = task_consumer(actor.jetstream(), "actors-r2")
            starting = asyncio.create_task(late.start())
            await asyncio.sleep(0.5)
            assert not starting.done()  # waiting: an actor may not create it
            await admin.jetstream().add_consumer(
                TASKS.name,
                ConsumerConfig(
                    durable_name="actors-r2", filter_subject="leafe.r2.tasks", max_ack_pending=4096
                ),
            )
            await asyncio.wait_for(starting, 10)
            await late.close()
            with pytest.raises(ConsumerError, match="leafe streams ensure --run"):
                await task_consumer(actor.jetstream(), "actors-r3").start()
            with pytest.raises(NotFoundError):
                await admin.jetstream().consumer_info(TASKS.name, "actors-r3")
        finally:
            await actor.close()
            await admin.close()

    asyncio.run(scenario())
