"""``leafe replay`` as a user runs it (a subprocess): failures a user can cause print one line, and
a log of unfinished episodes with huge observations cannot take its memory past the open-episode
caps.

The memory case measures the child's peak RSS (``os.wait4``) on the same crafted ``.leafelog.gz``
twice: with caps raised out of the way (the old behaviour: every episode held to the end of the log)
and with a ``max_open_bytes`` cap; the capped run must stay well below, name the cap on stderr in
one line, and still rebuild the valid episode's samples.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leafe.actors.fake_episodes import EventWriter, fake_episode_id
from leafe.learner.dataset import iter_samples
from leafe.protocol.events import EpisodeEvent, EpisodeStarted
from leafe.services.bus.nats_server import free_port
from leafe.services.eventlog.fileformat import write_events
from tests.support.hostile import started_fields
from tests.support.strategies import make_episode

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def leafe_replay(tmp_path: Path, *args: str) -> tuple[int, str, int]:
    """Run ``leafe replay ARGS`` as a user would; its exit code, stderr, and peak RSS in KiB.

    The peak is the child's ``VmHWM``, polled while it runs (monotonic; its exec'd image's own,
    where ``ru_maxrss`` would include the forking test process's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    err_path = tmp_path / "stderr.txt"
    peak = 0
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leafe.services.cli", "replay", "--no-progress", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                hwm = [
                    line for line in status.read_text().splitlines() if line.startswith("VmHWM:")
                ]
            except OSError:
                break  # exited between poll and read
            if hwm:
                peak = max(peak, int(hwm[0].split()[1]))
            time.sleep(0.01)
        proc.wait(timeout=300)
    return proc.returncode, err_path.read_text(), peak


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line, got:\n{err}"
    return lines[0]


@pytest.fixture(scope="module")
def log_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("log") / "run.leafelog"
    write_events(path, make_episode("r1", "r1-ep0"), run_id="r1")
    return path


def test_a_missing_model_is_one_line(log_file: Path, tmp_path: Path) -> None:
    """Today: a 13-line traceback ending in ModelNotFound. Now: exit 1, one line naming the path."""
    args = [
        "--from",
        str(log_file),
        "--model",
        str(tmp_path / "nope"),
        "--out",
        str(tmp_path / "d"),
    ]
    code, err, _ = leafe_replay(tmp_path, *args)
    assert code == 1
    line = one_line(err)
    assert line.startswith("leafe replay: ModelNotFound: ") and str(tmp_path / "nope") in line
    assert not (tmp_path / "d").exists()


def test_an_unwritable_out_is_one_line(log_file: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """``--out`` under a regular file: exit 1, one line naming the error (no traceback)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = blocker / "dataset"
    code, err, _ = leafe_replay(
        tmp_path, "--from", str(log_file), "--model", str(tiny_dir), "--out", str(out)
    )
    assert code == 1
    line = one_line(err)
    assert line.startswith("leafe replay: ") and "Error" in line and str(blocker) in line


def test_a_nats_server_that_is_down_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """Nothing listens on the port: exit 1, one line naming the (redacted) URL."""
    url = f"nats://127.0.0.1:{free_port()}"
    args = ["--from", url, "--run", "r1", "--model", str(tiny_dir), "--out", str(tmp_path / "d")]
    code, err, _ = leafe_replay(tmp_path, *args)
    assert code == 1
    line = one_line(err)
    assert line.startswith("leafe replay: ConnectionError: no NATS connection to nats://127.0.0.1:")
    assert not (tmp_path / "d").exists()


def flood(n: int, obs_bytes: int) -> list[EpisodeEvent]:
    """``n`` EpisodeStarted (distinct actors) with ``obs_bytes``-character observations, never
    finished."""
    out: list[EpisodeEvent] = []
    for i in range(n):
        w = EventWriter("r1", f"r1-flood{i}", actor_id=f"a{i}")
        out.append(
            w.emit(EpisodeStarted, **started_fields(f"r1-flood{i}", observation="x" * obs_bytes))
        )
    return out


def test_unfinished_episodes_with_huge_observations_are_capped_offline(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """160 unfinished episodes with 1 MB observations (each event under the 1 MiB limit; the gzipped
    file is small) ahead of a valid one: with the caps out of the way the replay holds 160 MB to the
    end of the log; with ``max_open_bytes`` 16 MB it refuses the rest, says so in one stderr line,
    peaks >= 100 MB lower, and folds the valid episode the same."""
    path = tmp_path / "flood.leafelog.gz"
    write_events(path, [*flood(160, 1_000_000), *make_episode("r1", "r1-ok")], run_id="r1")
    assert path.stat().st_size < 2 * 2**20
    common = [
        "--from",
        str(path),
        "--model",
        str(tiny_dir),
        "--materializer",
        "leafe",
        "--log-level",
        "error",
    ]
    free = tmp_path / "free.toml"
    free.write_text("max_open_bytes = 1_000_000_000_000\n[options]\nrehearsal_fraction = 1.0\n")
    code, err, rss_free = leafe_replay(
        tmp_path, *common, "--config", str(free), "--out", str(tmp_path / "a")
    )
    assert code == 0, err
    capped = tmp_path / "capped.toml"
    capped.write_text("max_open_bytes = 16_000_000\n[options]\nrehearsal_fraction = 1.0\n")
    code, err, rss_capped = leafe_replay(
        tmp_path, *common, "--config", str(capped), "--out", str(tmp_path / "b")
    )
    assert code == 0
    line = one_line(err)
    assert "open-episode caps" in line and "max_open_bytes = 16,000,000" in line
    assert rss_free - rss_capped > 100 * 1024, (rss_free, rss_capped)
    valid = fake_episode_id("r1-ok", "actor-0")
    ok = sorted(s.sample_id for s in iter_samples(tmp_path / "b") if s.episode_id == valid)
    assert ok and ok == sorted(
        s.sample_id for s in iter_samples(tmp_path / "a") if s.episode_id == valid
    )
