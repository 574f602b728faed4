"""`leafe log import` admits each record as the replayer does, and runs as a role that can only
publish events.

A crafted but well-formed log file (valid frames, checksums and trailer) names its own subjects:
once it deleted a JetStream stream (a record on ``$JS.API.STREAM.DELETE.<name>``) and planted a
sample on another run's samples subject. Now every record must be an event of the file's run, on its
own kind's subject, with an id derived from its episode and a ``Nats-Msg-Id`` of its own, before
anything is published; and the ``log-import`` role of permissions.json may publish events only,
never the JetStream API.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import StreamConfig

from leafe.protocol.codec import CODEC_HEADER, CODEC_VERSION, MSG_ID_HEADER, encode
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import LEGACY_ACTOR, event_subject
from leafe.services.bus import NatsOptions, connect
from leafe.services.eventlog.cli import main
from leafe.services.eventlog.fileformat import LogRecord, LogWriter, record_for
from leafe.services.eventlog.transfer import ImportRefusedError, import_log, iter_stream_records
from leafe.services.replayer.replay import stream_events
from tests.integration.test_log_tools import restore_logging  # noqa: F401 (a fixture)
from tests.support.nats_auth import RoleClient, stored
from tests.support.strategies import make_episode

pytestmark = pytest.mark.integration
anyio = pytest.mark.anyio


def crafted_log(path: Path, run_id: str, extra: list[LogRecord]) -> list[EpisodeEvent]:
    """A well-formed log of one genuine episode of ``run_id`` followed by the ``extra`` records."""
    events = make_episode(run_id, f"{run_id}-ep0")
    with LogWriter(path, run_id=run_id) as writer:
        for seq, event in enumerate(events, start=1):
            writer.write(record_for(event, seq))
        for record in extra:
            writer.write(record)
    return events


def kind_of(event: EpisodeEvent) -> str:
    return str(type(event).__struct_config__.tag)


def raw(subject: str, data: bytes, msg_id: str, seq: int = 99) -> LogRecord:
    return LogRecord(
        subject=subject,
        headers={MSG_ID_HEADER: msg_id, CODEC_HEADER: CODEC_VERSION},
        data=data,
        stream_seq=seq,
    )


@pytest.fixture
async def victim(admin_client: RoleClient, run_id: str) -> AsyncIterator[str]:
    """A stream of this test's own (never a LEAFE stream), which a hostile record tries to
    delete."""
    name = f"V_{run_id.replace('-', '_')}"[:60]
    await admin_client.js.add_stream(StreamConfig(name=name, subjects=[f"leafe.{run_id}.victim"]))
    yield name
    await admin_client.js.delete_stream(name)


@anyio
async def test_a_record_on_the_jetstream_api_or_another_runs_subject_is_refused(
    nats_url: str, admin_client: RoleClient, victim: str, run_id: str, tmp_path: Path
) -> None:
    """Imported as the admin (the identity import used to need): the file is refused naming the
    record, and nothing of it is published: the stream survives, no sample is planted, not even the
    genuine episode."""
    other = f"{run_id}-other"[:64]
    events = make_episode(run_id, f"{run_id}-ep0")
    hostile = {
        "delete": raw(f"$JS.API.STREAM.DELETE.{victim}", b"", "x1"),
        "sample": raw(f"leafe.{other}.samples.cf", encode(events[1]), events[1].event_id),
        "other run's event": raw(
            f"leafe.{other}.events.step", encode(events[1]), events[1].event_id
        ),
        "forged dedupe id": raw(
            f"leafe.{run_id}.events.step", encode(events[2]), f"{run_id}-ep9.0"
        ),
        "control header": LogRecord(
            subject=f"leafe.{run_id}.events.step",
            headers={
                MSG_ID_HEADER: events[2].event_id,
                CODEC_HEADER: CODEC_VERSION,
                "Nats-Expected-Last-Sequence": "0",
            },
            data=encode(events[2]),
            stream_seq=3,
        ),
    }
    for what, record in hostile.items():
        path = tmp_path / f"{what.replace(' ', '_')}.leafelog"
        crafted_log(path, run_id, [record])
        with pytest.raises(ImportRefusedError, match="nothing was imported") as refused:
            await import_log(admin_client.js, path)
        assert record.subject[:40] in str(refused.value), (what, refused.value)
        assert "\n" not in str(refused.value)
        assert (await admin_client.js.stream_info(victim)).config.name == victim, what
        assert [r async for r in iter_stream_records(admin_client.js, run_id)] == [], what
        assert await stored(admin_client.js, f"leafe.{other}.samples.cf") == 0, what


@pytest.mark.usefixtures("restore_logging")
def test_the_cli_refuses_it_in_one_line(
    nats_url: str, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`leafe log import` exits 1 with one line naming the file, the record and the subject."""
    name = f"W_{run_id.replace('-', '_')}"[:60]

    async def streams(action: str) -> list[str]:
        nc = await connect(nats_url)
        try:
            if action == "add":
                await nc.jetstream().add_stream(
                    StreamConfig(name=name, subjects=[f"leafe.{run_id}.w"])
                )
            names = [n async for n in _names(nc.jetstream())]
            if action == "delete":
                await nc.jetstream().delete_stream(name)
            return names
        finally:
            await nc.close()

    asyncio.run(streams("add"))
    path = tmp_path / "hostile.leafelog"
    crafted_log(path, run_id, [raw(f"$JS.API.STREAM.DELETE.{name}", b"", "x1")])
    assert main(["import", "--nats", nats_url, "--in", str(path)]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert str(path) in line and f"$JS.API.STREAM.DELETE.{name}" in line and "refused" in line, line
    assert name in asyncio.run(streams("delete"))


async def _names(js: Any) -> AsyncIterator[str]:
    for info in await js.streams_info():
        yield info.config.name


@anyio
async def test_the_log_import_role_imports_events_and_can_do_nothing_else(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    victim: str,
    run_id: str,
    tmp_path: Path,
) -> None:
    """As ``log-import``: a genuine file imports (publish + acks on its own inbox); a raw publish on
    the JetStream API or on a samples subject is a permissions violation and changes nothing."""
    path = tmp_path / "ok.leafelog"
    events = crafted_log(path, run_id, [])
    async with RoleClient(nats_roles["log-import"]) as client:
        stats = await import_log(client.js, path)
        assert (stats.records, stats.stored) == (len(events), len(events))
        for subject in (
            f"$JS.API.STREAM.DELETE.{victim}",
            f"leafe.{run_id}.samples.cf",
            "$JS.API.INFO",
        ):
            await client.nc.publish(subject, b"{}")
            assert await client.violated(subject), (subject, client.violations)
    assert (await admin_client.js.stream_info(victim)).config.name == victim
    assert await stored(admin_client.js, f"leafe.{run_id}.samples.cf") == 0
    assert [
        r.headers[MSG_ID_HEADER] async for r in iter_stream_records(admin_client.js, run_id)
    ] == [e.event_id for e in events]


@anyio
async def test_a_log_written_before_actor_tokens_imports_and_replays_as_actor_legacy(
    nats_roles: dict[str, NatsOptions], admin_client: RoleClient, run_id: str, tmp_path: Path
) -> None:
    """Records on ``leafe.<run>.events.<kind>`` (every log exported before subjects named their
    actor) import as they are, and the replayer's admission reads them as actor ``legacy`` (their
    payload ids vouched for by nobody); moved to another run they are published on the ``legacy``
    token."""
    events = make_episode(run_id, f"{run_id}-ep0", legacy=True)  # ids of before, too
    path = tmp_path / "legacy.leafelog"
    with LogWriter(path, run_id=run_id, owned_episode_ids=False) as writer:
        for seq, event in enumerate(events, start=1):
            record = record_for(event, seq)
            writer.write(msgspec.structs.replace(record, subject=record.subject.rsplit(".", 1)[0]))
    async with RoleClient(nats_roles["log-import"]) as client:
        assert (await import_log(client.js, path)).stored == len(events)
        moved = f"{run_id}-moved"
        assert (await import_log(client.js, path, run_id=moved)).stored == len(events)
        assert client.violations == []
    subjects = [r.subject async for r in iter_stream_records(admin_client.js, run_id)]
    assert subjects == [f"leafe.{run_id}.events.{kind_of(e)}" for e in events]
    replayed = [e async for e in stream_events(admin_client.js, run_id)]
    assert replayed == [msgspec.structs.replace(e, actor_id=LEGACY_ACTOR) for e in events]
    subjects = [r.subject async for r in iter_stream_records(admin_client.js, moved)]
    assert subjects == [event_subject(moved, kind_of(e), LEGACY_ACTOR) for e in events]
    assert {e.actor_id async for e in stream_events(admin_client.js, moved)} == {LEGACY_ACTOR}
