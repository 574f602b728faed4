"""``leafe log`` on damaged files: one line on stderr naming the byte offset, a non-zero exit, no
traceback.

Only ``inspect --file`` needs no server; import and ``leafe replay`` are covered in
``tests/integration/test_log_tools.py``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from leafe.services.eventlog.cli import main
from leafe.services.eventlog.fileformat import (
    MAGIC,
    LogFileError,
    LogHeader,
    record_for,
    write_events,
)
from tests.support.logfiles import cut, flip_bit, frame_spans
from tests.support.strategies import make_episode

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "run.leafelog"
    write_events(path, make_episode("r1", "r1-ep0"), run_id="r1")
    return path


def lines(text: str) -> list[str]:
    return text.strip().splitlines()


def test_inspect_of_a_file_cut_at_a_frame_boundary_fails_in_one_line(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cut file is not summarized as if complete: exit 1 and one stderr line with the offset."""
    start, _ = frame_spans(log.read_bytes())[4]
    cut(log, start)
    assert main(["inspect", "--file", str(log), "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = lines(captured.err)
    assert line.startswith("leafe log inspect: ") and f"byte {start}" in line and "trailer" in line


def test_inspect_of_a_damaged_record_fails_in_one_line_and_debug_shows_the_traceback(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped bit: one line naming frame and byte; with --debug the LogFileError propagates."""
    start, _ = frame_spans(log.read_bytes())[2]
    flip_bit(log, (start + 6) * 8 + 1)
    assert main(["inspect", "--file", str(log)]) == 1
    [line] = lines(capsys.readouterr().err)
    assert f"frame 2 at byte {start}" in line and "checksum" in line
    with pytest.raises(LogFileError):
        main(["inspect", "--file", str(log), "--debug"])


def test_a_missing_file_is_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not only damage: a file that is not there is one line naming it."""
    assert main(["inspect", "--file", str(tmp_path / "nope.leafelog")]) == 1
    [line] = lines(capsys.readouterr().err)
    assert "nope.leafelog" in line


def test_inspect_of_a_v1_file_works_and_warns_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An old file is summarized (exit 0) with one stderr line saying it cannot be verified."""
    events = make_episode("r1", "r1-ep0")
    header = msgspec.msgpack.encode(
        LogHeader(format=1, run_id="r1", filter_subject="leafe.r1.events.>")
    )
    frames = [header] + [msgspec.msgpack.encode(record_for(e, i)) for i, e in enumerate(events, 1)]
    path = tmp_path / "old.leafelog"
    path.write_bytes(MAGIC + b"".join(len(f).to_bytes(4, "big") + f for f in frames))
    assert main(["inspect", "--file", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert msgspec.json.decode(captured.out)["records"] == len(events)
    [line] = lines(captured.err)
    assert "eventlog.file.unverified" in line and "format 1" in line
