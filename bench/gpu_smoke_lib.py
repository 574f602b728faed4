"""The parts of ``bench/gpu_smoke.py`` that need no GPU: preconditions, launch commands and the figures'
arithmetic (unit-tested on CPU in tests/unit/bench/test_gpu_smoke.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "PEAK_BF16_TFLOPS",
    "SGLANG_VERSION",
    "SmokeError",
    "logprob_gap",
    "mfu",
    "peak_tflops",
    "preflight",
    "sglang_command",
    "train_command",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release the client is written against (shared/SGLANG_API.md)."""

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
"""Dense bf16 peak per GPU (vendor datasheets, no sparsity), matched by substring of the device name."""


class SmokeError(RuntimeError):
    """A precondition or a stage failed; the message says what and what to do."""


def preflight(sglang_python: str, *, gpus: int, cuda: tuple[bool, int]) -> str:
    """The SGLang version ``sglang_python`` imports; :class:`SmokeError` naming the fix when CUDA, the
    GPUs or SGLang are missing (checked before anything starts). ``cuda``: (available, device count)."""
    cuda_available, gpu_count = cuda
    if not cuda_available:
        raise SmokeError(
            "CUDA is not available to torch here: bench/gpu_smoke.py needs NVIDIA GPUs "
            "(it checks SGLang serving and FSDP over NCCL; the CPU path is covered by the test suite)"
        )
    if gpus > gpu_count:
        raise SmokeError(f"--gpus {gpus} but torch sees {gpu_count} CUDA device(s)")
    probe = [sglang_python, "-c", "import sglang; print(sglang.__version__)"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SmokeError(f"cannot run {sglang_python!r} to look for sglang: {e}") from e
    if done.returncode != 0:
        raise SmokeError(
            f"sglang is not importable by {sglang_python}: {done.stderr.strip().splitlines()[-1:]}; install "
            f"sglang=={SGLANG_VERSION} (`pip install .[gpu]`, or an environment of its own: it pins torch "
            "2.14.1) and pass that --sglang-python"
        )
    return done.stdout.strip()


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """Dense bf16 TFLOP/s of one GPU: ``override``, else looked up by name; ``None`` if unknown."""
    if override:
        return override
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def mfu(params: int, tokens_per_s: float, gpus: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation of training: 6 * params FLOPs per token over the GPUs' peak."""
    if not peak or gpus < 1:
        return None
    return 6.0 * params * tokens_per_s / (gpus * peak * 1e12)


def logprob_gap(served: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """``(mean, max)`` absolute difference of two equally long logprob lists."""
    if len(served) != len(reference) or not served:
        raise SmokeError(f"logprob lists differ in length or are empty: {len(served)} vs {len(reference)}")
    gaps = [abs(a - b) for a, b in zip(served, reference, strict=True)]
    return sum(gaps) / len(gaps), max(gaps)


def sglang_command(python: str, model_dir: Path, port: int, mem_fraction: float) -> list[str]:
    """The SGLang server launch."""
    flags = f"--host 127.0.0.1 --port {port} --mem-fraction-static {mem_fraction} --dtype bfloat16"
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_dir), *flags.split()]


def train_command(
    data: Path, model_dir: Path, out: Path, config: Path, *, gpus: int, steps: int, batch: int, lr: float
) -> list[str]:
    """FSDP2 over NCCL on ``gpus`` local ranks through the offline trainer."""
    paths = ["--data", str(data), "--model", str(model_dir), "--out", str(out), "--config", str(config)]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={gpus}",
        "-m",
        "services.train",
    ]
    flags = f"--preset paper --backend nccl --max-steps {steps} --global-batch {batch} --lr {lr}"
    rest = "--checkpoint-every 0 --push-every 0 --export-dtype bf16 --no-resume"
    return [*launch, *paths, *flags.split(), *rest.split()]
