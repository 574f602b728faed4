"""The online learner (services/learner/service.py) against a real nats-server: training from the
samples stream in sequence order, staleness and kind filtering, checkpoint-then-ack, pushes with
``WeightsPublished``, and a crash + restart that neither loses nor double-trains a sample."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from leafe.learner.checkpoint import Progress, latest_checkpoint, load_latest
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from leafe.learner.executor import Executor
from leafe.learner.model_io import verify_manifest
from leafe.learner.trainer import StepStats, Trainer
from leafe.protocol import decode_weights, weights_subject
from leafe.protocol.subjects import SAMPLES, WEIGHTS
from leafe.services.bus import connect
from leafe.services.learner.service import OnlineLearner
from tests.support.acks import settled_counts
from tests.support.learner import make_sample, publish_samples

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


class Crash(Exception):
    """Stands in for a process dying between two steps."""


def _cfg(**kw: object) -> LearnerConfig:
    trainer = TrainerConfig(
        optim=OptimConfig(lr=1e-3),
        batch=BatchConfig(global_batch=8),
        checkpoint_every=int(kw.pop("checkpoint_every", 1)),  # type: ignore[call-overload]
        push_every=int(kw.pop("push_every", 0)),  # type: ignore[call-overload]
        retain_versions=1,
    )
    return LearnerConfig(trainer=trainer, ack_wait_s=6.0, max_batch_wait_s=0.5, **kw)  # type: ignore[arg-type]


def _learner(
    cfg: LearnerConfig,
    trainer: Trainer,
    progress: Progress,
    tmp: Path,
    url: str,
    run: str,
    log: list[tuple[StepStats, list[str]]],
    crash_at: int = 0,
) -> OnlineLearner:
    def on_step(stats: StepStats, ids: list[str], _: Progress) -> None:
        log.append((stats, ids))
        if stats.step == crash_at:
            raise Crash(f"simulated crash after step {stats.step}")

    executor = Executor(trainer, tmp / "ckpt", keep_checkpoints=2)
    return OnlineLearner(
        cfg,
        executor,
        progress,
        run_id=run,
        nats=url,
        store=tmp / "store",
        base_model="tiny",
        on_step=on_step,
    )


async def test_trains_in_order_filters_pushes_and_acks(
    nats_url: str, run_id: str, dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """Fresh samples are trained once each; stale (lag > 1) and untrained-kind samples are consumed
    but dropped; a learner resumed at version 3 re-exports v000003 on start, pushes v000004 at step
    2 and v000005 when it stops after step 3 (the announcement's manifest verifies; older versions
    are pruned with retain 1); after the final checkpoint nothing is left unacknowledged."""
    fresh = [
        make_sample(i, kind="cf" if i % 2 else "reh", policy_version="v000003", run_id=run_id)
        for i in range(24)
    ]
    stale = [make_sample(100 + i, policy_version="v000001", run_id=run_id) for i in range(4)]
    other = [make_sample(200 + i, kind="grpo", run_id=run_id) for i in range(2)]
    await publish_samples(nats_url, fresh[:10] + stale + other + fresh[10:])
    cfg = _cfg(push_every=2, max_policy_lag=1, stop_after_steps=3)
    log: list[tuple[StepStats, list[str]]] = []
    trainer = Trainer(cfg.trainer, tiny_dir, dist_env)
    learner = _learner(cfg, trainer, Progress(version_index=3), tmp_path, nats_url, run_id, log)
    progress = await asyncio.wait_for(learner.run(asyncio.Event()), 240)

    trained = [i for _, ids in log for i in ids]
    assert sorted(trained) == sorted(s.sample_id for s in fresh)
    assert [s.step for s, _ in log] == [1, 2, 3]
    # v000004 pushed at step 2 (push_every), v000005 at the stop after step 3 (push_on_stop).
    assert (progress.step, progress.samples_dropped, progress.version_index) == (3, 6, 5)
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.name == "step_00000003"

    nc = await connect(nats_url)
    js = nc.jetstream()
    raw = await js.get_last_msg(WEIGHTS.name, weights_subject(run_id))
    event = decode_weights(raw.data)
    assert (event.version, event.learner_step, event.event_id) == (
        "v000005",
        3,
        f"weights.{run_id}.v000005",
    )
    assert verify_manifest(Path(event.uri), event.manifest_sha256) is not None
    assert sorted(p.name for p in (tmp_path / "store").iterdir() if p.name.startswith("v")) == [
        "v000005"
    ]
    assert await settled_counts(js, SAMPLES.name, f"learner-{run_id}") == (0, 0)
    info = await js.consumer_info(SAMPLES.name, f"learner-{run_id}")
    assert info.ack_floor.stream_seq == progress.samples_seq
    await nc.close()


async def test_crash_and_restart_train_every_sample_once_relative_to_the_checkpoint(
    nats_url: str, run_id: str, dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """A learner checkpointing every 2 steps dies after step 3. The restarted one resumes from the
    step-2 checkpoint: it trains step 3 on the same samples with the same loss as before the crash
    (those weights were lost), then the rest; over both lives every sample is trained exactly once
    relative to the checkpointed weights."""
    samples = [make_sample(i, kind="cf" if i % 3 else "reh", run_id=run_id) for i in range(40)]
    await publish_samples(nats_url, samples)
    cfg = _cfg(checkpoint_every=2)
    before: list[tuple[StepStats, list[str]]] = []
    first = _learner(
        cfg,
        Trainer(cfg.trainer, tiny_dir, dist_env),
        Progress(),
        tmp_path,
        nats_url,
        run_id,
        before,
        crash_at=3,
    )
    with pytest.raises(Crash):
        await asyncio.wait_for(first.run(asyncio.Event()), 240)

    trainer = Trainer(cfg.trainer, tiny_dir, dist_env)
    progress = load_latest(tmp_path / "ckpt", trainer)
    assert progress is not None and progress.step == 2
    after: list[tuple[StepStats, list[str]]] = []
    second = _learner(
        _cfg(checkpoint_every=2, stop_after_steps=3),
        trainer,
        progress,
        tmp_path,
        nats_url,
        run_id,
        after,
    )
    await asyncio.wait_for(second.run(asyncio.Event()), 240)

    assert [s.step for s, _ in after] == [3, 4, 5]
    assert after[0][1] == before[2][1]
    assert after[0][0].loss == pytest.approx(before[2][0].loss, abs=1e-6)
    kept = [i for _, ids in before[:2] for i in ids] + [i for _, ids in after for i in ids]
    assert sorted(kept) == sorted(s.sample_id for s in samples)
