"""The CPU-checkable parts of ``bench/gpu_smoke.py``: it refuses to start without CUDA or SGLang
(saying what to do), its launch commands parse with the real CLIs, its training config is valid, and
the MFU and logprob arithmetic."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from bench.gpu_smoke import TRAIN_TOML, main
from bench.gpu_smoke_lib import (
    PROBE_TIMEOUT_S,
    ROUTER_VERSION,
    SGLANG_VERSION,
    LoadLog,
    ProbeLog,
    SmokeError,
    load_loop,
    logprob_gap,
    mfu,
    nccl_version,
    peak_tflops,
    preflight,
    probe_loop,
    router_command,
    router_version,
    sglang_command,
    train_command,
    wire_backend,
)


def test_without_cuda_it_exits_2_at_once_and_writes_nothing(tmp_path: Path, capsys) -> None:
    """On a machine without CUDA (this one) the smoke check stops before starting anything."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "gpu_smoke.json"
    assert main(["--out", str(out)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not out.exists()


def test_preflight_names_what_is_missing() -> None:
    """No CUDA, too few GPUs, or a python without sglang: each is a SmokeError that says how to fix
    it."""
    with pytest.raises(SmokeError, match="CUDA is not available"):
        preflight(sys.executable, gpus=1, cuda=(False, 0))
    with pytest.raises(SmokeError, match="--gpus 4 but torch sees 2"):
        preflight(sys.executable, gpus=4, cuda=(True, 2))
    with pytest.raises(
        SmokeError, match=f"sglang is not importable.*sglang=={SGLANG_VERSION}.*--sglang-python"
    ):
        preflight(
            sys.executable, gpus=1, cuda=(True, 1)
        )  # this venv has no sglang (its wheels need CUDA)


def test_train_command_parses_with_leafe_train_and_runs_bf16_over_nccl(tmp_path: Path) -> None:
    """The torchrun command's trainer flags are accepted by ``leafe train``'s parser, and the config
    file it passes gives bf16 over the paper preset."""
    from leafe.services.learner.train import build_parser, resolve

    cfg = tmp_path / "train.toml"
    cfg.write_text(TRAIN_TOML, encoding="utf-8")
    cmd = train_command(
        tmp_path / "d", tmp_path / "m", tmp_path / "o", cfg, gpus=2, steps=4, batch=16, lr=1e-4
    )
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "-m"]
    args = build_parser().parse_args(cmd[cmd.index("leafe.services.learner.train") + 1 :])
    assert (args.backend, args.max_steps, args.global_batch, args.lr, args.preset) == (
        "nccl",
        4,
        16,
        1e-4,
        "paper",
    )
    assert args.no_resume and args.export_dtype == "bf16"
    config = resolve(args)
    assert config.trainer.precision == "bf16" and config.trainer.optim.warmup_steps == 1


def test_sglang_command() -> None:
    """SGLang is launched as a module of the given python with the model, port and memory share."""
    cmd = sglang_command("/opt/sglang/bin/python", Path("/models/m"), 30001, 0.25)
    assert cmd[:5] == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
    ]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    assert flags == {
        "--host": "127.0.0.1",
        "--port": "30001",
        "--mem-fraction-static": "0.25",
        "--dtype": "bfloat16",
    }


def test_mfu_and_peaks() -> None:
    """MFU = 6 * params * tokens/s over the GPUs' peak; unknown devices give None unless
    overridden."""
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Some GPU") is None and peak_tflops("Some GPU", 100.0) == 100.0
    assert mfu(135_000_000, 100_000.0, 2, 989.0) == pytest.approx(6 * 135e6 * 1e5 / (2 * 989e12))
    assert mfu(135_000_000, 100_000.0, 1, None) is None


def test_logprob_gap() -> None:
    """Mean and max absolute difference; lists of different lengths are an error."""
    assert logprob_gap([-1.0, -2.0], [-1.5, -2.0]) == (0.25, 0.5)
    with pytest.raises(SmokeError, match="differ in length"):
        logprob_gap([-1.0], [-1.0, -2.0])


def test_the_gpu_extra_pins_the_sglang_the_smoke_check_expects_and_torch_admits_both_builds() -> (
    None
):
    """`pip install .[gpu]` must be resolvable: sglang 0.5.23 needs torch 2.14.1, the CPU set-up
    keeps 2.13.0, so the base requirement is a range that holds both (an exact pin made the extra
    impossible)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())[
        "project"
    ]
    gpu = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    assert [(r.name, str(r.specifier)) for r in gpu] == [("sglang", f"=={SGLANG_VERSION}")]
    (torch_req,) = [
        Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"
    ]
    assert {"2.13.0", "2.14.1"} <= set(
        torch_req.specifier.filter(["2.12.0", "2.13.0", "2.14.1", "2.15.0"])
    )


def test_probe_log_counts_503s_failures_and_slow_answers() -> None:
    """The reload's health figures: every probe counted, 503s and unanswered ones apart, a probe
    slower than the router's health-check timeout is a miss even when it says 200."""
    log = ProbeLog()
    assert not log.healthy and log.summary()["max_latency_s"] is None  # never probed proves nothing
    for status, latency in [
        (200, 0.01),
        (200, 0.2),
        (503, 0.05),
        (None, 10.0),
        (200, PROBE_TIMEOUT_S + 1),
    ]:
        log.record(status, latency)
    assert log.summary() == {
        "probes": 5,
        "ok": 3,
        "status_503": 1,
        "other_failures": 1,
        "slow": 2,
        "max_latency_s": 10.0,
    }
    assert not log.healthy
    fine = ProbeLog()
    fine.record(200, 0.3)
    assert fine.healthy
    slow = ProbeLog()
    slow.record(200, PROBE_TIMEOUT_S + 0.5)
    assert not slow.healthy


def test_probe_and_load_loops_record_every_outcome_until_stopped() -> None:
    """The loops run until stopped; a probe that raises is an unanswered probe, a generation that
    raises is a counted failure with its error kept."""

    async def scenario() -> tuple[ProbeLog, LoadLog]:
        statuses = iter([200, 503])
        calls = [0]

        async def get() -> int | None:
            status = next(statuses, None)
            if status is None:
                raise ConnectionError("refused")
            return status

        async def generate() -> None:
            calls[0] += 1
            await asyncio.sleep(0.001)
            if calls[0] == 2:
                raise RuntimeError("aborted by the reload")

        probes, load, stop = ProbeLog(), LoadLog(), asyncio.Event()
        tasks = [
            asyncio.create_task(probe_loop(get, probes, stop, every_s=0.01)),
            asyncio.create_task(load_loop(generate, load, stop)),
        ]
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks)
        return probes, load

    probes, load = asyncio.run(scenario())
    summary = probes.summary()
    assert summary["probes"] >= 3 and summary["ok"] == 1 and summary["status_503"] == 1
    assert summary["other_failures"] == summary["probes"] - 2
    assert load.requests >= 3 and load.failures == 1
    assert load.errors == ["RuntimeError: aborted by the reload"]


def test_router_command_matches_the_deployed_health_check() -> None:
    """The router runs in front of one worker with deploy/'s health check on /ready and its timeout,
    and its own Prometheus port; this interpreter has the pinned sglang-router (the dev extra), so
    the smoke run's router stage runs even when SGLang's interpreter lacks it."""
    cmd = router_command("/opt/sglang/bin/python", "http://127.0.0.1:30000", 30001, 30002)
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--worker-urls") + 1] == "http://127.0.0.1:30000"
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    assert flags["--health-check-endpoint"] == "/ready" and flags["--port"] == "30001"
    assert float(flags["--health-check-timeout-secs"]) == PROBE_TIMEOUT_S
    assert flags["--prometheus-port"] == "30002" and flags["--retry-max-retries"] == "2"
    assert (
        router_version(sys.executable) == ROUTER_VERSION
    )  # the dev extra's: the stage runs through it


def test_router_command_parses_under_sglang_router() -> None:
    """Where sglang-router is installed (`pip install sglang-router==0.3.2`), its own parser accepts
    them."""
    router_args = pytest.importorskip("sglang_router.router_args")
    cmd = router_command("/opt/sglang/bin/python", "http://127.0.0.1:30000", 30001, 30002)
    import argparse

    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    router_args.RouterArgs.from_cli_args(parser.parse_args(cmd[3:]))


def test_the_wire_stage_uses_nccl_only_with_a_gpu_of_its_own() -> None:
    """NCCL refuses two ranks on one GPU and SGLang holds GPU 0: the sender takes the last GPU, and
    with one GPU the push goes over gloo with a note saying NCCL was not checked."""
    assert wire_backend(4) == ("nccl", 3, "")
    assert wire_backend(2) == ("nccl", 1, "")
    backend, gpu, note = wire_backend(1)
    assert (backend, gpu) == ("gloo", None) and "NCCL" in note and "2 GPUs" in note


def test_nccl_version_is_none_without_cuda_or_python(tmp_path: Path) -> None:
    """This machine's torch is a CPU build (no NCCL); a python that does not exist says nothing."""
    assert nccl_version(sys.executable) is None
    assert nccl_version(str(tmp_path / "no-python")) is None
