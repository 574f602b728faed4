"""bf16 training (learner/fsdp.py, learner/trainer.py): what ``auto`` picks, the loss curve against
fp32, and fp32 master weights behind bf16 compute (checkpoints and exports as fp32 training writes
them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leafe.learner.config import BatchConfig, OptimConfig, TrainerConfig
from leafe.learner.distributed import DistEnv
from leafe.learner.fsdp import cpu_has_native_bf16, resolve_precision
from leafe.learner.model_io import load_model
from leafe.learner.trainer import Trainer
from tests.support.learner import make_samples

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = DistEnv(
    rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", owns_group=False
)
GPU = DistEnv(
    rank=0,
    world_size=1,
    local_rank=0,
    device=torch.device("cuda"),
    backend="nccl",
    owns_group=False,
)


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_dot_products(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """``auto``: bf16 on a CPU with AVX512-BF16 or AMX, fp32 on one without (bf16 would be emulated
    there), bf16 on GPU; an explicit choice is kept; an unknown one is an error naming it."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(
        torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True
    )  # oneDNN not capped
    assert resolve_precision("auto", CPU) == ("bf16" if native else "fp32")
    assert resolve_precision("auto", GPU) == "bf16"
    assert resolve_precision("fp32", CPU) == "fp32" and resolve_precision("bf16", CPU) == "bf16"
    with pytest.raises(ValueError, match="'fp16'"):
        resolve_precision("fp16", CPU)


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this OS")
    return {
        f
        for line in cpuinfo.read_text().splitlines()
        if line.startswith("flags")
        for f in line.split()
    }


def test_native_bf16_detection_agrees_with_the_kernels_cpu_flags() -> None:
    """torch's view of the CPU matches the flags Linux reports (avx512_bf16 or amx_tile), unless
    oneDNN is capped below them (``ONEDNN_MAX_CPU_ISA``, as `make test`'s AVX2 pass sets it): then
    no bf16."""
    capped = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_has_native_bf16() == (
        bool(_cpu_flags() & {"avx512_bf16", "amx_tile"}) and not capped
    )


def test_onednn_capped_at_avx2_trains_in_fp32() -> None:
    """With oneDNN capped at AVX2 (how an AVX-512 host approximates an AVX2-only one), ``auto``
    picks fp32 as an AVX2-only CPU does: bf16 matmuls would run emulated, ~100x slower (the
    approximated `make run` trained its warm start at ~5 min a step in bf16 on a Zen 4 host, where
    the AVX2-only CPU takes fp32)."""
    import subprocess
    import sys

    code = (
        "import torch; from leafe.learner.distributed import DistEnv; from leafe.learner.fsdp "
        "import resolve_precision; "
        "env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device('cpu'), "
        "backend='gloo', "
        "owns_group=False); print(resolve_precision('auto', env))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-1] == "fp32", out.stdout + out.stderr


def _cfg(precision: str, lr: float = 1e-3) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=lr, warmup_steps=2),
        batch=BatchConfig(global_batch=16, micro_batch_tokens=256, bucketing="pack"),
        precision=precision,  # type: ignore[arg-type]
        seed=3,
    )


def test_bf16_loss_curve_stays_within_a_thousandth_of_fp32(dist_env, tiny_dir: Path) -> None:
    """Ten steps on the same batch and seed: the bf16 loss stays within 1e-3 (relative) of fp32's at
    every step while falling just as far. Why 1e-3: it is half of bf16's unit roundoff (2^-9 ~
    2e-3), so a loss reduction or master weights slipping into bf16 fail it, while the bf16 matmuls
    (fp32 accumulation, fp32 loss) deviate ~5e-5 on this model: rounding noise passes with a 20x
    margin."""
    batch = make_samples(16, kinds=("cf", "reh"))
    curves = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(_cfg(precision), tiny_dir, dist_env)
        assert trainer.precision == precision
        curves[precision] = [trainer.train_step(batch).loss for _ in range(10)]
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert fp32 != bf16  # bf16 did run in bf16
    for step, (a, b) in enumerate(zip(fp32, bf16, strict=True)):
        assert b == pytest.approx(a, rel=1e-3), step
    assert fp32[0] - fp32[-1] > 1.0
    assert bf16[0] - bf16[-1] == pytest.approx(fp32[0] - fp32[-1], rel=1e-2)


def test_bf16_training_keeps_fp32_master_weights(dist_env, tiny_dir: Path, tmp_path: Path) -> None:
    """At lr 1e-6 AdamW moves each weight by ~1e-6, far below bf16's resolution at these weights
    (~1e-4): bf16 training still moves most weights by about that much, so the weights it updates,
    checkpoints and exports (fp32 on request; bf16 by default = the fp32 weights rounded once) are
    fp32."""
    before = {k: v.clone() for k, v in load_model(tiny_dir).state_dict().items()}
    trainer = Trainer(_cfg("bf16", lr=1e-6), tiny_dir, dist_env)
    trainer.train_step(make_samples(16, kinds=("cf", "reh")))
    master = {k: v.clone() for k, v in trainer.export_state().items()}
    moved = total = 0
    for k, w in master.items():
        assert w.dtype == torch.float32, k
        d = (w - before[k]).abs()
        assert float(d.max()) <= 2e-6, k
        moved += int((d > 0).sum())
        total += d.numel()
    assert moved > total // 2, f"only {moved} of {total} weights moved"
    trainer.export(tmp_path / "fp32", version="v1", dtype="fp32")
    trainer.export(tmp_path / "bf16", version="v1")
    exported32 = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    exported16 = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for k, v in exported32.items():
        assert torch.equal(v, master[k]), k
        assert torch.equal(exported16[k], master[k].to(torch.bfloat16)), k
