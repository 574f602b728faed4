"""``leafe eval`` end to end: the real CLI with the tiny model on Sokoban, two inference server
processes per model, two models side by side, and the eval episodes published to a real
nats-server."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from pathlib import Path

import msgspec
import pytest

from leafe.learner.model_io import export_weights, load_model, tiny_model_dir
from leafe.protocol.events import EpisodeFinished, EpisodeStarted, Step
from leafe.services.cli import main as leafe
from leafe.services.eval.main import EvalReport
from leafe.services.inference.local import start_in_thread
from leafe.services.inference.server import InferenceConfig

pytestmark = pytest.mark.integration


def _table(markdown: str) -> dict[str, list[float]]:
    """The Pass@k rows of eval.md's table: model -> values in %, after checking the header."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert lines[0] == "| model | Pass@1 | Pass@2 |" and set(lines[1]) <= set("|-")
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = [float(c) for c in cells[1:]]
    return rows


async def _published(nats_url: str, run_id: str) -> list[object]:
    from leafe.services.bus import connect
    from leafe.services.replayer.replay import stream_events

    nc = await connect(nats_url, name="test-eval")
    try:
        return [e async for e in stream_events(nc.jetstream(), run_id)]
    finally:
        await nc.close()


def test_eval_cli_compares_two_models_writes_files_and_publishes(
    tmp_path: Path, nats_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two models (tiny, and an exported weight version of it) x 2 tasks x 2 samples, k = 1,2:
    eval.json decodes with a result per model (the export's manifest version stamped on its steps),
    eval.md's table parses with a row per model, passk.png is a PNG, the table is printed, and every
    eval episode (8, mode eval, finished) is in the run's log."""
    weights = tmp_path / "weights" / "v000001"
    export_weights(
        load_model(tiny_model_dir()).state_dict(),
        weights,
        config_dir=tiny_model_dir(),
        version="v1",
    )
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--model",
        "tiny",
        "--model",
        str(weights),
        "--env",
        "sokoban",
        "--split",
        "test",
        "--tasks",
        "2",
        "--samples",
        "2",
        "--k",
        "1,2,4",
        "--concurrency",
        "4",
        "--servers",
        "2",
        "--rollout-option",
        "horizon=6",
        "--out",
        str(out),
        "--nats",
        nats_url,
        "--run",
        run_id,
        "--no-progress",
    ]
    assert leafe(argv) == 0
    printed = capsys.readouterr()
    assert "k > n=2 left out: [4]" in printed.err

    report = msgspec.json.decode((out / "eval.json").read_bytes(), type=EvalReport)
    assert [r.label for r in report.results] == ["tiny", "v000001"]
    assert report.ks == [1, 2] and report.task_ids == ["sokoban/test/0", "sokoban/test/1"]
    for r in report.results:
        assert r.episodes == 4 and all(len(v) == 2 for v in r.successes.values())
        assert sorted(r.passk) == [1, 2] and 0.0 <= r.passk[1] <= r.passk[2] <= 1.0
        assert 1 <= r.mean_steps <= 6 and r.mean_prompt_tokens > 0
    assert report.results[1].weight_version == "v1" and report.results[1].policy_versions == ["v1"]

    markdown = (out / "eval.md").read_text()
    rows = _table(markdown)
    assert list(rows) == ["tiny", "v000001"]
    for r in report.results:
        assert rows[r.label] == [round(100 * r.passk[k], 1) for k in (1, 2)]
        assert re.search(rf"- `{r.label}` \(weight version \w+\): \d/4 rollouts solved", markdown)
        assert r.reproducible == "yes", "an in-process CPU server honours seeds"
    assert markdown.count("reproducible: yes") == 2
    assert "| model | Pass@1 | Pass@2 |" in printed.out
    assert (out / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if (
        importlib.util.find_spec("tensorboard") is not None
    ):  # each model's Pass@k curve in TensorBoard
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for r in report.results:
            acc = EventAccumulator(str(out / "tensorboard" / r.label))
            acc.Reload()
            curve = [(e.step, e.value) for e in acc.Scalars("pass@k")]
            assert curve == [(k, pytest.approx(r.passk[k])) for k in (1, 2)]

    events = asyncio.run(_published(nats_url, run_id))
    starts = [e for e in events if isinstance(e, EpisodeStarted)]
    assert len(starts) == 8 and {e.mode for e in starts} == {"eval"}
    assert sum(isinstance(e, EpisodeFinished) for e in events) == 8
    assert f"{run_id}-v000001-sokoban-test-1-x1.a1@eval" in {e.episode_id for e in starts}
    assert {e.policy_version for e in events if isinstance(e, Step)} == {"default", "v1"}


def test_eval_cli_against_a_running_engine_uses_its_tokenizer(tmp_path: Path) -> None:
    """--engine URL evaluates a running server once, under --label, with the tokenizer named by the
    server's /model_info (a local directory here), and reports the server's weight version."""
    server = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1, weight_version="w9"))
    try:
        argv = [
            "eval",
            "--engine",
            server.url,
            "--label",
            "served",
            "--env",
            "sokoban",
            "--tasks",
            "1",
            "--samples",
            "2",
            "--k",
            "1,2",
            "--rollout-option",
            "horizon=2",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
        assert leafe(argv) == 0
    finally:
        server.stop()
    report = msgspec.json.decode((tmp_path / "eval.json").read_bytes(), type=EvalReport)
    [result] = report.results
    assert (result.label, result.weight_version, result.episodes) == ("served", "w9", 2)
    assert result.reproducible == "unknown", "an external engine's seed handling was not stated"
    assert "reproducible: unknown" in (tmp_path / "eval.md").read_text()
    assert result.mean_steps <= 2 and _table((tmp_path / "eval.md").read_text()).keys() == {
        "served"
    }


def test_eval_cli_rejects_bad_input_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model path that is not an HF directory and too many tasks for the split fail with exit 2
    and a message naming the value; --nats without --run is a usage error."""
    base = ["eval", "--env", "sokoban", "--samples", "1", "--k", "1", "--out", str(tmp_path)]
    assert leafe([*base, "--model", str(tmp_path / "nope"), "--tasks", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert leafe([*base, "--model", "tiny", "--tasks", "100000"]) == 2
    assert "--tasks 100000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        leafe([*base, "--model", "tiny", "--nats", "nats://127.0.0.1:1"])
    assert "--nats needs --run" in capsys.readouterr().err
