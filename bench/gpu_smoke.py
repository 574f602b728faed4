"""GPU smoke check of the production path: real SGLang, the real actor code, FSDP2 over NCCL in
bf16, and a weight push read back through SGLang's logprobs. Needs CUDA and SGLang; it cannot run on
the CPU machines (it says so and exits 2 in a second).

    python -m bench.gpu_smoke --model smollm2-135m-instruct --gpus 1
    python -m bench.gpu_smoke --model /models/SmolLM2-135M-Instruct --gpus 2 \\
        --sglang-python /opt/sglang/bin/python   # SGLang in its own env (it pins torch 2.14.1)

Stages: *serve* starts ``python -m sglang.launch_server --model-path DIR --port P`` and waits for
``/model_info``; *route* starts ``sglang_router.launch_router`` (0.3.2 with deploy/'s flags, from
that python or else this one: the dev extra pins it) in front of it, and the actors' traffic goes
through it; *explore* runs ``--episodes`` LEAFE trees on small Sokoban rooms through
``leafe.actors.explorer.Explorer`` and ``SGLangClient`` (generated tokens/s); *train* folds the
events with the ``leafe`` materializer into a dataset and runs ``torchrun --nproc_per_node=N -m
leafe.services.learner.train`` in bf16 over NCCL (trained tokens/s after the first step; MFU = 6 *
params * tokens/s / (N * peak bf16 FLOP/s), attention FLOPs left out, so a slight underestimate);
*push* calls ``/update_weights_from_disk`` with a new ``weight_version`` and checks the served one;
*wire* pushes the base weights back over the wire as weight sync's distributed transport does
(``WeightSender``: this process's child is rank 0, SGLang rank 1; NCCL with the sender on the last
GPU when there are two or more, gloo with one, noted) and checks the served version and that the
served logprobs match the base weights again (the NCCL versions of both sides are recorded: NCCL
refuses ranks of different versions, and the gpu overlay pairs the leafe image with SGLang's);
*keyed start* (``bench/gpu_smoke_keys.py``, once the others have stopped) starts SGLang again as
deploy/ does (API and admin keys, caches under a temporary ``HOME``, this uid) and checks ``/ready``
through the load, that the API key cannot reload weights and the admin key can, and a non-root uid;
*verify* asks for a greedy completion of a fixed prompt with ``return_logprob`` and compares its
logprobs with transformers forward passes of the new and the base weights (mean
|difference| to the new ones <= ``--logprob-tol``, and closer to them than to the base).

The push is a *reload under load*: generations keep going (through the router when there is one) and
SGLang's ``/ready`` and the router's ``/readiness`` are probed every 0.25 s throughout; every probe
must answer 200 within the router's 5 s health-check timeout and no generation may fail (figures:
probes, 503s, max probe latency, requests and failures during the reload). The engine lock is held
during the load, as the weight-sync sidecar holds it, and deploy's SGLang liveness probe runs every
second: it must say alive throughout. Through the router, a completion after the push must carry the
new ``weight_version`` and the router's ``/metrics`` must have the dashboard's ``smg_*`` series.

SGLang and the learner share the GPUs: SGLang gets ``--mem-fraction-static`` of GPU 0's memory.
Writes ``bench/results/gpu_smoke.json`` (figures and every check, passed or not); exit 1 if a check
failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

from bench.gpu_smoke_keys import keyed_start, sglang_env, sglang_key_flags
from bench.gpu_smoke_lib import (
    Report,
    SmokeError,
    logprob_gap,
    mfu,
    nccl_version,
    peak_tflops,
    preflight,
    sglang_command,
    sglang_server,
    train_command,
    wire_backend,
)
from bench.gpu_smoke_router import reload_under_load, routed, router_metrics
from bench.host import host_record
from leafe.actors.engine import Completion, SamplingParams

__all__ = [
    "Report",
    "build_dataset",
    "explore",
    "main",
    "parameter_count",
    "push_and_verify",
    "wire_push",
]

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu_smoke.json"
SMALL_SOKOBAN = {"height": 5, "width": 5, "num_boxes": 1, "max_solution_len": 2, "max_steps": 6}
PROBE_PROMPT = "In one sentence, what is the capital of France?"
T = TypeVar("T")


TRAIN_TOML = 'epochs = 1\n[trainer]\nprecision = "bf16"\n[trainer.optim]\nwarmup_steps = 1\n'
"""Over ``--preset paper``: bf16 mixed precision, and no 10-step warm-up (a few steps must move the
weights enough for the logprob check to tell new weights from old)."""


class CountingEngine:
    """An :class:`~leafe.actors.engine.Engine` that counts generated tokens on the way through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.output_tokens = 0
        self.requests = 0

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
    ) -> list[Completion]:
        """Generate through the wrapped engine."""
        out: list[Completion] = await self.inner.generate(
            input_ids, params, n=n, return_logprob=return_logprob
        )
        self.requests += 1
        self.output_tokens += sum(len(c.output_ids) for c in out)
        return out

    async def weight_version(self) -> str:
        """The wrapped engine's version."""
        return str(await self.inner.weight_version())


async def explore(url: str, model_dir: Path, episodes: int, report: Report) -> list[Any]:
    """``episodes`` LEAFE trees against SGLang through the actors' own code; returns their
    events."""
    from leafe.actors.client import SGLangClient
    from leafe.actors.config import ExplorerConfig
    from leafe.actors.episode import EpisodeSpec, ListSink
    from leafe.actors.explorer import Explorer
    from leafe.envs.registry import make_env
    from leafe.learner.model_io import HFChatTokenizer

    tokenizer = HFChatTokenizer.from_dir(model_dir)
    config = ExplorerConfig.for_env("sokoban", {"max_actions": 24, "max_branches": 4, "horizon": 8})
    sink = ListSink()
    async with SGLangClient(url) as client:
        engine = CountingEngine(client)
        task_ids = make_env("sokoban", **SMALL_SOKOBAN).tasks("train")[:episodes]

        async def one(i: int, task_id: str) -> Any:
            spec = EpisodeSpec(
                run_id="gpu-smoke",
                actor_id="gpu-smoke",
                env="sokoban",
                task_id=task_id,
                episode_id=f"gpu-smoke-{i}.a1",
                task_key=f"gpu-smoke-{i}",
                seed=i,
            )
            env = make_env("sokoban", **SMALL_SOKOBAN)
            try:
                return await Explorer(
                    engine=engine, tokenizer=tokenizer, env=env, config=config, sink=sink, spec=spec
                ).run()
            finally:
                env.close()

        t0 = time.perf_counter()
        summaries = await asyncio.gather(*(one(i, t) for i, t in enumerate(task_ids)))
        wall = time.perf_counter() - t0
    report.figures["explore"] = {
        "episodes": len(summaries),
        "successes": sum(bool(s.success) for s in summaries),
        "requests": engine.requests,
        "output_tokens": engine.output_tokens,
        "wall_s": round(wall, 2),
        "generated_tokens_per_s": round(engine.output_tokens / wall, 1),
    }
    return list(sink.events)


def build_dataset(events: list[Any], model_dir: Path, out: Path) -> int:
    """Fold the events with the ``leafe`` materializer (every branch's corrected action) into
    shards."""
    from leafe.learner.materializers import make_materializer
    from leafe.learner.materializers.folding import fold_events, write_folded
    from leafe.learner.model_io import HFChatTokenizer

    fold = make_materializer(
        "leafe",
        HFChatTokenizer.from_dir(model_dir),
        cf_only_successful=False,
        skip_unparsed_targets=False,
    )
    result = fold_events(events, fold)
    if not result.samples:
        raise SmokeError(
            f"the {len(events)} explore events folded into no samples; nothing to train"
        )
    write_folded(result, fold, out, run_id=None, shard_size=10_000)
    return len(result.samples)


def train(
    data: Path, model_dir: Path, work: Path, args: argparse.Namespace, report: Report
) -> Path:
    """A few FSDP2 steps over NCCL in bf16; returns the final export directory."""
    config = work / "train.toml"
    config.write_text(TRAIN_TOML, encoding="utf-8")
    out, gpus = work / "train", args.gpus
    cmd = train_command(
        data,
        model_dir,
        out,
        config,
        gpus=gpus,
        steps=args.steps,
        batch=args.global_batch,
        lr=args.lr,
    )
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SmokeError(
            f"training failed ({' '.join(cmd)}):\n{(done.stdout + done.stderr)[-4000:]}"
        )
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[1:] or metrics  # the first step includes compilation and NCCL warm-up
    tokens = sum(m["real_tokens"] for m in timed)
    seconds = sum(m["seconds"] for m in timed)
    report.figures["train"] = {
        "gpus": gpus,
        "steps": len(metrics),
        "wall_s": round(time.perf_counter() - t0, 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "losses": [round(m["loss"], 4) for m in metrics],
    }
    return out / "final"


def parameter_count(export_dir: Path) -> int:
    """Parameters of the exported model (tied weights once)."""
    from leafe.learner.model_io import load_model

    return sum(p.numel() for p in load_model(export_dir).parameters())


async def push_and_verify(
    url: str,
    base: Path,
    export: Path,
    version: str,
    tol: float,
    report: Report,
    device: str = "cuda",
    router_url: str | None = None,
) -> None:
    """Load ``export`` into SGLang as ``version`` under load (:func:`reload_under_load`); check the
    served version (and, through ``router_url``, a completion's), and that the served logprobs of a
    fixed greedy completion match a forward pass of the new weights (and not the ``base`` ones)."""
    from leafe.actors.client import SGLangClient
    from leafe.learner.model_io import HFChatTokenizer
    from leafe.protocol.samples import ChatMessage

    prompt = HFChatTokenizer.from_dir(export).encode_chat(
        [ChatMessage(role="user", content=PROBE_PROMPT)]
    )
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    async with SGLangClient(url, timeout_s=600.0) as client:
        t0 = time.perf_counter()
        [result] = await reload_under_load(
            url,
            router_url,
            prompt,
            lambda: client.update_weights_from_disk(str(export), version),
            report,
        )
        report.figures["push_s"] = round(time.perf_counter() - t0, 2)
        report.checks["push_succeeded"] = result.success
        if not result.success:
            raise SmokeError(f"/update_weights_from_disk failed: {result.message}")
        report.checks["served_weight_version"] = await client.weight_version() == version
        [c] = await client.generate(prompt, params, return_logprob=True)
    if router_url is not None:
        async with SGLangClient(router_url, timeout_s=600.0) as routed:
            [r] = await routed.generate(prompt, params)
        report.checks["router_completion_weight_version"] = r.weight_version == version
    report.checks["completion_weight_version"] = c.weight_version == version
    new = await asyncio.to_thread(forward_logprobs, export, prompt, c.output_ids, device)
    old = await asyncio.to_thread(forward_logprobs, base, prompt, c.output_ids, device)
    served = c.logprobs or []
    gap_new, gap_old, moved = (
        logprob_gap(served, new),
        logprob_gap(served, old),
        logprob_gap(new, old),
    )
    report.figures["logprob_gap_mean_max"] = {
        "served_new": gap_new,
        "served_base": gap_old,
        "new_base": moved,
    }
    report.checks["served_logprobs_match_new_weights"] = gap_new[0] <= tol
    if moved[0] > 2 * tol:  # otherwise old and new weights are too close to tell apart
        report.checks["served_logprobs_not_base_weights"] = gap_new[0] < gap_old[0]
    else:
        report.notes.append(
            f"training moved the probe's logprobs by only {moved[0]:.4f}: raise --lr/--steps"
        )


async def wire_push(
    url: str,
    source: Path,
    version: str,
    backend: str,
    tol: float,
    report: Report,
    *,
    tokenizer_dir: Path,
    device: str = "cuda",
    sender_gpu: int | None = None,
) -> None:
    """Push the safetensors of ``source`` to the engine at ``url`` as ``version`` over a weight
    group (weight sync's ``WeightSender``, rank 0 in a child process, on ``sender_gpu`` for NCCL),
    then check the served version and that a greedy completion's logprobs match a forward pass of
    ``source`` (``device``: where that forward pass runs)."""
    from leafe.actors.client import SGLangClient
    from leafe.learner.model_io import HFChatTokenizer
    from leafe.protocol.samples import ChatMessage
    from leafe.services.weight_sync.broadcast import GroupError, WeightSender

    state = await asyncio.to_thread(_safetensors_state, source)
    prompt = HFChatTokenizer.from_dir(tokenizer_dir).encode_chat(
        [ChatMessage(role="user", content=PROBE_PROMPT)]
    )
    client = SGLangClient(url, timeout_s=600.0)
    sender = WeightSender(
        {url: client},
        master_address="127.0.0.1",
        port=0,
        backend=backend,
        timeout_s=300.0,
        bucket_bytes=512 << 20,
        run_id="smoke",
    )
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if sender_gpu is not None:  # the spawned rank 0 sees only its own GPU
            os.environ["CUDA_VISIBLE_DEVICES"] = str(sender_gpu)
        t0 = time.perf_counter()
        try:
            await sender.form([url])
        except GroupError as e:
            raise SmokeError(f"wire push ({backend}): {e}") from e
        finally:
            if sender_gpu is not None:
                _restore_env("CUDA_VISIBLE_DEVICES", saved)
        formed = time.perf_counter() - t0
        t1 = time.perf_counter()
        [result] = await sender.push(state, version)
        pushed = time.perf_counter() - t1
        size = sum(t.numel() * t.element_size() for t in state.values())
        report.figures["wire_push"] = {
            "backend": backend,
            "formation_s": round(formed, 2),
            "push_s": round(pushed, 2),
            "bytes": size,
            "gb_per_s": round(size / pushed / 1e9, 3) if pushed else None,
        }
        report.checks["wire_push_succeeded"] = result.success
        if not result.success:
            raise SmokeError(f"/update_weights_from_distributed failed: {result.message}")
        report.checks["wire_served_weight_version"] = await client.weight_version() == version
        params = SamplingParams(max_new_tokens=24, temperature=0.0)
        [c] = await client.generate(prompt, params, return_logprob=True)
    finally:
        await sender.disband()
        await client.close()
    reference = await asyncio.to_thread(forward_logprobs, source, prompt, c.output_ids, device)
    gap = logprob_gap(c.logprobs or [], reference)
    report.figures["wire_push"]["logprob_gap_mean_max"] = gap
    report.checks["wire_logprobs_match_pushed_weights"] = gap[0] <= tol


def _safetensors_state(source: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(source.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise SmokeError(f"{source}: no safetensors file to push")
    return state


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def forward_logprobs(
    model_dir: Path, prompt: list[int], output: list[int], device: str = "cuda"
) -> list[float]:
    """Log-probability of each ``output`` token after ``prompt`` under the weights in
    ``model_dir``."""
    import torch

    from leafe.learner.model_io import load_model

    model = load_model(model_dir, device=device)
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])[:, 0]
    return [float(x) for x in logp.tolist()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="HF model directory or a known name"
    )
    p.add_argument("--gpus", type=int, default=1, help="learner ranks (torchrun --nproc_per_node)")
    p.add_argument(
        "--sglang-python", default=sys.executable, help="python that has sglang installed"
    )
    p.add_argument("--port", type=int, default=30000, help="SGLang port")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang --mem-fraction-static")
    p.add_argument("--episodes", type=int, default=8, help="Sokoban exploration trees")
    p.add_argument("--steps", type=int, default=4, help="training steps")
    p.add_argument("--global-batch", type=int, default=16, help="samples per training step")
    p.add_argument(
        "--lr", type=float, default=1e-4, help="learning rate (large: the weights must move)"
    )
    p.add_argument(
        "--logprob-tol", type=float, default=0.05, help="max mean |served - forward| logprob"
    )
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="bf16 peak per GPU, if not in the table"
    )
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for SGLang")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def run(args: argparse.Namespace, report: Report) -> None:
    """Every stage (see the module docstring), filling ``report``."""
    import torch

    from leafe.learner.model_io import resolve_model

    available = torch.cuda.is_available()
    cuda = (available, torch.cuda.device_count() if available else 0)
    version = preflight(args.sglang_python, gpus=args.gpus, cuda=cuda)
    device = torch.cuda.get_device_name(0)
    report.figures.update(
        sglang=version, device=device, torch=torch.__version__, host=host_record()
    )
    model_dir = resolve_model(args.model)
    url = f"http://127.0.0.1:{args.port}"
    work = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    cmd = sglang_command(args.sglang_python, model_dir, args.port, args.mem_fraction)
    with (
        sglang_server(cmd, work / "sglang.log", url, args.start_timeout),
        routed(args, url, work, report) as router,
    ):
        events = asyncio.run(explore(router or url, model_dir, args.episodes, report))
        report.figures["samples"] = build_dataset(events, model_dir, work / "data")
        export = train(work / "data", model_dir, work, args, report)
        version = f"smoke-step{args.steps}"
        asyncio.run(
            push_and_verify(
                url, model_dir, export, version, args.logprob_tol, report, router_url=router
            )
        )
        if router is not None:
            report.checks["router_metrics"] = router_metrics(args.port + 2)
        backend, sender_gpu, note = wire_backend(torch.cuda.device_count())
        report.notes += [note] if note else []
        report.figures["nccl"] = {"here": nccl_version(sys.executable)}
        report.figures["nccl"]["sglang"] = nccl_version(args.sglang_python)
        asyncio.run(
            wire_push(
                url,
                model_dir,
                "smoke-base-wire",
                backend,
                args.logprob_tol,
                report,
                tokenizer_dir=model_dir,
                sender_gpu=sender_gpu,
            )
        )
    api_key, admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    keyed = asyncio.run(
        keyed_start(
            [*cmd, *sglang_key_flags(api_key, admin_key)],
            url,
            api_key=api_key,
            admin_key=admin_key,
            update_path=str(model_dir),
            log_path=work / "sglang-keyed.log",
            timeout_s=args.start_timeout,
            env=sglang_env(work / "home"),
        )
    )
    report.checks.update(keyed.checks)
    report.figures["keyed_start"] = keyed.figures
    report.notes += keyed.notes
    params = parameter_count(export)
    tps = report.figures["train"]["tokens_per_s"] or 0.0
    peak = peak_tflops(device, args.peak_tflops)
    ratio = mfu(params, tps, args.gpus, peak)
    report.figures.update(
        params=params, peak_bf16_tflops=peak, mfu=round(ratio, 4) if ratio else None
    )
    if peak is None:
        report.notes.append(f"unknown peak for {device!r}: pass --peak-tflops to get the MFU")


def main(argv: list[str] | None = None) -> int:
    """Run the smoke check; 2 = cannot run here, 1 = a check failed, 0 = all passed."""
    args = _parser().parse_args(argv)
    report = Report()
    try:
        run(args, report)
    except SmokeError as e:
        print(f"gpu_smoke: {e}", file=sys.stderr)
        if not report.figures:
            return 2
        report.notes.append(str(e))
        report.checks["completed"] = False
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(vars(report), indent=1, default=str) + "\n", encoding="utf-8")
    print(json.dumps(vars(report), indent=1, default=str))
    return 0 if report.checks and all(report.checks.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
