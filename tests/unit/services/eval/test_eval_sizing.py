"""``leafe eval`` sizing (services/eval/main.py): how many server processes and rollouts in flight
by default, and the progress line printed away from a terminal (services/eval/progress.py)."""

from __future__ import annotations

import pytest

from leafe.actors.episode import EpisodeSummary
from leafe.services.eval import main as leafe_eval
from leafe.services.eval import progress as eval_progress
from leafe.services.eval.progress import EvalProgress


def _args(argv: list[str]) -> object:
    args = leafe_eval._parser().parse_args(["--out", "/tmp/x", *argv])
    leafe_eval._size_servers(args)
    return args


def test_one_server_per_free_core_and_16_rollouts_per_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "leafe.services.threads.free_cores", lambda: (3, "3 usable cores, 0.0 busy")
    )
    args = _args(["--model", "tiny"])
    assert (args.servers, args.concurrency) == (3, 48)  # type: ignore[attr-defined]
    args = _args(["--model", "tiny", "--servers", "2", "--concurrency", "5"])
    assert (args.servers, args.concurrency) == (2, 5)  # type: ignore[attr-defined]


def test_in_process_and_engine_urls_set_the_server_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("leafe.services.threads.free_cores", lambda: (8, "8 usable cores"))
    assert _args(["--model", "tiny", "--in-process"]).servers == 1  # type: ignore[attr-defined]
    args = _args(["--engine", "http://a:1, http://b:2,"])
    assert (args.servers, args.concurrency) == (2, 32)  # type: ignore[attr-defined]


def test_away_from_a_terminal_progress_is_a_plain_line_at_most_every_period(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [100.0]
    monkeypatch.setattr(eval_progress.time, "monotonic", lambda: clock[0])
    advance = EvalProgress(True, live=False).track("base", total=3)
    done = EpisodeSummary(
        episode_id="e",
        success=True,
        branches=1,
        actions=1,
        reflections=0,
        replay_steps=0,
        parse_failures=0,
        events=3,
    )
    advance(None, done)  # type: ignore[arg-type]
    clock[0] += eval_progress.LINE_EVERY_S
    advance(None, done)  # type: ignore[arg-type]
    advance(None, done)  # type: ignore[arg-type]  # the last one is always printed
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["base: 2/3 rollouts, 2 solved, 30 s", "base: 3/3 rollouts, 3 solved, 30 s"]
    assert EvalProgress(False, live=False).track("base", 3)(None, done) is None  # type: ignore[arg-type,func-returns-value]
