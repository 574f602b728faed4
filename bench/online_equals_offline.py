"""Online = offline (issue 62, item 1): the online learner service, fed through a real nats-server
exactly the samples of an offline dataset, ends at the weights ``leafe train`` reaches on them.

    python -m bench.online_equals_offline           # SmolLM2-135M, real LEAFE samples, 3 steps
    python -m bench.online_equals_offline --quick   # the tiny random model, synthetic samples

Full mode replays the effect-hard model-e explore log (``experiments/results/paper_logs``, the
offline LEAFE row's samples) with ``leafe replay``, takes its first ``--steps`` x 16 samples
(dataset order) and trains them twice on one thread: ``leafe train`` (one epoch, no shuffle) and the
online learner (``OnlineLearner``, the service ``leafe learner`` runs) with the samples published on
LEAFE_SAMPLES in chunks smaller than a batch, each after the learner waited past
``max_batch_wait_s`` (samples trickling in as actors make them), then the drain's ``flush``. Both
export fp32; the record says whether every tensor is equal and the largest difference, for the
default batch floor and for ``min_batch = 1`` (the behaviour before issue 62). It also records the
cf/reh mix of batches cut in stream order against a shuffle. Saves
``bench/results/online_equals_offline.json`` (``--out``) with the host's CPU (shared machine: the
times are not the point).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench.host import host_record
from leafe.learner.checkpoint import Progress
from leafe.learner.config import BatchConfig, LearnerConfig, OptimConfig, TrainConfig, TrainerConfig
from leafe.learner.dataset import iter_samples, write_dataset
from leafe.learner.distributed import DistEnv, init_distributed, shutdown
from leafe.learner.executor import Executor
from leafe.learner.model_io import resolve_model
from leafe.learner.offline import train
from leafe.learner.trainer import StepStats, Trainer
from leafe.protocol import sample_subject
from leafe.protocol.samples import ChatMessage, Sample
from leafe.services.bus import Publisher, connect
from leafe.services.bus.nats_server import EmbeddedNats
from leafe.services.bus.streams import ensure_streams
from leafe.services.learner.control import ControlFile, LearnerControl, write_control
from leafe.services.learner.service import OnlineLearner

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "online_equals_offline.json"
LOG = ROOT / "experiments" / "results" / "paper_logs" / "effect-hard" / "explore-model.leafelog.gz"
WAIT_S = 0.5


def _trainer_cfg(global_batch: int) -> TrainerConfig:
    return TrainerConfig(
        optim=OptimConfig(lr=3e-5, warmup_steps=2, schedule="constant"),
        batch=BatchConfig(global_batch=global_batch, bucketing="pack", micro_batch_tokens=2048),
        precision="fp32",
        checkpoint_every=0,
        push_every=0,
        export_dtype="fp32",
    )


def _synthetic(n: int, run_id: str) -> list[Sample]:
    out = []
    for i in range(n):
        r = random.Random(i)
        out.append(
            Sample(
                sample_id=f"{run_id}.s{i:05d}",
                run_id=run_id,
                kind="cf" if i % 3 else "reh",
                materializer="bench/1",
                env="toy",
                task_id=f"toy/{i % 7}",
                episode_id=f"ep{i}",
                messages=[
                    ChatMessage(role="user", content="q"),
                    ChatMessage(role="assistant", content="a"),
                ],
                target_turn=1,
                prompt_ids=[r.randrange(2, 1000) for _ in range(r.randrange(4, 24))],
                completion_ids=[r.randrange(2, 1000) for _ in range(r.randrange(1, 6))],
                policy_version="default",
            )
        )
    return out


def _replayed(tmp: Path, n: int, run_id: str) -> list[Sample]:
    """The first ``n`` samples (dataset order) of the effect-hard model-e explore log, renamed into
    ``run_id`` (sample ids are deduplicated stream-wide)."""
    out = tmp / "replayed"
    tmp.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "leafe.services.cli",
            "replay",
            "--from",
            str(LOG),
            "--materializer",
            "leafe",
            "--out",
            str(out),
            "--no-progress",
        ],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    import msgspec

    samples = list(iter_samples(out))[:n]
    return [
        msgspec.structs.replace(s, sample_id=f"{run_id}.{s.sample_id}", run_id=run_id)
        for s in samples
    ]


def mix(samples: list[Sample], order: dict[str, int], gb: int) -> dict[str, Any]:
    """cf samples per batch of ``gb``: stream order (episodes in ``order``, each episode's samples
    together) against a seeded shuffle (``leafe train``)."""

    def cut(seq: list[Sample]) -> dict[str, float]:
        cf = [sum(s.kind == "cf" for s in seq[k : k + gb]) for k in range(0, len(seq) - gb + 1, gb)]
        return {
            "batches": len(cf),
            "cf_mean": round(statistics.mean(cf), 2),
            "cf_sd": round(statistics.pstdev(cf), 2),
            "without_cf": sum(c == 0 for c in cf),
        }

    stream = sorted(samples, key=lambda s: (order.get(s.episode_id, 1 << 30), s.sample_id))
    shuffled = samples[:]
    random.Random(0).shuffle(shuffled)
    return {"stream_order": cut(stream), "shuffled": cut(shuffled)}


def _finish_order(log: Path) -> dict[str, int]:
    """Episode id -> the order the log finished it (the order its samples reached the stream)."""
    import gzip
    import shutil

    from leafe.protocol import decode_event
    from leafe.protocol.events import EpisodeFinished
    from leafe.services.eventlog.fileformat import iter_log_records

    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "log.leafelog"
        with gzip.open(log, "rb") as f, plain.open("wb") as g:
            shutil.copyfileobj(f, g)
        order: dict[str, int] = {}
        for rec in iter_log_records(plain):
            try:
                ev = decode_event(rec.data, rec.headers.get("Leafe-Codec"))
            except ValueError:
                continue
            if isinstance(ev, EpisodeFinished):
                order.setdefault(ev.episode_id, len(order))
    return order


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    (file,) = directory.glob("*.safetensors")
    return load_file(str(file))


async def _online(
    samples: list[Sample],
    cfg: LearnerConfig,
    url: str,
    run: str,
    model: Path,
    env: DistEnv,
    tmp: Path,
    chunk: int,
) -> tuple[Path, list[int]]:
    control = tmp / "control.json"
    write_control(control, LearnerControl(threads=1))
    sizes: list[int] = []

    def on_step(stats: StepStats, ids: list[str], _: Progress) -> None:
        sizes.append(stats.samples)

    learner = OnlineLearner(
        cfg,
        Executor(Trainer(cfg.trainer, model, env), tmp / "ckpt"),
        Progress(),
        run_id=run,
        nats=url,
        store=tmp / "store",
        base_model=str(model),
        on_step=on_step,
        control=ControlFile(control),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    nc = await connect(url)
    async with Publisher(nc.jetstream()) as pub:
        for k in range(0, len(samples), chunk):
            for s in samples[k : k + chunk]:
                await pub.publish(sample_subject(s.run_id, s.kind), s)
            await pub.flush()
            await asyncio.sleep(3 * WAIT_S)
    await nc.close()
    full = len(samples) // cfg.trainer.batch.global_batch * cfg.trainer.batch.global_batch
    for target in (full, len(samples)):  # the full batches, then (flushed) the tail
        if target == len(samples):
            write_control(control, LearnerControl(threads=1, flush=True))
        for _ in range(9000):
            if sum(sizes) >= target or task.done():
                break
            await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, 1800)
    return tmp / "store" / "v000001", sizes


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    diffs = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}
    return {
        "identical": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
        "tensors": len(a),
        "tensors_differing": sum(d > 0 for d in diffs.values()),
        "max_abs_diff": max(diffs.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", "--smoke", action="store_true", help="tiny model, synthetic samples")
    p.add_argument("--steps", type=int, default=3, help="full batches (the tail adds one)")
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {OUT})")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gb = 8 if args.quick else 16
    n = args.steps * gb + gb // 2  # full batches and a partial tail
    env = init_distributed("gloo")
    result: dict[str, Any] = {"host": host_record(), "shared_machine": True, "quick": args.quick}
    try:
        with tempfile.TemporaryDirectory(prefix="leafe-oeo-") as tmp_s:
            tmp = Path(tmp_s)
            model = resolve_model("tiny" if args.quick else "smollm2-135m-instruct")
            run = "oeo"
            samples = _synthetic(n, run) if args.quick else _replayed(tmp, n, run)
            data = tmp / "data"
            write_dataset(samples, data, materializer={"name": "bench"}, shard_size=64)
            t0 = time.perf_counter()
            tcfg = _trainer_cfg(gb)
            off = train(
                TrainConfig(trainer=tcfg, epochs=1, shuffle=False),
                data,
                str(model),
                tmp / "train",
                env,
                resume=False,
            )
            offline = _weights(Path(off.final_dir))
            result["offline"] = {"steps": off.steps, "seconds": round(time.perf_counter() - t0, 1)}
            ordered = sorted(samples, key=lambda s: s.sample_id)  # the dataset's order
            arms: dict[str, Any] = {}
            with EmbeddedNats(tmp / "nats") as server:

                async def streams() -> None:
                    nc = await connect(server.url)
                    await ensure_streams(nc.jetstream())
                    await nc.close()

                asyncio.run(streams())
                for name, floor in (("floor_default", 0), ("min_batch_1", 1)):
                    cfg = LearnerConfig(
                        trainer=tcfg,
                        ack_wait_s=60.0,
                        max_batch_wait_s=WAIT_S,
                        min_batch=floor,
                    )
                    arm_run = f"{run}-{name.replace('_', '-')}"
                    import msgspec

                    arm = [
                        msgspec.structs.replace(
                            s,
                            sample_id=s.sample_id.replace(f"{run}.", f"{arm_run}.", 1),
                            run_id=arm_run,
                        )
                        for s in ordered
                    ]
                    t0 = time.perf_counter()
                    pushed, sizes = asyncio.run(
                        _online(arm, cfg, server.url, arm_run, model, env, tmp / name, gb // 2 + 1)
                    )
                    arms[name] = {
                        "min_batch": floor,
                        "step_samples": sizes,
                        "seconds": round(time.perf_counter() - t0, 1),
                        **_compare(_weights(pushed), offline),
                    }
            result["samples"] = len(samples)
            result["global_batch"] = gb
            result["model"] = "tiny" if args.quick else "smollm2-135m-instruct"
            result["source"] = "synthetic" if args.quick else str(LOG.relative_to(ROOT))
            result["online"] = arms
            if not args.quick:
                result["batch_mix"] = mix(
                    _replayed(tmp / "all", 10**9, run), _finish_order(LOG), 16
                )
    finally:
        shutdown(env)
    out = args.out or OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for name, arm in result["online"].items():
        print(
            f"{name}: steps {arm['step_samples']} (offline {result['offline']['steps']}), "
            f"identical {arm['identical']}, max |diff| {arm['max_abs_diff']:.3g}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
