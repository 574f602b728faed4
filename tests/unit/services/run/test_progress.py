"""Progress of ``leafe run`` (services/run/progress.py, stages._display): the concise status line
for non-terminal output, the learner's figures read from its /metrics, and one line per change,
never a table."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from rich.console import Console

from leafe.services.bus.nats_server import free_port
from leafe.services.metrics import LearnerMetrics, serve_metrics
from leafe.services.run import stages
from leafe.services.run.context import RunContext
from leafe.services.run.presets import RunConfig
from leafe.services.run.progress import RunProgress

pytestmark = pytest.mark.anyio


def _progress() -> RunProgress:
    """A progress as the stream followers and a learner scrape leave it mid-run."""
    p = RunProgress(run_id="r1")
    p.episodes_started, p.episodes_finished, p.successes = (
        {"explore": 8},
        {"explore": 5},
        {"explore": 1},
    )
    p.steps, p.parse_failures = 214, 66
    p.reflections, p.rollbacks, p.branches = 12, 12, 12
    p.samples = {"reh": 9, "cf": 3}
    p.learner_step, p.learner_loss, p.weights_version = 4, 1.9237, "v000004"
    return p


def test_status_line_reads_as_one_log_line() -> None:
    """Stage and clock, then every counter on one line."""
    line = _progress().status_line("exploring", 192.7)
    assert line == (
        "[exploring 03:12] episodes 5/8 (1 ok) steps 214 (31% unparseable) refl/rb/br 12/12/12 "
        "samples cf=3 reh=9 learner step 4 loss 1.92 weights v000004"
    )


def test_status_line_carries_the_plan_inside_its_brackets() -> None:
    """With a plan the line says, after stage and clock, the work done of planned and the time left
    (``RunPlan.line``), and the counters follow as before."""
    line = _progress().status_line(
        "exploring round 0", 192.7, "5/8 episodes, ~01:40 left | run ~04:30 left"
    )
    assert line.startswith(
        "[exploring round 0 03:12 | 5/8 episodes, ~01:40 left | run ~04:30 left] episodes"
    )


def test_status_line_names_modes_when_several_and_shows_hours() -> None:
    """With explore and eval episodes each mode is named; past an hour the clock shows hours; before
    any step or loss the line says so instead of inventing figures."""
    p = RunProgress(run_id="r1")
    p.episodes_started, p.episodes_finished, p.successes = (
        {"explore": 2, "eval": 4},
        {"eval": 4},
        {"eval": 1},
    )
    assert p.status_line("evaluating before", 3725) == (
        "[evaluating before 1:02:05] episodes eval 4/4 (1 ok), explore 0/2 (0 ok) steps 0 "
        "refl/rb/br 0/0/0 samples 0 learner step 0 loss - weights default"
    )


async def test_learner_figures_come_from_its_metrics() -> None:
    """Step, total loss and consumed samples sequence are read from the learner's /metrics; when it
    does not answer (restarting) the last figures stay."""
    metrics = LearnerMetrics()
    metrics.loss.labels(term="total").set(0.75)
    metrics.loss.labels(term="cf").set(9.0)
    metrics.progress(step=6, samples_seq=57)
    port = free_port()
    server = serve_metrics(port, metrics.registry, "127.0.0.1")
    assert server is not None
    p = RunProgress(run_id="r1")
    try:
        assert await p.read_learner(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.close()
    assert (p.learner_step, p.learner_loss, p.learner_samples_seq) == (6, 0.75, 57)
    assert not await p.read_learner(f"http://127.0.0.1:{port}/metrics")
    assert (p.learner_step, p.learner_loss, p.learner_samples_seq) == (6, 0.75, 57)


async def test_non_terminal_output_is_one_line_per_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a terminal the display prints a status line when the stage or a counter changed,
    nothing while they stay the same, and never a table."""
    monkeypatch.setattr(stages, "LINE_EVERY_S", 0.01)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80, soft_wrap=True)
    ctx = RunContext(
        config=RunConfig(runs_dir=str(tmp_path)), console=console, stop=asyncio.Event(), live=False
    )
    ctx.progress, ctx.stage = _progress(), "exploring"

    async def lines(n: int) -> list[str]:
        for _ in range(500):
            if len(got := out.getvalue().splitlines()) >= n:
                return got
            await asyncio.sleep(0.01)
        raise AssertionError(f"expected {n} lines, got {out.getvalue()!r}")

    display = asyncio.create_task(stages._display(ctx))
    try:
        await lines(1)
        await asyncio.sleep(0.2)  # ~20 more rounds with nothing new
        assert len(out.getvalue().splitlines()) == 1
        ctx.progress.steps += 1
        await lines(2)
        ctx.stage = "draining"
        got = await lines(3)
    finally:
        display.cancel()
        await asyncio.gather(display, return_exceptions=True)
    assert [line.split(" ")[0] for line in got[:3]] == ["[exploring", "[exploring", "[draining"]
    assert "steps 215" in got[1] and "learner step 4 loss 1.92 weights v000004" in got[2]
    assert not any(ch in out.getvalue() for ch in "┃━│─┏┗")


async def test_the_learners_clipped_partial_and_skipped_steps_are_counted() -> None:
    """Issue 62: the run reads from the learner's /metrics how many steps it took, how many of them
    were partial, gradient-clipped or dual-clipped, and how many batches it skipped."""
    metrics = LearnerMetrics()
    metrics.steps.inc(5)
    metrics.flagged_steps.labels(why="grad_clipped").inc(2)
    metrics.flagged_steps.labels(why="dual_clipped").inc()
    metrics.skipped_batches.inc(3)
    port = free_port()
    server = serve_metrics(port, metrics.registry, "127.0.0.1")
    assert server is not None
    p = RunProgress(run_id="r1")
    try:
        assert await p.read_learner(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.close()
    assert p.step_counts == {
        "taken": 5,
        "partial": 0,
        "grad_clipped": 2,
        "dual_clipped": 1,
        "skipped": 3,
    }
