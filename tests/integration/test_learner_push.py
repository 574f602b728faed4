"""Weight push end to end: the online learner exports and announces a version, ``leafe weight-sync``
follows ``LEAFE_WEIGHTS`` and reloads two real CPU inference servers (services/inference/server.py);
both then report the new version and generate differently."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest

from leafe.actors.client import SGLangClient
from leafe.actors.engine import SamplingParams
from leafe.learner.checkpoint import Progress
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainerConfig
from leafe.learner.executor import Executor
from leafe.learner.trainer import Trainer
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.learner.service import OnlineLearner
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig
from tests.support.learner import make_sample, publish_samples

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture
async def servers(tiny_dir: Path, tmp_path: Path) -> AsyncIterator[list[str]]:
    """URLs of two CPU inference servers on the tiny model (in this event loop; engines in
    threads)."""
    async with AsyncExitStack() as stack:
        cfg = InferenceConfig(model=str(tiny_dir), port=0, threads=1, weights_root=str(tmp_path))
        started = [await stack.enter_async_context(InferenceServer(cfg)) for _ in range(2)]
        yield [s.url for s in started]


async def _outputs(urls: list[str], prompt: list[int]) -> list[tuple[str, list[int]]]:
    out = []
    for url in urls:
        async with SGLangClient(url) as client:
            [c] = await client.generate(prompt, GREEDY)
            out.append((c.weight_version, c.output_ids))
    return out


async def _served(sync: WeightSync, urls: list[str], version: str) -> None:
    for _ in range(300):
        if all(sync.served.get(u) == version for u in urls):
            return
        await asyncio.sleep(0.1)


async def test_pushes_reach_every_inference_server(
    nats_url: str, run_id: str, dist_env, tiny_dir: Path, tmp_path: Path, servers: list[str]
) -> None:
    """Two steps with a push after each: after each push weight-sync reports success for both
    servers; each server's /model_info says the new version, its generations carry it, and its
    greedy output changed. A third, unreachable server does not block the others and keeps
    weight-sync from claiming convergence. (The second push checks that a reload on top of a reload
    works.)"""
    urls = servers
    base = make_sample(0, run_id=run_id, prompt_len=12, completion_len=4)
    samples = [msgspec.structs.replace(base, sample_id=f"{run_id}.{i}") for i in range(16)]
    outputs = [await _outputs(urls, base.prompt_ids)]
    assert {v for v, _ in outputs[0]} == {"default"}

    sync = WeightSync(
        WeightSyncConfig(servers=[*urls, "http://127.0.0.1:9"], reconcile_interval_s=0.5),
        run_id=run_id,
    )
    stop_sync = asyncio.Event()
    sync_task = asyncio.create_task(sync.run(nats_url, stop_sync))
    cfg = LearnerConfig(
        trainer=TrainerConfig(
            optim=OptimConfig(lr=5e-2), batch=BatchConfig(global_batch=8), push_every=1
        ),
        max_batch_wait_s=0.5,
        stop_after_steps=1,
    )
    trainer = Trainer(cfg.trainer, tiny_dir, dist_env)
    progress = Progress()
    for k, version in enumerate(["v000001", "v000002"]):
        await publish_samples(nats_url, samples[8 * k : 8 * k + 8])
        learner = OnlineLearner(
            cfg,
            Executor(trainer, tmp_path / "ckpt"),
            progress,
            run_id=run_id,
            nats=nats_url,
            store=tmp_path / "store",
            base_model="tiny",
        )
        progress = await asyncio.wait_for(learner.run(asyncio.Event()), 120)
        assert progress.version_index == k + 1
        await _served(sync, urls, version)
        assert all(sync.results[u].success and sync.results[u].version == version for u in urls), (
            sync.results
        )
        for url in urls:
            async with SGLangClient(url) as client:
                assert await client.weight_version() == version
        outputs.append(await _outputs(urls, base.prompt_ids))
        assert {v for v, _ in outputs[-1]} == {version}
        assert all(a[1] != b[1] for a, b in zip(outputs[-1], outputs[-2], strict=True))
    assert not sync.converged()  # the unreachable server is not at v000002
    stop_sync.set()
    await asyncio.wait_for(sync_task, 30)
    assert (tmp_path / "store" / ".in_use").is_dir()
