"""``bench/gpu_smoke.py``'s *wire* stage on CPU: weight sync's sender pushes an export over gloo to
``leafe inference`` (the tiny model) in SGLang's place; the engine then serves the pushed version
and its logprobs are those of the pushed weights. On a GPU the same stage runs over NCCL against
SGLang (with two GPUs or more)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu_smoke import Report, wire_push
from leafe.learner.model_io import export_weights, load_model
from leafe.services.inference.server import InferenceConfig, InferenceServer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_the_wire_stage_pushes_over_gloo_to_the_cpu_engine(
    tiny_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    version = "v000001"
    state = {k: v * 1.5 for k, v in load_model(tiny_dir).state_dict().items()}
    export_weights(state, tmp_path / version, config_dir=tiny_dir, version=version)
    config = InferenceConfig(
        model=str(tiny_dir), port=0, max_batch=4, threads=1, weights_root=str(tmp_path)
    )
    report = Report()
    async with InferenceServer(config) as server:
        await wire_push(
            server.url,
            tmp_path / version,
            version,
            "gloo",
            0.05,
            report,
            tokenizer_dir=tiny_dir,
            device="cpu",
        )
    assert report.checks == {
        "wire_push_succeeded": True,
        "wire_served_weight_version": True,
        "wire_logprobs_match_pushed_weights": True,
    }, report
    figures = report.figures["wire_push"]
    assert figures["backend"] == "gloo" and figures["bytes"] > 0 and figures["push_s"] > 0
