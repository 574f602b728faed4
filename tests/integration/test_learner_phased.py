"""The online learner under ``leafe run``'s control file (services/learner/control.py) against a
real nats-server: a phased learner trains nothing until its samples are released, then the same
batches whatever order they reached the stream in; threads follow the file."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from nats.js.errors import NotFoundError

from leafe.learner.checkpoint import Progress
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from leafe.learner.executor import Executor
from leafe.learner.trainer import StepStats, Trainer
from leafe.protocol.subjects import SAMPLES, learner_durable
from leafe.services.bus import connect
from leafe.services.learner.control import ControlFile, LearnerControl, apply_threads, write_control
from leafe.services.learner.service import OnlineLearner
from tests.support.learner import make_sample, publish_samples

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


def _cfg() -> LearnerConfig:
    trainer = TrainerConfig(
        optim=OptimConfig(lr=1e-3),
        batch=BatchConfig(global_batch=8),
        checkpoint_every=1,
        push_every=1,
    )
    return LearnerConfig(trainer=trainer, ack_wait_s=6.0, max_batch_wait_s=0.5)


async def _delivered_seq(nats_url: str, run: str) -> int:
    """The learner consumer's last delivered sequence once nothing is pending (how leafe run
    releases)."""
    nc = await connect(nats_url)
    try:
        for _ in range(600):
            try:
                info = await nc.jetstream().consumer_info(SAMPLES.name, learner_durable(run, ""))
            except NotFoundError:  # the learner has not bound it yet
                info = None
            if info is not None and info.num_pending == 0 and info.delivered.stream_seq:
                return int(info.delivered.stream_seq)
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
    raise AssertionError("the learner was never delivered every sample")


async def _phased_run(
    nats_url: str,
    run: str,
    order: list[int],
    dist_env: object,
    tiny_dir: Path,
    tmp: Path,
    threads: int,
) -> tuple[list[tuple[int, list[str], float]], Progress, set[int]]:
    """Publish 10 samples in ``order`` to a phased learner, release them with ``threads`` torch
    threads; returns its steps (step, sample ids, loss), its final progress and the thread counts it
    trained with."""
    samples = [make_sample(i, kind="cf" if i % 3 else "reh", run_id=run) for i in range(10)]
    control = tmp / "control.json"
    write_control(control, LearnerControl(release_seq=0, threads=1))
    steps: list[tuple[int, list[str], float]] = []

    def on_step(stats: StepStats, ids: list[str], _: Progress) -> None:
        steps.append((stats.step, [i.removeprefix(f"{run}.") for i in ids], stats.loss))

    cfg = _cfg()
    learner = OnlineLearner(
        cfg,
        Executor(Trainer(cfg.trainer, tiny_dir, dist_env), tmp / "ckpt"),  # type: ignore[arg-type]
        Progress(),
        run_id=run,
        nats=nats_url,
        store=tmp / "store",
        base_model="tiny",
        on_step=on_step,
        control=ControlFile(control),
    )
    used: set[int] = set()
    submit = learner.executor.submit

    def spy(
        cmd: Any,
    ) -> Any:  # runs in the worker thread that trains, after the learner set its threads
        used.add(torch.get_num_threads())
        return submit(cmd)

    learner.executor.submit = spy  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    await publish_samples(nats_url, [samples[i] for i in order])
    release = await _delivered_seq(nats_url, run)
    await asyncio.sleep(
        1.5
    )  # three times max_batch_wait_s: a continuous learner would have trained
    assert steps == [] and learner.progress.samples_seq == 0
    write_control(control, LearnerControl(release_seq=release, threads=threads))
    for _ in range(600):
        if learner.progress.samples_seq >= release and learner.progress.version_index:
            break
        await asyncio.sleep(0.1)
    stop.set()
    progress = await asyncio.wait_for(task, 120)
    assert progress.samples_seq == release
    return steps, progress, used


async def test_a_phased_learner_waits_for_its_release_then_trains_the_same_steps_in_any_order(
    nats_url: str, run_id: str, dist_env: object, tiny_dir: Path, tmp_path: Path
) -> None:
    """Until released (``release_seq`` 0) the learner trains nothing although a partial batch waited
    past ``max_batch_wait_s``; released up to the last sample, it trains all 10 as a batch of 8 and
    one of 2 in sample-id order, with one push at the end (not one per step, as push_every = 1 would
    do while streaming), on the threads the file gives; two runs whose samples reached the stream in
    different orders, trained on 2 threads and on 1, take the same steps on the same samples with
    the same losses."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    runs = [(f"{run_id}-a", list(range(10)), 2), (f"{run_id}-b", [7, 3, 9, 0, 5, 1, 8, 2, 6, 4], 1)]
    (a, pa, ta), (b, pb, tb) = [
        await _phased_run(nats_url, run, order, dist_env, tiny_dir, tmp_path / run[-1], threads)
        for run, order, threads in runs
    ]
    assert (ta, tb) == ({2}, {1})
    assert [(step, ids) for step, ids, _ in a] == [
        (1, [f"s{i:05d}" for i in range(8)]),
        (2, ["s00008", "s00009"]),
    ]
    assert [(step, ids) for step, ids, _ in b] == [(step, ids) for step, ids, _ in a]
    assert [loss for *_, loss in b] == pytest.approx([loss for *_, loss in a], abs=1e-6)
    assert pa.version_index == pb.version_index == 1


def test_threads_are_set_in_the_thread_that_trains() -> None:
    """torch's thread count is per OS thread: ``apply_threads`` sets it where it is called (the
    learner calls it in the worker that runs the step), and 0 leaves it alone."""
    import torch

    seen: list[int] = []

    def work(n: int) -> None:
        apply_threads(n)
        seen.append(torch.get_num_threads())

    for n in (2, 0, 1):
        t = threading.Thread(target=work, args=(n,))
        t.start()
        t.join()
    assert seen[0] == 2 and seen[2] == 1
