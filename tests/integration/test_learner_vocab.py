"""The online learner's consumer against a real nats-server: a sample holding a token id the model
has no embedding row for (negative, or past its vocabulary) is dead-lettered with the reason, never
trained on, and the valid samples around it train as usual."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from leafe.learner.checkpoint import Progress
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from leafe.learner.executor import Executor
from leafe.learner.trainer import StepStats, Trainer
from leafe.protocol.subjects import DEAD_LETTERS, SAMPLES, dead_letter_subject
from leafe.services.bus import connect, read_stream
from leafe.services.bus.dead_letters import ERROR_HEADER, ORIGINAL_SEQ_HEADER, letters_filter
from leafe.services.learner.service import OnlineLearner
from tests.support.learner import make_sample, publish_samples

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


async def test_samples_with_ids_outside_the_vocabulary_are_dead_lettered_not_trained(
    nats_url: str, run_id: str, dist_env: object, tiny_dir: Path, tmp_path: Path
) -> None:
    """Today the learner consumes them and its forward raises; now each is dead-lettered naming the
    id."""
    ok = [make_sample(i, run_id=run_id) for i in range(8)]
    neg = make_sample(50, run_id=run_id)
    neg = msgspec.structs.replace(neg, prompt_ids=[-1, *neg.prompt_ids[1:]])
    huge = make_sample(51, run_id=run_id)
    huge = msgspec.structs.replace(huge, completion_ids=[*huge.completion_ids[:-1], 2**40])
    await publish_samples(nats_url, [*ok[:4], neg, huge, *ok[4:]])
    trainer = Trainer(
        TrainerConfig(optim=OptimConfig(lr=1e-3), batch=BatchConfig(global_batch=8)),
        tiny_dir,
        dist_env,
    )
    trained: list[str] = []

    def on_step(stats: StepStats, ids: list[str], _: Progress) -> None:
        trained.extend(ids)

    cfg = LearnerConfig(
        trainer=trainer.config, ack_wait_s=6.0, max_batch_wait_s=0.5, stop_after_steps=1
    )
    learner = OnlineLearner(
        cfg,
        Executor(trainer, tmp_path / "ckpt"),
        Progress(),
        run_id=run_id,
        nats=nats_url,
        store=tmp_path / "store",
        base_model="tiny",
        on_step=on_step,
    )
    await asyncio.wait_for(learner.run(asyncio.Event()), 240)
    assert sorted(trained) == sorted(s.sample_id for s in ok)
    nc = await connect(nats_url)
    subject = letters_filter(dead_letter_subject(run_id, SAMPLES.name))
    letters = [
        m
        async for m in read_stream(nc.jetstream(), stream=DEAD_LETTERS.name, filter_subject=subject)
    ]
    await nc.close()
    reasons = {int(m.headers[ORIGINAL_SEQ_HEADER]): m.headers[ERROR_HEADER] for m in letters}
    vocab = trainer.vocab_size
    assert len(reasons) == 2, reasons
    assert sorted(reasons.values()) == sorted(
        [
            f"completion token id {2**40} is outside the model's vocabulary (0..{vocab - 1})",
            f"prompt token id -1 is outside the model's vocabulary (0..{vocab - 1})",
        ]
    )
