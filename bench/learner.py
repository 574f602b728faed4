"""Learner benchmarks: training throughput (batch layout x precision) and the time from
``WeightsPublished`` to every inference server serving the new version.

| row                | what runs                                                                   |
|--------------------|-----------------------------------------------------------------------------|
| naive_full_logits  | baseline: fixed micro-batches in arrival order, logits for every position   |
|                    | (what an HF-style SFT loop computes), same trainer, samples, global batch   |
|                    | and memory ceiling                                                          |
| naive_padded       | the trainer with ``bucketing = "none"``:                                    |
|                    | arrival order, fixed micro-batch size                                       |
| bucketed           | fp32, length-bucketed left-padded micro-batches up to a token budget (the   |
|                    | layout and precision the learner used before packing and bf16)              |
| packed             | fp32, samples packed into rows of the token budget,                         |
|                    | per-sample causal attention                                                 |
| bucketed_bf16      | bf16 autocast (fp32 master weights), length-bucketed                        |
| packed_bf16        | bf16 autocast, packed                                                       |
| packed_bf16_shared | bf16, packed with ``share_prefix``:                                         |
|                    | the prompt prefix all samples share once a row                              |
| push               | trainer export (bf16 + manifest) -> WeightsPublished -> weight-sync ->      |
|                    | 2 CPU inference servers report the version                                  |
|                    | (median of repeats, fresh servers each time)                                |
| raw_save_load      | baseline: safetensors save_file + load_file + load_state_dict               |
|                    | of the same weights                                                         |
| memory             | peak RSS of the learner before / after the chunked LM head and activation   |
|                    | checkpointing, with the loss check (``bench/learner_memory.py``; SmolLM2 in |
|                    | quick and full mode; ``--memory-only`` reruns just this part)               |

Samples look like agent data: 150-600-token prompts whose first 144 are the same in every sample
(system prompt and task header, as in effect-hard's GRPO samples), 5-40-token completions, cf/reh
mixed. Throughput counts real (non-pad) tokens per second of optimizer-step wall time; every row
trains the same batches after one warm-up step, each row in a process of its own (its own model and
AdamW state; rows one after another), so that no row's memory stays with the next and the bench's
own process never holds a model's training state (it reached ~15 GB when the rows shared one
process). Each row also reports its process's peak resident set. Memory ceiling:
``micro_batch_tokens`` padded tokens per micro-batch (packed: tokens per row); the naive
micro-batch size is the one that fits it for the longest sample. One torch thread (as ``leafe
run``'s learner); ``threads_2`` repeats bucketed, packed_bf16 and packed_bf16_shared on 2 threads
over the first batch.

    .venv/bin/python -m bench.learner           # SmolLM2-135M, both parts (slow on 2 shared cores)
    .venv/bin/python -m bench.learner --quick   # tiny model for throughput, SmolLM2 for the push
    .venv/bin/python -m bench.learner --push-only [--quick]   # redo the push part only
    .venv/bin/python -m bench.learner --smoke \\
        --out /tmp/learner.json                 # tiny model, 8 samples, 1 push

Writes ``bench/results/learner.json`` or ``--out`` (one entry per mode; the other modes' entries are
kept; a missing file is created). ``--smoke`` (the tests' check that both parts still run; not a
measurement) uses the tiny random model for both and writes to a temporary file unless ``--out`` is
given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.host import host_record, peak_rss_kib
from bench.learner_memory import memory_part
from bench.learner_samples import MAX_COMPLETION, MAX_PROMPT, SHARED_PREFIX, agent_samples
from leafe.actors.client import SGLangClient
from leafe.learner.batching import MicroBatch
from leafe.learner.config import BatchConfig, OptimConfig, TrainerConfig
from leafe.learner.distributed import DistEnv, init_distributed
from leafe.learner.losses import token_logprobs
from leafe.learner.model_io import resolve_model
from leafe.learner.trainer import Trainer
from leafe.protocol import WeightsPublished, weights_subject
from leafe.protocol.samples import Sample
from leafe.services.bus import Publisher, connect, ensure_streams
from leafe.services.bus.nats_server import EmbeddedNats
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.logsetup import configure_logging
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "learner.json"
SMOKE_OUT = Path(tempfile.gettempdir()) / "leafe-bench-smoke" / "learner.json"
SIZES = {  # mode -> throughput model, samples, global batch, micro-batch token budget, push model
    "smoke": ("tiny", 4, 4, 2048, "tiny"),
    "quick": ("tiny", 256, 64, 4096, "smollm2-135m-instruct"),
    # full: the cpu preset's batch
    "full": ("smollm2-135m-instruct", 32, 16, 2048, "smollm2-135m-instruct"),
}
MEMORY = {"smoke": ("tiny", 4, (20, 80))}
"""Mode -> the memory part's model, samples per step and prompt lengths (default: SmolLM2, the cpu
preset's global batch of 16, agent-like prompts of 150-600 tokens)."""
SAMPLES: dict[str, Any] = {
    "prompt": (150, MAX_PROMPT),
    "shared": SHARED_PREFIX,
}  # --smoke: (40, 90), 34


class FullLogitsTrainer(Trainer):
    """The naive baseline's forward: logits for every position, then the same targets and loss."""

    def _logp(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        out = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
        )
        return token_logprobs(out.logits[:, -mb.keep : -1], mb.labels)


ROWS = {  # name -> (bucketing, precision, share_prefix)
    "naive_full_logits": ("none", "fp32", False),
    "naive_padded": ("none", "fp32", False),
    "bucketed": ("length", "fp32", False),
    "packed": ("pack", "fp32", False),
    "bucketed_bf16": ("length", "bf16", False),
    "packed_bf16": ("pack", "bf16", False),
    "packed_bf16_shared": ("pack", "bf16", True),
}
BASE = "bucketed"
"""Step speedups are relative to this row (fp32 length bucketing: the learner before packing and
bf16)."""
TWO_THREADS = ("bucketed", "packed_bf16", "packed_bf16_shared")


@dataclass
class Acc:
    """Per-config totals."""

    real: int = 0
    padded: int = 0
    step_s: list[float] = field(default_factory=list)


def _config(name: str, global_batch: int, budget: int) -> TrainerConfig:
    bucketing, precision, share_prefix = ROWS[name]
    batch = BatchConfig(
        global_batch=global_batch,
        micro_batch_tokens=budget,
        micro_batch_size=max(1, budget // (MAX_PROMPT + MAX_COMPLETION)),
        bucketing=bucketing,
        share_prefix=share_prefix,
    )
    return TrainerConfig(optim=OptimConfig(lr=1e-6), batch=batch, precision=precision)


def _batches(mode: str, n: int) -> tuple[Path, list[list[Sample]], int]:
    """The throughput model, the batches every row trains (the same in every process) and the
    micro-batch token budget."""
    tp_name, _, gb, budget, _ = SIZES[mode]
    model_dir = resolve_model(tp_name)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    # --smoke: short prompts too (the full-logits row's every-position logits would take most
    # of its time)
    samples = agent_samples(
        n, vocab, **({"prompt": (40, 90), "shared": 34} if mode == "smoke" else SAMPLES)
    )
    return model_dir, [samples[i : i + gb] for i in range(0, n, gb)], budget


def _row_child(name: str, mode: str, n: int, threads: int, batches_kept: int) -> dict[str, Any]:
    """One row in this (child) process: a fresh trainer, a warm-up step, then the batches."""
    torch.set_num_threads(threads)
    env = init_distributed("gloo")
    model_dir, batches, budget = _batches(mode, n)
    batches = batches[:batches_kept]
    cls = FullLogitsTrainer if name == "naive_full_logits" else Trainer
    trainer = cls(_config(name, len(batches[0]), budget), model_dir, env)
    trainer.train_step(batches[0][:2])  # warm-up (allocator, first-call overheads, AdamW state)
    steps = [trainer.train_step(b) for b in batches]
    return {
        "real": [s.real_tokens for s in steps],
        "padded": [s.padded_tokens for s in steps],
        "step_s": [s.seconds for s in steps],
        "peak_rss_gb": peak_rss_kib() / 1e6,
    }


def _throughput(
    names: tuple[str, ...], mode: str, n: int, threads: int, batches_kept: int
) -> dict[str, dict]:
    """Each row in a process of its own, one after another, training the same batches;
    tokens/s = real tokens / summed step time. ``--smoke`` (the tiny model, whose memory does not
    matter) runs them in this process: a check that the rows run, without ten interpreter starts."""
    acc, peaks = {}, {}
    for name in names:
        if mode == "smoke":
            got = _row_child(name, mode, n, threads, batches_kept)
            torch.set_num_threads(1)
            acc[name] = Acc(real=sum(got["real"]), padded=sum(got["padded"]), step_s=got["step_s"])
            peaks[name] = got["peak_rss_gb"]
            continue
        cmd = [sys.executable, "-m", "bench.learner", "--row", name, "--row-mode", mode]
        cmd += ["--samples", str(n), "--threads", str(threads), "--batches", str(batches_kept)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"row {name} exited {run.returncode}:\n{run.stderr[-3000:]}")
        got = json.loads(run.stdout.strip().splitlines()[-1])
        acc[name] = Acc(real=sum(got["real"]), padded=sum(got["padded"]), step_s=got["step_s"])
        peaks[name] = got["peak_rss_gb"]
    rows = {}
    for k, a in acc.items():
        speedup = [n / m for n, m in zip(acc[BASE].step_s, a.step_s, strict=True)]
        rows[k] = {
            "tokens_per_s": a.real / sum(a.step_s),
            "seconds": sum(a.step_s),
            "real_tokens": a.real,
            "padded_tokens": a.padded,
            "padding_overhead": a.padded / a.real - 1,
            f"median_step_speedup_vs_{BASE}": statistics.median(speedup),
            "peak_rss_gb": peaks[k],
        }
        print(
            f"  {k:<18} {rows[k]['tokens_per_s']:8.1f} tok/s  padding "
            f"+{rows[k]['padding_overhead']:.0%}  "
            f"({sum(a.step_s):.1f} s, peak RSS {peaks[k]:.2f} GB)",
            flush=True,
        )
    return rows


def _all_throughput(mode: str, n: int, batches: int) -> dict[str, dict[str, dict]]:
    print(" 1 thread", flush=True)
    out = {"throughput": _throughput(tuple(ROWS), mode, n, 1, batches)}
    print(" 2 threads, first batch", flush=True)
    out["threads_2"] = _throughput(TWO_THREADS, mode, n, 2, 1)
    return out


async def _wait_version(urls: list[str], version: str, limit_s: float = 600.0) -> float:
    t0 = time.perf_counter()
    clients = [SGLangClient(u) for u in urls]
    try:
        while time.perf_counter() - t0 < limit_s:
            versions = [await c.weight_version() for c in clients]
            if all(v == version for v in versions):
                return time.perf_counter()
            await asyncio.sleep(0.02)
    finally:
        for c in clients:
            await c.close()
    raise TimeoutError(f"servers did not reach {version} within {limit_s} s")


async def _one_push(
    model_dir: Path, trainer: Trainer, nats_url: str, js: Any, i: int, work: Path
) -> dict:
    """Two fresh servers at ``default``; export v<i>, announce it, wait until both serve it. Each
    repeat is its own run: weight-sync would otherwise load the previous repeat's version into the
    fresh servers."""
    version, run = f"v{i:06d}", f"bench{i}"
    icfg = InferenceConfig(model=str(model_dir), port=0, threads=1, weights_root=str(work))
    async with InferenceServer(icfg) as s1, InferenceServer(icfg) as s2, Publisher(js) as pub:
        urls = [s1.url, s2.url]
        sync = WeightSync(WeightSyncConfig(servers=urls, reconcile_interval_s=5.0), run_id=run)
        stop = asyncio.Event()
        task = asyncio.create_task(sync.run(nats_url, stop))
        await asyncio.sleep(1.0)  # weight-sync connected and idle
        t0 = time.perf_counter()
        digest = await asyncio.to_thread(trainer.export, work / "store" / version, version=version)
        t1 = time.perf_counter()
        await pub.publish(
            weights_subject(run),
            WeightsPublished(
                event_id=f"weights.{run}.{version}",
                run_id=run,
                version=version,
                uri=str(work / "store" / version),
                manifest_sha256=digest,
                learner_step=i,
                base_model=str(model_dir),
                ts=time.time(),
            ),
        )
        await pub.flush()
        t2 = time.perf_counter()
        t3 = await _wait_version(urls, version)
        stop.set()
        await task
    load = max(
        r.seconds for r in sync.results.values()
    )  # the slower server's /update_weights_from_disk call
    print(
        f"  push {version}: export {t1 - t0:.2f} s, published -> 2 servers serving {t3 - t2:.2f} s "
        f"(server load {load:.2f} s)",
        flush=True,
    )
    return {
        "export_s": t1 - t0,
        "publish_to_serving_s": t3 - t2,
        "total_s": t3 - t0,
        "server_update_s": load,
        "announce_and_sync_overhead_s": t3 - t2 - load,
    }


async def _push_bench(model_dir: Path, env: DistEnv, repeats: int, work: Path) -> dict:
    nats = EmbeddedNats(work / "js").start()
    trainer = Trainer(TrainerConfig(optim=OptimConfig(lr=1e-6), precision="fp32"), model_dir, env)
    try:
        nc = await connect(nats.url)
        js = nc.jetstream()
        await ensure_streams(js)
        rows = [
            await _one_push(model_dir, trainer, nats.url, js, i, work)
            for i in range(1, repeats + 1)
        ]
        await nc.close()
    finally:
        nats.stop()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"repeats": rows}


def _raw_save_load(model_dir: Path, work: Path, repeats: int) -> dict:
    from safetensors.torch import load_file, save_file

    from leafe.learner.model_io import load_model

    model = load_model(model_dir)
    state = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        save_file(state, str(work / f"raw{i}.safetensors"))
        loaded = load_file(str(work / f"raw{i}.safetensors"))
        model.load_state_dict({k: v.float() for k, v in loaded.items()}, strict=False)
        times.append(time.perf_counter() - t0)
    print(f"  raw safetensors save + load: {statistics.median(times):.2f} s", flush=True)
    return {"seconds": statistics.median(times), "repeats": times}


def load_saved(path: Path, mode: str) -> dict[str, Any] | None:
    """The saved entry of ``mode`` (``quick`` | ``full``), or None when the file or the entry is
    missing."""
    if not path.is_file():
        return None
    entry: dict[str, Any] | None = json.loads(path.read_text()).get(mode)
    return entry


def save_result(path: Path, mode: str, result: dict[str, Any]) -> None:
    """Write ``result`` as the entry of ``mode``, keeping the other mode's entry; creates the
    file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(previous | {mode: result}, indent=1))


def _ratios(tp: dict[str, dict[str, dict]], push: dict, raw: dict) -> dict[str, float]:
    def tps(row: str, part: str = "throughput") -> float:
        return float(tp[part][row]["tokens_per_s"])

    ratios = {
        "bucketed_vs_naive_padded": tps("bucketed") / tps("naive_padded"),
        "bucketed_vs_naive_full_logits": tps("bucketed") / tps("naive_full_logits"),
        "packed_bf16_vs_bucketed": tps("packed_bf16") / tps("bucketed"),
        "packed_vs_bucketed": tps("packed") / tps("bucketed"),
        "bucketed_bf16_vs_bucketed": tps("bucketed_bf16") / tps("bucketed"),
        "packed_bf16_vs_bucketed_2_threads": tps("packed_bf16", "threads_2")
        / tps("bucketed", "threads_2"),
    }
    for part, suffix in (
        ("throughput", ""),
        ("threads_2", "_2_threads"),
    ):  # saved results may lack the row
        if "packed_bf16_shared" in tp[part]:
            ratios[f"packed_bf16_shared_vs_packed_bf16{suffix}"] = tps(
                "packed_bf16_shared", part
            ) / tps("packed_bf16", part)
    # A push entry saved by an older version of this bench may lack a figure: leave its ratio out.
    for name, key in [
        ("publish_to_serving", "publish_to_serving_s"),
        ("export_to_serving", "total_s"),
        ("server_update", "server_update_s"),
    ]:
        if key in push:
            ratios[f"{name}_vs_raw_save_load"] = push[key] / raw["seconds"]
    return ratios


def _push_part(smol: Path, env: DistEnv, repeats: int) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"push latency: {smol.name}, 2 CPU inference servers", flush=True)
        push = asyncio.run(_push_bench(smol, env, repeats, work))
        raw = _raw_save_load(smol, work, repeats)
    return push, raw


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model for the throughput part")
    p.add_argument(
        "--smoke", action="store_true", help="tiny model for both, 8 samples, 1 push (tests)"
    )
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per config (default 256 quick, 32 full, 8 smoke)",
    )
    p.add_argument("--repeats", type=int, default=None, help="push repeats (default 3; --smoke 1)")
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {RESULTS})")
    part = p.add_mutually_exclusive_group()
    part.add_argument(
        "--push-only", action="store_true", help="rerun the push part; keep the saved throughput"
    )
    part.add_argument(
        "--throughput-only", action="store_true", help="rerun throughput; keep the saved push"
    )
    part.add_argument(
        "--memory-only", action="store_true", help="rerun the memory part; keep the rest"
    )
    p.add_argument("--log-level", default="warning", help="info shows each server's load time")
    child = p.add_argument_group("one throughput row in this process (what the bench runs)")
    child.add_argument("--row", choices=tuple(ROWS), default=None, help=argparse.SUPPRESS)
    child.add_argument("--row-mode", choices=tuple(SIZES), default="full", help=argparse.SUPPRESS)
    child.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    child.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    a = _args()
    configure_logging(json=True, level=a.log_level)
    if a.row is not None:
        print(json.dumps(_row_child(a.row, a.row_mode, a.samples, a.threads, a.batches)))
        return 0
    torch.set_num_threads(1)  # the learner's setting in `leafe run` (a shared 2-core CPU)
    env = init_distributed("gloo")
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    out = a.out or (SMOKE_OUT if a.smoke else RESULTS)
    saved = load_saved(out, mode)
    host = host_record()
    if (
        a.memory_only
    ):  # the memory part carries its own host: the saved figures may come from another
        memory = memory_part(*MEMORY.get(mode, ("smollm2-135m-instruct", 16, (150, MAX_PROMPT))))
        save_result(out, mode, (saved or {}) | {"memory": memory})
        print(f"wrote {out}")
        return 0
    _, default_n, gb, budget, push_name = SIZES[mode]
    smol = resolve_model(push_name)
    n = a.samples or default_n
    repeats = a.repeats or (1 if a.smoke else 3)
    throughput_model, batches, _ = _batches(mode, n)
    print(
        f"throughput: {throughput_model.name}, {n} samples, global batch {gb}, "
        f"budget {budget} tokens"
    )
    if a.push_only and saved is not None and "threads_2" in saved:  # else saved by an older version
        tp = {k: saved[k] for k in ("throughput", "threads_2")}
        print("  (saved results)", flush=True)
    else:
        tp = _all_throughput(mode, n, len(batches))
    if a.throughput_only and saved is not None:
        push, raw = saved["push"], saved["raw_save_load"]
        print("push latency: (saved results)", flush=True)
    else:
        push, raw = _push_part(smol, env, repeats)
    print("peak memory: before / after the chunked head and activation checkpointing", flush=True)
    memory = memory_part(*MEMORY.get(mode, ("smollm2-135m-instruct", 16, (150, MAX_PROMPT))))
    ratios = _ratios(tp, push, raw)
    result = {
        "mode": mode,
        "throughput_model": throughput_model.name,
        "push_model": smol.name,
        "samples": n,
        "global_batch": gb,
        "micro_batch_tokens": budget,
        **tp,
        "push": push,
        "raw_save_load": raw,
        "ratios": ratios,
        "memory": memory,
        "host": host,
    }
    save_result(out, mode, result)
    print(json.dumps(ratios, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
