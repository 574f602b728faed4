"""The learner on two nodes: two torchrun agents on loopback form one job through c10d rendezvous
(the launch of deploy/base/learner.yaml's StatefulSet: ``torchrun --nnodes --rdzv-backend=c10d
--rdzv-endpoint --rdzv-id --max-restarts --no-python sh -c "exec leafe ..."``), one gloo rank each,
running the offline trainer (``leafe train``). Half the steps on 2 nodes with a DCP checkpoint, then
the rest resumed on 1 node and, separately, on 2 nodes (DCP reshards the FSDP state): both end with
the weights of one uninterrupted single-process run on the same data, within float tolerance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from leafe.learner.config import TrainConfig, train_preset
from leafe.learner.offline import train
from leafe.services.bus.nats_server import free_port
from leafe.services.config import load_config
from tests.support.learner import assert_same_weights, make_samples, write_shards

# 40-100 s on 2 cores: five torchrun agents and their workers, each importing torch.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

REPO = Path(__file__).parents[2]
STEPS = 4
# total_steps is fixed, so stopping after 2 steps (--max-steps) leaves the LR schedule of a full
# run.
CONFIG = f"""
epochs = 1
[trainer]
checkpoint_every = 2
push_every = 0
export_dtype = "fp32"
seed = 11
[trainer.optim]
lr = 1e-3
warmup_steps = 1
total_steps = {STEPS}
[trainer.batch]
global_batch = 6
micro_batch_tokens = 48
"""


def _launch(
    nodes: int, data: Path, model: Path, out: Path, cfg: Path, *extra: str
) -> set[tuple[int, int]]:
    """``nodes`` torchrun agents (one process each) started together, as the StatefulSet's pods are;
    returns the ``(rank, world_size)`` each worker logged at ``train.start``."""
    leafe = Path(sys.executable).parent / "leafe"
    inner = " ".join(
        [
            f"exec {leafe} train --data {data} --model {model} --out {out} --preset cpu --config "
            f"{cfg}",
            *extra,
        ]
    )
    rdzv = [
        f"--nnodes={nodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=multinode-{out.name}",
        "--max-restarts=0",
        "--no-python",
        "sh",
        "-c",
        inner,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *rdzv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(nodes)
    ]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    for i, (agent, text) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {i} of {nodes} failed:\n{text[-4000:]}"
    starts = [json.loads(x) for text in outputs for x in text.splitlines() if '"train.start"' in x]
    return {(s["rank"], s["world_size"]) for s in starts}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def test_checkpoint_on_two_nodes_resumes_on_one_and_on_two(
    dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """2 nodes train steps 1-2 and checkpoint; resumed on 1 node and on 2 nodes, steps 3-4 give the
    losses and final weights of a single uninterrupted process."""
    data = write_shards(tmp_path / "data", make_samples(6 * STEPS, kinds=("cf", "reh")))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG, encoding="utf-8")

    half = tmp_path / "half"
    assert _launch(2, data, tiny_dir, half, cfg, "--max-steps", "2") == {(0, 2), (1, 2)}
    assert (half / "checkpoints" / "latest").read_text() == "step_00000002"
    assert [m["step"] for m in _metrics(half)] == [1, 2]
    on_one, on_two = tmp_path / "on_one", tmp_path / "on_two"
    shutil.copytree(half, on_one)
    shutil.copytree(half, on_two)
    assert _launch(1, data, tiny_dir, on_one, cfg) == {(0, 1)}
    assert _launch(2, data, tiny_dir, on_two, cfg) == {(0, 2), (1, 2)}

    ref = tmp_path / "reference"
    result = train(
        load_config(TrainConfig, preset=train_preset("cpu"), files=[cfg]),
        data,
        str(tiny_dir),
        ref,
        dist_env,
    )
    assert result.steps == STEPS
    expected = _metrics(ref)
    lr_sum = sum(m["lr"] for m in expected)
    for out in (on_one, on_two):
        got = _metrics(out)  # the copied half's steps 1-2, then the resumed 3-4
        assert [m["step"] for m in got] == list(range(1, STEPS + 1)), out.name
        for a, b in zip(expected, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (out.name, a["step"])
            assert b["samples"] == a["samples"], (out.name, a["step"])
        w_ref, w_out = _weights(ref), _weights(out)
        gap = max(float((w_ref[k] - w_out[k]).abs().max()) for k in w_ref)
        print(f"\n{out.name}: final weights within {gap:.2e} of the single-process run")
        assert_same_weights(w_ref, w_out, max_lr=lr_sum)
