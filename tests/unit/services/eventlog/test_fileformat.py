"""The ``.leafelog`` v2 format: round trips, and every kind of damage a bad disk does is caught and
located.

Each damage test names the byte offset (in the uncompressed stream) and the frame index the reader
must report; the frames are found with ``tests/support/logfiles.py``, which walks the layout
independently.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec
import pytest
from structlog.testing import capture_logs

from leafe.protocol.events import EpisodeEvent, Step
from leafe.services.eventlog.fileformat import (
    FORMAT_VERSION,
    MAGIC,
    LogFile,
    LogFileError,
    LogHeader,
    iter_log_records,
    read_events,
    read_log_header,
    record_for,
    write_events,
)
from tests.support.logfiles import cut, flip_bit, frame_spans, garble
from tests.support.strategies import make_episode

MARK = 987_654_321
"""A token id that appears once in the log, so its bytes can be found and damaged."""
MARK_BYTES = b"\xce" + MARK.to_bytes(4, "big")  # msgpack uint32


def events(n: int = 2) -> list[EpisodeEvent]:
    """``n`` episodes; the third event (a Step) carries the token id ``MARK``."""
    out = [e for i in range(n) for e in make_episode("r1", f"r1-ep{i}")]
    step = out[2]
    assert isinstance(step, Step)
    out[2] = msgspec.structs.replace(step, token_ids=[MARK, *step.token_ids])
    return out


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "run.leafelog"
    write_events(path, events(), run_id="r1")
    return path


def damage(path: Path, match: str) -> LogFileError:
    """Read ``path`` to the end and return the LogFileError it must raise (message matching
    ``match``)."""
    with pytest.raises(LogFileError, match=match) as info:
        list(read_events(path))
    return info.value


def test_round_trip_plain_and_gzip_is_exact(tmp_path: Path) -> None:
    """write_events -> read_events gives back the same events; the header says format 2."""
    evs = events()
    for name in ("a.leafelog", "a.leafelog.gz"):
        assert write_events(tmp_path / name, evs, run_id="r1") == len(evs)
        assert list(read_events(tmp_path / name)) == evs
        assert read_log_header(tmp_path / name).format == FORMAT_VERSION == 2
    check = LogFile(tmp_path / "a.leafelog").check()
    assert (check.error, check.records, check.verified) == (None, len(evs), True)
    assert check.bytes == (tmp_path / "a.leafelog").stat().st_size


def test_an_empty_log_round_trips(tmp_path: Path) -> None:
    """A log of no events is valid: header and trailer only."""
    assert write_events(tmp_path / "e.leafelog", [], run_id="r1") == 0
    assert list(read_events(tmp_path / "e.leafelog")) == []


def test_truncation_mid_frame_names_the_frame_and_its_offset(log: Path) -> None:
    """A file cut inside record 5 fails at frame 5's offset, saying it is truncated."""
    start, _ = frame_spans(log.read_bytes())[5]
    cut(log, start + 7)
    err = damage(log, rf"frame 5 at byte {start}\b.*truncated")
    assert (err.frame, err.offset) == (5, start)


def test_truncation_at_a_frame_boundary_is_caught_by_the_missing_trailer(log: Path) -> None:
    """A file cut exactly between frames (today: read as complete) fails: no trailer after record
    9."""
    start, _ = frame_spans(log.read_bytes())[10]
    cut(log, start)
    err = damage(log, rf"byte {start}\b.*no trailer")
    assert (err.frame, err.offset) == (10, start)


def test_dropping_only_the_trailer_is_caught(log: Path) -> None:
    """Even with every record intact, a file without its trailer is not complete."""
    start, _ = frame_spans(log.read_bytes())[-1]
    cut(log, start)
    damage(log, rf"byte {start}\b.*no trailer")


def test_a_flipped_bit_in_a_steps_token_ids_fails_that_frames_checksum(log: Path) -> None:
    """One bit of a Step's token id (still valid msgpack, today: a different sample) fails the frame
    CRC."""
    spans = frame_spans(log.read_bytes())
    where = garble(log, MARK_BYTES)
    frame = next(i for i, (a, b) in enumerate(spans) if a <= where < b)
    assert frame == 3  # header, then the episode's third event
    err = damage(log, rf"frame 3 at byte {spans[3][0]}\b.*checksum")
    assert err.offset == spans[3][0]


def test_a_flipped_bit_in_the_trailer_is_caught(log: Path) -> None:
    """A damaged trailer (its record count or digest) fails its own checksum."""
    spans = frame_spans(log.read_bytes())
    start, end = spans[-1]
    flip_bit(log, (end - 10) * 8 + 3)
    err = damage(log, rf"frame {len(spans) - 1} at byte {start}\b.*checksum")
    assert err.offset == start


def test_garbage_after_the_trailer_is_caught(log: Path) -> None:
    """Bytes appended after the trailer are an error at the offset where they start."""
    size = log.stat().st_size
    log.write_bytes(log.read_bytes() + b"\x00" * 3)
    err = damage(log, rf"byte {size}\b.*after the trailer")
    assert err.offset == size


def test_a_wrong_magic_is_caught_at_byte_0(log: Path) -> None:
    """A file that does not start with LEAFELOG is not a log."""
    log.write_bytes(b"NOTALOG!" + log.read_bytes()[8:])
    err = damage(log, r"byte 0\b.*magic")
    assert err.offset == 0


def test_an_unknown_format_version_is_refused(tmp_path: Path) -> None:
    """A header with a format this code does not know is refused, naming the version."""
    body = msgspec.msgpack.encode(LogHeader(format=3, run_id="r1", filter_subject="x"))
    path = tmp_path / "v3.leafelog"
    path.write_bytes(MAGIC + len(body).to_bytes(4, "big") + body + b"\0" * 4)
    with pytest.raises(LogFileError, match="format 3 is not supported"):
        read_log_header(path)


def test_a_length_prefix_damaged_to_a_huge_size_fails_without_reading_it(log: Path) -> None:
    """The top bit of a record's length set: refused by the frame size limit, not a 2 GiB read."""
    start, _ = frame_spans(log.read_bytes())[4]
    flip_bit(log, start * 8)
    err = damage(log, rf"frame 4 at byte {start}\b.*length")
    assert err.frame == 4


def test_gzip_offsets_refer_to_the_uncompressed_stream(tmp_path: Path) -> None:
    """In a .gz log the offset is the uncompressed one, and the message says so."""
    plain, packed = tmp_path / "a.leafelog", tmp_path / "a.leafelog.gz"
    write_events(plain, events(), run_id="r1")
    garble(plain, MARK_BYTES)
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    start, _ = frame_spans(gzip.decompress(packed.read_bytes()))[3]
    damage(packed, rf"frame 3 at byte {start} of the uncompressed stream\b.*checksum")


def test_a_truncated_gzip_stream_is_a_log_file_error(tmp_path: Path) -> None:
    """A .gz file cut short fails as a LogFileError naming where the uncompressed stream stopped."""
    path = tmp_path / "a.leafelog.gz"
    write_events(path, events(), run_id="r1")
    cut(path, path.stat().st_size // 2)
    damage(path, r"byte \d+ of the uncompressed stream")


def test_check_reports_the_good_prefix_before_the_first_bad_frame(log: Path) -> None:
    """check() reads the whole file once and says how many records (and bytes) precede the
    damage."""
    spans = frame_spans(log.read_bytes())
    flip_bit(log, (spans[6][0] + 9) * 8)
    check = LogFile(log).check()
    assert check.error is not None and check.error.frame == 6
    assert (check.records, check.bytes) == (5, spans[6][0])
    assert [r.stream_seq for r in LogFile(log).records(limit=check.records)] == [1, 2, 3, 4, 5]


def write_v1(path: Path, evs: list[EpisodeEvent]) -> None:
    """A format-1 file as the old writer made it: magic, then length-prefixed msgpack frames."""
    header = msgspec.msgpack.encode(
        LogHeader(format=1, run_id="r1", filter_subject="leafe.r1.events.>")
    )
    frames = [header] + [msgspec.msgpack.encode(record_for(e, i)) for i, e in enumerate(evs, 1)]
    path.write_bytes(MAGIC + b"".join(len(f).to_bytes(4, "big") + f for f in frames))


def test_a_v1_file_still_reads_with_a_warning_that_it_cannot_be_verified(tmp_path: Path) -> None:
    """Old logs stay readable; a structlog warning says their damage cannot be detected."""
    path, evs = tmp_path / "old.leafelog", events()
    write_v1(path, evs)
    with capture_logs() as logs:
        assert list(read_events(path)) == evs
        check = LogFile(path).check()
    assert (check.error, check.records, check.verified) == (None, len(evs), False)
    warnings = [e for e in logs if e["event"] == "eventlog.file.unverified"]
    assert warnings and warnings[0]["log_level"] == "warning" and warnings[0]["format"] == 1


def test_a_v1_file_cut_mid_frame_is_still_caught(tmp_path: Path) -> None:
    """Without checksums a v1 file still has length prefixes: a cut inside a frame is detected."""
    path = tmp_path / "old.leafelog"
    write_v1(path, events())
    cut(path, path.stat().st_size - 5)
    with capture_logs():
        damage(path, r"byte \d+\b.*truncated")


def test_records_can_be_read_without_verification(log: Path) -> None:
    """verify=False (benchmarks, salvage) skips checksums and the digest, so damage goes
    unnoticed."""
    garble(log, MARK_BYTES)
    records = list(iter_log_records(log, verify=False))
    assert len(records) == len(events())
