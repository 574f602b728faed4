"""``leafe log`` export/import/inspect against real nats-servers, and the ``.leafelog`` file
format."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import structlog

from leafe.actors.fake_episodes import fake_episode_id
from leafe.protocol.codec import CODEC_HEADER, MSG_ID_HEADER, ProtocolError
from leafe.protocol.events import EpisodeEvent
from leafe.services.bus import Publisher, connect, ensure_streams
from leafe.services.bus.nats_server import EmbeddedNats
from leafe.services.eventlog.cli import main
from leafe.services.eventlog.fileformat import (
    MAGIC,
    LogFileError,
    LogHeader,
    LogRecord,
    LogWriter,
    iter_log_file,
    iter_log_records,
    read_events,
    read_log_header,
    write_events,
)
from leafe.services.eventlog.transfer import (
    export_run,
    import_log,
    iter_stream_records,
    read_stream_events,
)
from tests.support.logfiles import cut, flip_bit, frame_spans
from tests.support.strategies import make_episode

anyio = pytest.mark.anyio
KINDS_PER_EPISODE = dict(
    episode_started=1, step=7, outcome=2, reflection=1, rollback=1, branch=1, episode_finished=1
)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """``main()`` configures logging onto the (captured) stderr of the moment; undo it for later
    tests."""
    saved, handlers, level = structlog.get_config(), logging.root.handlers[:], logging.root.level
    yield
    structlog.configure(**saved)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


def episodes(run_id: str, n: int = 5) -> list[EpisodeEvent]:
    return [e for i in range(n) for e in make_episode(run_id, f"{run_id}-ep{i}")]


async def publish(url: str, events: list[EpisodeEvent]) -> None:
    nc = await connect(url)
    try:
        await ensure_streams(nc.jetstream())
        async with Publisher(nc.jetstream()) as pub:
            for event in events:
                await pub.publish_event(event)
    finally:
        await nc.close()


def as_messages(records: list[LogRecord]) -> list[tuple[str, dict[str, str], bytes]]:
    return [(r.subject, r.headers, r.data) for r in records]


@anyio
@pytest.mark.integration
async def test_export_then_import_into_a_fresh_server_gives_an_identical_log(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """A run exported from one server and imported into a fresh one has the same messages, in
    order."""
    events = episodes(run_id)
    await publish(nats_url, events)
    nc = await connect(nats_url)
    try:
        original = [r async for r in iter_stream_records(nc.jetstream(), run_id)]
        assert await export_run(nc.jetstream(), run_id, tmp_path / "run.leafelog") == len(events)
    finally:
        await nc.close()
    assert list(iter_log_records(tmp_path / "run.leafelog")) == original
    with EmbeddedNats(tmp_path / "fresh") as fresh:
        nc = await connect(fresh.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js)  # the admin's job: import creates nothing
            stats = await import_log(js, tmp_path / "run.leafelog")
            assert (stats.records, stats.stored, stats.duplicates) == (len(events), len(events), 0)
            again = await import_log(js, tmp_path / "run.leafelog")
            assert (again.stored, again.duplicates) == (
                0,
                len(events),
            )  # importing twice stores once
            copied = [r async for r in iter_stream_records(js, run_id)]
            assert await read_stream_events(js, run_id) == events
        finally:
            await nc.close()
    assert as_messages(copied) == as_messages(original)
    assert [r.stream_seq for r in copied] == list(range(1, len(events) + 1))


@anyio
@pytest.mark.integration
async def test_import_under_a_new_run_rewrites_subjects_and_payloads(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """``--run NEWRUN`` stores a copy under the new run (subjects, run_id) beside the untouched
    original."""
    events = episodes(run_id, n=2)
    path = tmp_path / "run.leafelog.gz"
    write_events(path, events, run_id=run_id)
    await publish(nats_url, events)
    new_run = f"{run_id}-copy"[:64]
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        stats = await import_log(js, path, run_id=new_run)
        assert stats.stored == len(events)
        assert (await import_log(js, path, run_id=new_run)).stored == 0
        copy = [r async for r in iter_stream_records(js, new_run)]
        assert await read_stream_events(js, new_run) == [
            msgspec.structs.replace(e, run_id=new_run) for e in events
        ]
        assert await read_stream_events(js, run_id) == events
    finally:
        await nc.close()
    assert all(r.subject.startswith(f"leafe.{new_run}.events.") for r in copy)
    assert all(r.headers[MSG_ID_HEADER].endswith(f"@{new_run}") for r in copy)


@pytest.mark.integration
@pytest.mark.usefixtures("restore_logging")
def test_cli_export_inspect_and_import(
    nats_url: str,
    run_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI uses LEAFE_NATS_URL, and inspect reports counts per kind/episode from a file or the
    stream."""
    events = episodes(run_id, n=3)
    asyncio.run(publish(nats_url, events))
    monkeypatch.setenv("LEAFE_NATS_URL", nats_url)
    out = tmp_path / "run.leafelog"
    assert main(["export", "--run", run_id, "--out", str(out)]) == 0
    assert f"exported {len(events)} events" in capsys.readouterr().out

    assert main(["inspect", "--file", str(out), "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert from_file["records"] == len(events) and from_file["undecodable"] == 0
    assert from_file["kinds"] == {k: 3 * v for k, v in KINDS_PER_EPISODE.items()}
    assert from_file["last_seq"] - from_file["first_seq"] == len(events) - 1
    ep1, ep2 = (fake_episode_id(f"{run_id}-ep{i}", "actor-0") for i in (1, 2))
    episode = from_file["episodes"][ep1]
    assert (episode["events"], episode["steps"], episode["branches"], episode["success"]) == (
        14,
        7,
        2,
        True,
    )

    assert main(["inspect", "--run", run_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_file

    assert main(["inspect", "--file", str(out), "--episode", ep2]) == 0
    dump = capsys.readouterr().out.split(f"episode {ep2}")[1]
    assert dump.index("episode_started") < dump.index("reflection") < dump.index("episode_finished")
    assert "Go left first." in dump
    assert main(["inspect", "--file", str(out), "--episode", "nope"]) == 1
    assert "'nope' is not in the log" in capsys.readouterr().err

    assert main(["import", "--in", str(out)]) == 0
    assert f"0 stored, {len(events)} already there" in capsys.readouterr().out


def test_log_file_round_trip_without_a_server(tmp_path: Path) -> None:
    """write_events -> read_events/iter_log_file gives back the events, plain or gzip-compressed."""
    events = episodes("r1", n=2)
    for name in ("a.leafelog", "a.leafelog.gz"):
        assert write_events(tmp_path / name, events, run_id="r1") == len(events)
        assert list(read_events(tmp_path / name)) == events
        subjects = [subject for subject, headers, _ in iter_log_file(tmp_path / name)]
        assert subjects[0] == f"leafe.r1.events.episode_started.{events[0].actor_id}"
        header = read_log_header(tmp_path / name)
        assert (header.run_id, header.stream, header.format) == ("r1", "LEAFE_EVENTS", 2)
    assert (tmp_path / "a.leafelog.gz").stat().st_size < (tmp_path / "a.leafelog").stat().st_size


def test_damaged_log_files_are_reported_with_what_is_wrong(tmp_path: Path) -> None:
    """A wrong magic, a truncated frame or an unknown format version raise LogFileError saying
    which."""
    path = tmp_path / "a.leafelog"
    write_events(path, episodes("r1", n=1), run_id="r1")
    data = path.read_bytes()
    (tmp_path / "magic.leafelog").write_bytes(b"NOTALOG!" + data[8:])
    with pytest.raises(LogFileError, match="magic"):
        list(iter_log_records(tmp_path / "magic.leafelog"))
    (tmp_path / "cut.leafelog").write_bytes(data[:-5])
    with pytest.raises(LogFileError, match=r"frame \d+ at byte \d+.*truncated"):
        list(iter_log_records(tmp_path / "cut.leafelog"))
    future = msgspec.msgpack.encode(LogHeader(format=3, run_id="r1", filter_subject="x"))
    (tmp_path / "v3.leafelog").write_bytes(
        MAGIC + len(future).to_bytes(4, "big") + future + b"\0" * 4
    )
    with pytest.raises(LogFileError, match="format 3"):
        read_log_header(tmp_path / "v3.leafelog")


@pytest.mark.usefixtures("restore_logging")
def test_undecodable_records_raise_or_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """read_events names a bad record's subject and seq (or skips it), and inspect counts it."""
    events = episodes("r1", n=1)
    path = tmp_path / "bad.leafelog"
    with LogWriter(path, run_id="r1") as writer:
        writer.write(
            LogRecord(
                subject="leafe.r1.events.step",
                headers={CODEC_HEADER: "1"},
                data=b"\xc1",
                stream_seq=7,
            )
        )
        for seq, event in enumerate(events, start=8):
            writer.write(
                LogRecord(
                    subject="leafe.r1.events.x",
                    headers={},
                    data=msgspec.msgpack.encode(event),
                    stream_seq=seq,
                )
            )
    with pytest.raises(ProtocolError, match=r"leafe\.r1\.events\.step seq 7"):
        list(read_events(path))
    assert list(read_events(path, strict=False)) == events
    assert main(["inspect", "--file", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["undecodable"], summary["first_seq"], summary["records"]) == (
        1,
        7,
        len(events) + 1,
    )


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    """An exception while writing removes the partial file instead of leaving a truncated log."""
    path = tmp_path / "x.leafelog"
    with pytest.raises(RuntimeError), LogWriter(path, run_id="r1"):
        raise RuntimeError("export interrupted")
    assert not path.exists() and not list(tmp_path.iterdir())


def damaged_log(path: Path, run_id: str, *, bad_record: int) -> tuple[list[EpisodeEvent], int]:
    """A v2 log of two episodes with one bit flipped in record ``bad_record``; returns events, its
    offset."""
    events = episodes(run_id, n=2)
    write_events(path, events, run_id=run_id)
    start, _ = frame_spans(path.read_bytes())[bad_record]
    flip_bit(path, (start + 12) * 8 + 5)
    return events, start


async def stored(url: str, run_id: str) -> list[LogRecord]:
    """What the stream holds for ``run_id`` (the stream is created if no test made it yet)."""
    nc = await connect(url)
    try:
        await ensure_streams(nc.jetstream())
        return [r async for r in iter_stream_records(nc.jetstream(), run_id)]
    finally:
        await nc.close()


@pytest.mark.integration
@pytest.mark.usefixtures("restore_logging")
def test_import_of_a_damaged_file_publishes_nothing_and_says_where_in_one_line(
    nats_url: str, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad record near the end: today the 20 records before it were published; now none are."""
    path = tmp_path / "bad.leafelog"
    _, offset = damaged_log(path, run_id, bad_record=21)
    assert main(["import", "--nats", nats_url, "--in", str(path)]) == 1
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert f"frame 21 at byte {offset}" in line and "nothing was imported" in line
    assert "--partial" in line and captured.out == ""
    assert asyncio.run(stored(nats_url, run_id)) == []


@pytest.mark.integration
@pytest.mark.usefixtures("restore_logging")
def test_import_partial_publishes_exactly_the_good_prefix_and_says_how_much(
    nats_url: str, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--partial`` stores the 20 records before the bad frame, in order, and reports frames and
    bytes."""
    path = tmp_path / "bad.leafelog"
    events, offset = damaged_log(path, run_id, bad_record=21)
    assert main(["import", "--nats", nats_url, "--in", str(path), "--partial"]) == 0
    captured = capsys.readouterr()
    assert "20 records" in captured.out and f"byte {offset}" in captured.out
    [line] = captured.err.strip().splitlines()
    assert f"frame 21 at byte {offset}" in line and "checksum" in line
    records = asyncio.run(stored(nats_url, run_id))
    assert [r.headers[MSG_ID_HEADER] for r in records] == [e.event_id for e in events[:20]]


@pytest.mark.integration
def test_import_of_an_intact_file_works_and_a_cut_one_does_not(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """import_log publishes a whole valid file; a copy cut at a frame boundary raises before
    publishing."""
    events = episodes(run_id, n=1)
    path, cut_path = tmp_path / "ok.leafelog", tmp_path / "cut.leafelog"
    write_events(path, events, run_id=run_id)
    cut_path.write_bytes(path.read_bytes()[: frame_spans(path.read_bytes())[-3][0]])

    async def go() -> list[LogRecord]:
        nc = await connect(nats_url)
        try:
            await ensure_streams(nc.jetstream())
            with pytest.raises(LogFileError, match="no trailer"):
                await import_log(nc.jetstream(), cut_path)
            assert [r async for r in iter_stream_records(nc.jetstream(), run_id)] == []
            stats = await import_log(nc.jetstream(), path)
            assert stats.records == stats.stored == len(events)
            return [r async for r in iter_stream_records(nc.jetstream(), run_id)]
        finally:
            await nc.close()

    assert len(asyncio.run(go())) == len(events)


@pytest.mark.usefixtures("restore_logging")
def test_leafe_replay_of_a_file_cut_at_a_frame_boundary_fails_in_one_line(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Today the cut file replays with exit 0 and fewer samples; now: exit 1, one line, no
    dataset."""
    from leafe.learner.model_io import tiny_model_dir
    from leafe.services.replayer import replay

    path = tmp_path / "run.leafelog"
    write_events(path, episodes("r1", n=3), run_id="r1")
    common = ["--model", str(tiny_model_dir(cache_dir)), "--no-progress", "--materializer", "grpo"]
    assert replay.main(["--from", str(path), "--out", str(tmp_path / "whole"), *common]) == 0
    capsys.readouterr()
    start, _ = frame_spans(path.read_bytes())[20]
    cut(path, start)
    assert replay.main(["--from", str(path), "--out", str(tmp_path / "cut"), *common]) == 1
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert line.startswith("leafe replay: ") and f"byte {start}" in line and "no trailer" in line
    assert not (tmp_path / "cut").exists()


@pytest.mark.integration
def test_the_leafe_command_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    """As a user sees it (a subprocess): exit code 1, one stderr line naming the offset, no
    traceback."""
    path = tmp_path / "run.leafelog"
    write_events(path, episodes("r1", n=1), run_id="r1")
    start, _ = frame_spans(path.read_bytes())[3]
    cut(path, start + 2)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "leafe.services.cli", "log", "inspect", "--file", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert f"frame 3 at byte {start}" in line and "Traceback" not in proc.stderr
