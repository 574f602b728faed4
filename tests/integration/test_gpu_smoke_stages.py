"""``bench/gpu_smoke.py``'s stages on CPU, so the GPU check does not rot between GPU runs: explore
through the actor code and sglang-router 0.3.2 against ``leafe inference`` (the tiny model) in
SGLang's place, fold the events into a dataset, train a few steps (CPU, gloo, instead of NCCL), push
the export under load (generations going, /ready, /readiness and deploy's liveness probe checked
throughout) and verify the served logprobs against a forward pass of the new weights."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_smoke import Report, build_dataset, explore, parameter_count, push_and_verify
from bench.gpu_smoke_router import router_metrics
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.run.router import open_router

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.slow]


async def test_gpu_smoke_stages_on_cpu(tiny_dir: Path, tmp_path: Path) -> None:
    """Every check of the smoke run passes with the CPU server behind sglang-router 0.3.2 (the dev
    extra's), and the figures are filled in: exploration and the push's generations through the
    router, the router's /metrics with the dashboard's series, and deploy's SGLang liveness probe
    alive during the reload (the engine lock held) without a 503."""
    report = Report()
    config = InferenceConfig(
        model=str(tiny_dir), port=0, max_batch=4, threads=1, weights_root=str(tmp_path)
    )
    async with InferenceServer(config) as server:
        router = await open_router([server.url], tmp_path / "router.log", health_interval_s=2)
        try:
            await _stages(server.url, router.url, tiny_dir, tmp_path, report)
            metrics_port = int(router.metrics_url.rsplit(":", 1)[1].split("/")[0])
            report.checks["router_metrics"] = await asyncio.to_thread(router_metrics, metrics_port)
        finally:
            await router.stop(10.0)
    assert report.checks and all(report.checks.values()), report
    assert "served_logprobs_not_base_weights" in report.checks, report.notes
    assert "router_completion_weight_version" in report.checks
    assert report.figures["explore"]["output_tokens"] > 0
    reload = report.figures["reload_under_load"]
    for probe in ("sglang /ready", "router /readiness", "sglang liveness"):
        assert reload[probe]["probes"] > 0 and reload[probe]["status_503"] == 0, probe
    assert reload["generations"] > 0 and reload["generation_failures"] == 0
    assert (
        report.checks["health_answered_throughout_reload"]
        and report.checks["generations_survived_reload"]
    )
    assert parameter_count(tmp_path / "train" / "final") > 0


async def _stages(
    url: str, router_url: str, tiny_dir: Path, tmp_path: Path, report: Report
) -> None:
    """explore (through the router), build the dataset, train 3 steps on CPU, push and verify."""
    events = await explore(router_url, tiny_dir, 2, report)
    assert build_dataset(events, tiny_dir, tmp_path / "data") > 0
    paths = [
        "--data",
        str(tmp_path / "data"),
        "--model",
        str(tiny_dir),
        "--out",
        str(tmp_path / "train"),
    ]
    flags = (
        "--preset cpu --max-steps 3 --global-batch 4 --lr 1e-2 --export-dtype fp32 --no-resume"
    ).split()
    train = [sys.executable, "-m", "leafe.services.learner.train", *paths, *flags]
    done = await asyncio.to_thread(
        subprocess.run, train, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    export = tmp_path / "train" / "final"
    await push_and_verify(
        url, tiny_dir, export, "smoke-step3", 0.05, report, device="cpu", router_url=router_url
    )
