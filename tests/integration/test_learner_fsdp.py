"""FSDP2 over 2 gloo ranks (``torchrun -m leafe.services.learner.train``) against the same run on 1
plain-python rank: same per-step losses and the same final weights, with uneven micro-batch shares
(dummy rows) included."""

from __future__ import annotations

import asyncio
import json
import os
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

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

# 7 samples per step over 2 ranks with a small token budget: ranks get unequal shares, some empty.
CONFIG = """
epochs = 1
[trainer]
checkpoint_every = 0
push_every = 0
export_dtype = "fp32"
seed = 5
[trainer.optim]
lr = 1e-3
warmup_steps = 1
[trainer.batch]
global_batch = 7
micro_batch_tokens = 40
"""


def _torchrun(
    data: Path, model: Path, out: Path, cfg_path: Path
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={free_port()}",
        "-m",
        "leafe.services.learner.train",
        "--data",
        str(data),
        "--model",
        str(model),
        "--out",
        str(out),
        "--preset",
        "cpu",
        "--config",
        str(cfg_path),
        "--no-resume",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        cmd,
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_two_ranks_match_one_rank(dist_env, tiny_dir: Path, tmp_path: Path) -> None:
    """torchrun with 2 gloo ranks and one plain-python rank give the same loss at every step and the
    same trained weights (fp32 exports), on batches whose micro-batch shares are uneven across
    ranks."""
    data = write_shards(tmp_path / "data", make_samples(21, kinds=("cf", "reh", "cf")))
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(CONFIG, encoding="utf-8")
    proc = _torchrun(data, tiny_dir, tmp_path / "two", cfg_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    cfg = load_config(TrainConfig, preset=train_preset("cpu"), files=[cfg_path])
    one = train(cfg, data, str(tiny_dir), tmp_path / "one", dist_env)
    assert one.steps == 3

    def metrics(d: Path) -> list[dict]:
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]

    m1, m2 = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in m2] == [1, 2, 3]
    assert any(m["micro_batches"] > 1 for m in m2)
    for a, b in zip(m1, m2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        for key in ("samples", "target_tokens", "real_tokens"):
            assert a[key] == b[key], key
    w1 = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert_same_weights(w1, w2, max_lr=sum(m["lr"] for m in m1))


ONLINE_CONFIG = """
max_batch_wait_s = 1.0
[trainer]
checkpoint_every = 1
push_every = 2
[trainer.batch]
global_batch = 8
micro_batch_tokens = 48
"""


@pytest.mark.slow
@pytest.mark.anyio
async def test_online_learner_on_two_ranks(
    nats_url: str, run_id: str, tiny_dir: Path, tmp_path: Path
) -> None:
    """`torchrun -m leafe.services.learner.main` on 2 ranks: rank 0 reads the stream and broadcasts
    each batch, both ranks train, checkpoint and export together; the push is announced on
    LEAFE_WEIGHTS."""
    from leafe.protocol import decode_weights, weights_subject
    from leafe.protocol.subjects import WEIGHTS
    from leafe.services.bus import connect
    from tests.support.learner import make_sample, publish_samples

    await publish_samples(nats_url, [make_sample(i, run_id=run_id) for i in range(16)])
    cfg_path = tmp_path / "learner.toml"
    cfg_path.write_text(ONLINE_CONFIG, encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={free_port()}",
        "-m",
        "leafe.services.learner.main",
        "--nats",
        nats_url,
        "--run-id",
        run_id,
        "--model",
        str(tiny_dir),
        "--store",
        str(tmp_path / "store"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--config",
        str(cfg_path),
        "--stop-after-steps",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipe, merged = asyncio.subprocess.PIPE, asyncio.subprocess.STDOUT
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=Path(__file__).parents[2], env=env, stdout=pipe, stderr=merged
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, out.decode()[-4000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    nc = await connect(nats_url)
    raw = await nc.jetstream().get_last_msg(WEIGHTS.name, weights_subject(run_id))
    await nc.close()
    event = decode_weights(raw.data)
    assert (event.version, event.learner_step, event.samples_seq > 0) == ("v000001", 2, True)
