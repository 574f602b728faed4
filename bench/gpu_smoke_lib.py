"""The parts of ``bench/gpu_smoke.py`` that need no GPU: preconditions, launch commands, server
processes, the figures' arithmetic and the bookkeeping of the reload under load (unit-tested on CPU
in tests/unit/bench/test_gpu_smoke.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leafe.services.run.router import ROUTER_VERSION
from leafe.services.run.router import router_command as deployed_router_command

__all__ = [
    "PEAK_BF16_TFLOPS",
    "PROBE_TIMEOUT_S",
    "ROUTER_VERSION",
    "SGLANG_VERSION",
    "LoadLog",
    "ProbeLog",
    "Report",
    "SmokeError",
    "load_loop",
    "logprob_gap",
    "mfu",
    "nccl_version",
    "peak_tflops",
    "preflight",
    "probe_loop",
    "router_command",
    "router_version",
    "sglang_command",
    "sglang_server",
    "train_command",
    "wire_backend",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release the client is written against (shared/SGLANG_API.md)."""
PROBE_TIMEOUT_S = 5.0
"""The router's ``--health-check-timeout-secs`` (deploy/components/sglang/router.yaml): a health
check slower than this is a miss, and 3 misses drop the worker."""

PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
}
"""Dense bf16 peak per GPU (vendor datasheets, no sparsity), matched by substring of the device
name."""


class SmokeError(RuntimeError):
    """A precondition or a stage failed; the message says what and what to do."""


@dataclass
class Report:
    """Everything the run measured and checked (written as JSON)."""

    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@contextmanager
def sglang_server(
    cmd: list[str], log_path: Path, url: str, timeout_s: float, ready_path: str = "/model_info"
) -> Iterator[None]:
    """Run SGLang (or the router) until the block ends; waits for ``ready_path`` (log tail on
    failure)."""
    import urllib.request

    name = "the router" if "sglang_router.launch_router" in cmd else "SGLang"

    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise SmokeError(f"{name} exited with {proc.returncode}; {log_path}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{url}{ready_path}", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SmokeError(
                    f"{name} did not answer {ready_path} within {timeout_s:.0f}s; see {log_path}"
                )
            time.sleep(2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def preflight(sglang_python: str, *, gpus: int, cuda: tuple[bool, int]) -> str:
    """The SGLang version ``sglang_python`` imports; :class:`SmokeError` naming the fix when CUDA,
    the GPUs or SGLang are missing (checked before anything starts). ``cuda``: (available, device
    count)."""
    cuda_available, gpu_count = cuda
    if not cuda_available:
        raise SmokeError(
            "CUDA is not available to torch here: bench/gpu_smoke.py needs NVIDIA GPUs "
            "(it checks SGLang serving and FSDP over NCCL; the CPU path is covered by the "
            "test suite)"
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
            f"sglang is not importable by {sglang_python}: "
            f"{done.stderr.strip().splitlines()[-1:]}; install "
            f"sglang=={SGLANG_VERSION} (`pip install .[gpu]`, or an environment of its own: "
            "it pins torch 2.14.1) and pass that --sglang-python"
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
        raise SmokeError(
            f"logprob lists differ in length or are empty: {len(served)} vs {len(reference)}"
        )
    gaps = [abs(a - b) for a, b in zip(served, reference, strict=True)]
    return sum(gaps) / len(gaps), max(gaps)


def sglang_command(python: str, model_dir: Path, port: int, mem_fraction: float) -> list[str]:
    """The SGLang server launch."""
    flags = f"--host 127.0.0.1 --port {port} --mem-fraction-static {mem_fraction} --dtype bfloat16"
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_dir), *flags.split()]


def train_command(
    data: Path,
    model_dir: Path,
    out: Path,
    config: Path,
    *,
    gpus: int,
    steps: int,
    batch: int,
    lr: float,
) -> list[str]:
    """FSDP2 over NCCL on ``gpus`` local ranks through the offline trainer."""
    paths = [
        "--data",
        str(data),
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--config",
        str(config),
    ]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={gpus}",
        "-m",
        "leafe.services.learner.train",
    ]
    flags = f"--preset paper --backend nccl --max-steps {steps} --global-batch {batch} --lr {lr}"
    rest = "--checkpoint-every 0 --push-every 0 --export-dtype bf16 --no-resume"
    return [*launch, *paths, *flags.split(), *rest.split()]


def router_version(python: str) -> str | None:
    """The sglang-router version ``python`` imports, ``None`` when it has none (the router stage is
    then skipped with a note: ``pip install sglang-router==0.3.2``)."""
    probe = [
        python,
        "-c",
        "import importlib.metadata as m, sglang_router; print(m.version('sglang-router'))",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def router_command(python: str, worker_url: str, port: int, prometheus_port: int) -> list[str]:
    """sglang-router in front of one worker with deploy/'s flags (services/run/router.py, the router
    CI and ``leafe run`` start), its workers checked every 2 s here instead of 10 so a short reload
    is probed."""
    return deployed_router_command(
        [worker_url], port=port, prometheus_port=prometheus_port, health_interval_s=2, python=python
    )


@dataclass
class ProbeLog:
    """Health checks answered while weights reload: status per probe (``None``: no answer) and
    latency."""

    timeout_s: float = PROBE_TIMEOUT_S
    results: list[tuple[int | None, float]] = field(default_factory=list)

    def record(self, status: int | None, latency_s: float) -> None:
        """One probe's outcome."""
        self.results.append((status, latency_s))

    def summary(self) -> dict[str, Any]:
        """Counts (all, 200, 503, other failures, slower than ``timeout_s``) and the max latency."""
        latencies = [t for _, t in self.results]
        return {
            "probes": len(self.results),
            "ok": sum(s == 200 for s, _ in self.results),
            "status_503": sum(s == 503 for s, _ in self.results),
            "other_failures": sum(s not in (200, 503) for s, _ in self.results),
            "slow": sum(t > self.timeout_s for t in latencies),
            "max_latency_s": round(max(latencies), 3) if latencies else None,
        }

    @property
    def healthy(self) -> bool:
        """Probed at least once, and every probe answered 200 within ``timeout_s``."""
        s = self.summary()
        return s["probes"] > 0 and s["ok"] == s["probes"] and s["slow"] == 0


@dataclass
class LoadLog:
    """Generations sent while weights reload: how many succeeded, and the first errors."""

    requests: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)

    def record(self, error: BaseException | None) -> None:
        """One request's outcome (``None``: it succeeded)."""
        self.requests += 1
        if error is not None:
            self.failures += 1
            if len(self.errors) < 5:
                self.errors.append(f"{type(error).__name__}: {error}"[:300])


async def probe_loop(
    get: Callable[[], Awaitable[int | None]],
    log: ProbeLog,
    stop: asyncio.Event,
    every_s: float = 0.25,
) -> None:
    """Call ``get`` (one health check: its HTTP status, ``None`` when it got no answer) every
    ``every_s`` until ``stop``, recording each outcome and its latency."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            status = await asyncio.wait_for(get(), 2 * log.timeout_s)
        except Exception:  # a probe that raised or timed out is a probe that got no answer
            status = None
        log.record(status, time.perf_counter() - t0)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def load_loop(
    generate: Callable[[], Awaitable[Any]], log: LoadLog, stop: asyncio.Event
) -> None:
    """Send one generation after another until ``stop``, recording each outcome (errors
    included)."""
    while not stop.is_set():
        try:
            await generate()
        except Exception as e:  # the count of failures is the figure; the run goes on
            log.record(e)
            await asyncio.sleep(0.1)
        else:
            log.record(None)


def wire_backend(gpu_count: int) -> tuple[str, int | None, str]:
    """How the *wire* stage pushes, given the GPUs here: ``(backend, the sender's GPU, a note)``.
    NCCL (the gpu overlay's backend) needs the sender on a GPU of its own: NCCL refuses two ranks
    of one communicator on one device, and SGLang holds GPU 0. With a single GPU the push goes over
    gloo (SGLang receives into its GPU tensors through gloo), and the note says NCCL was not
    exercised."""
    if gpu_count >= 2:
        return "nccl", gpu_count - 1, ""
    return (
        "gloo",
        None,
        "wire push over gloo, not NCCL: one GPU here, and NCCL refuses a second rank on the GPU "
        "SGLang holds; run with 2 GPUs to check the gpu overlay's NCCL path",
    )


def nccl_version(python: str) -> str | None:
    """The NCCL version torch carries under ``python`` (``"2.27.5"``), or None when it has none or
    cannot say. NCCL refuses ranks of different versions in one group."""
    code = "import torch; v = torch.cuda.nccl.version(); print('.'.join(map(str, v)))"
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = done.stdout.strip()
    return out if done.returncode == 0 and out else None
