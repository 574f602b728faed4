"""Property suite of the ``.leafelog`` v2 file: exact round trips, and no silent damage.

Pins: any list of events written and read back is the same list (plain and gzip); any single flipped
bit and any truncation of a valid file makes reading raise :class:`LogFileError` (never a different
or shorter list of events); and the partial reader's good prefix is a prefix of what was written.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.protocol.events import EpisodeEvent
from leafe.services.eventlog.fileformat import LogFile, LogFileError, read_events, write_events
from tests.support.strategies import episode_events

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
logs = st.lists(episode_events, max_size=8)
names = st.sampled_from(["run.leafelog", "run.leafelog.gz"])


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """One directory for the module (Hypothesis reruns a test body many times per function
    fixture)."""
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def written(scratch: Path, name: str, events: list[EpisodeEvent]) -> tuple[Path, bytes]:
    path = scratch / name
    write_events(path, events, run_id="r1")
    return path, path.read_bytes()


@SETTINGS
@given(events=logs, name=names)
def test_write_then_read_is_exact(scratch: Path, events: list[EpisodeEvent], name: str) -> None:
    """Every event comes back equal and in order; a full check finds no damage."""
    path, _ = written(scratch, name, events)
    assert list(read_events(path)) == events
    check = LogFile(path).check()
    assert (check.error, check.records) == (None, len(events))


def position(data: st.DataObject, n: int, label: str) -> int:
    """A position in ``range(n)``; drawn independently of ``n``, which varies between runs of the
    same example (the header's export time and gzip's mtime change the compressed size)."""
    return data.draw(st.integers(0, 2**40), label=label) % n


def flipped(path: Path, raw: bytes, data: st.DataObject) -> None:
    bit = position(data, len(raw) * 8, "bit")
    damaged = bytearray(raw)
    damaged[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(damaged))


@SETTINGS
@given(events=logs, data=st.data())
def test_any_single_bit_flip_is_detected(
    scratch: Path, events: list[EpisodeEvent], data: st.DataObject
) -> None:
    """Flip one bit anywhere (magic, header, a record, a checksum, the trailer): reading raises, and
    the good prefix ``check`` reports is a prefix of what was written."""
    path, raw = written(scratch, "run.leafelog", events)
    flipped(path, raw, data)
    with pytest.raises(LogFileError):
        list(read_events(path))
    check = LogFile(path).check()
    assert check.error is not None
    assert list(read_events_prefix(path, check.records)) == events[: check.records]


@SETTINGS
@given(events=logs, data=st.data())
def test_a_bit_flip_in_a_gzip_log_never_yields_different_events(
    scratch: Path, events: list[EpisodeEvent], data: st.DataObject
) -> None:
    """In a .gz file a flip either raises or, when it hits a gzip header field that carries no data
    (modification time, OS byte), reads back exactly the events that were written."""
    path, raw = written(scratch, "run.leafelog.gz", events)
    flipped(path, raw, data)
    try:
        got = list(read_events(path))
    except LogFileError:
        return
    assert got == events


@SETTINGS
@given(events=logs, name=names, data=st.data())
def test_any_truncation_is_detected(
    scratch: Path, events: list[EpisodeEvent], name: str, data: st.DataObject
) -> None:
    """Cut the file anywhere before its end (inside a frame or between two): reading raises."""
    path, raw = written(scratch, name, events)
    size = position(data, len(raw), "size")
    path.write_bytes(raw[:size])
    with pytest.raises(LogFileError):
        list(read_events(path))


def read_events_prefix(path: Path, n: int) -> Iterator[EpisodeEvent]:
    """The first ``n`` events through the partial reader (what ``import --partial`` publishes)."""
    from leafe.services.eventlog.fileformat import decode_record

    for record in LogFile(path).records(limit=n):
        yield decode_record(record)
