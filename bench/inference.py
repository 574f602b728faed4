"""Benchmark of the CPU inference server (services/inference/server.py) against serial HF
``generate``.

    .venv/bin/python -m bench.inference [--quick] [--model smollm2-135m-instruct] [--threads 0] \\
        [--out PATH]
    .venv/bin/python -m bench.inference --smoke   # tiny random model, a few requests: does it run?

``--smoke`` (the tests' check that every section still runs against today's APIs) uses the tiny
random model and a handful of requests per section, and writes to a temporary file unless ``--out``
is given.

Figures (saved to bench/results/inference.json), all measured in this process on the same model:
1. throughput: generated tokens/s of the server with 1, 4 and 16 concurrent clients (fixed-length
   completions, ``ignore_eos``) against serial ``model.generate`` calls: ratio per concurrency;
2. agent-like workload: prompts of 200-600 tokens, 5-20 new tokens, 16 concurrent clients, once with
   unrelated prompts and once as 16 episodes whose prompts grow step by step (shared prefixes):
   where the engine's time goes (prefill vs decode), how much the prefix cache saves, and the
   speedup over serial ``generate`` on requests of the same workload;
3. agent rollouts: real multi-turn episodes, Sokoban evaluation rollouts with the paper table's
   settings (5x5 rooms, <= 3 pushes, horizon 8, history window 2, 16 in flight) through the server,
   prompts and completions from the model itself: the same figures, against serial ``generate`` of a
   sample of the requests those episodes sent (same prompts, same completion lengths);
4. weight reload: ``/update_weights_from_disk`` round trip (manifest check + read + validation +
   swap) against a plain safetensors load of the same file into memory (``safetensors.torch.load``
   of its bytes; ``load_file`` alone only maps the file lazily and is reported too);
5. recorded workload: the committed recording of the actors' Sokoban evaluation requests
   (bench/workloads/sokoban_agent.json) replayed with the same token ids, seeds and completion
   lengths (``--smoke``: a workload recorded on the spot with the tiny model);
6. decode floor: one engine-style decode step (16 rows, 300 columns) in float32 and bfloat16, with
   the server's kernels and without (aten), its breakdown (linear, attention, other ops, Python
   overhead, sampling) and its distance from the compute and memory floors measured here
   (``--floor``: only this section, merged into the result file; bench/inference_floor.py).
7. memory (``--memory`` only, merged into the result file; bench/inference_memory.py): the server's
   resident set over recorded LEAFE trees replayed twice, glibc's free heap pages kept against
   trimmed.
8. eval_floor (``python -m bench.eval_floor``, merged): the paper table's Base evaluation over its
   compute floor.

Side by side with a peer engine (vLLM CPU; install and start it as docs/benchmarks.md says), as
``peer``:

    .venv/bin/python -m bench.inference --peer http://127.0.0.1:8011 [--pairs 3] [--pin-core 1]
    .venv/bin/python -m bench.inference --record-workload   # re-record the workload (a few minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file

from bench.host import host_record, keep_sections
from bench.inference_floor import floor_section
from bench.inference_memory import memory_section
from bench.inference_peer import PAPER_ROOMS, paper_rollouts, peer_section, record_workload
from bench.inference_replay import SGLangTarget, load_workload, replay
from bench.inference_workload import agent_requests, chat_prompt, ideal_prefix_share
from leafe.actors.client import SGLangClient, parse_completions
from leafe.actors.engine import Completion, SamplingParams
from leafe.actors.evaluate import evaluate
from leafe.envs.registry import make_env
from leafe.learner.model_io import (
    HFChatTokenizer,
    export_weights,
    load_model,
    load_tokenizer,
    resolve_model,
    verify_manifest,
)
from leafe.services.inference.local import ServerThread, start_in_thread
from leafe.services.inference.server import InferenceConfig
from leafe.services.inference.weights import load_weight_dir

RESULTS = Path(__file__).resolve().parent / "results" / "inference.json"
SMOKE_OUT = Path(tempfile.gettempdir()) / "leafe-bench-smoke" / "inference.json"


def serial_generate(
    model: Any, requests: list[tuple[list[int], int]], pad_id: int
) -> dict[str, float]:
    """Serial HF ``generate`` (greedy, exactly ``n`` new tokens each): tokens/s."""
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for ids, n in requests:
            x = torch.tensor([ids])
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad_id,
            )
            tokens += out.shape[1] - len(ids)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2)}


async def concurrent_load(
    url: str, per_client: list[list[tuple[list[int], int]]]
) -> dict[str, float]:
    """Each client sends its requests one after another; all clients run at once."""
    async with SGLangClient(url) as client:

        async def run(reqs: list[tuple[list[int], int]]) -> int:
            done = 0
            for ids, n in reqs:
                sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                [c] = parse_completions(
                    await client.generate_raw({"input_ids": ids, "sampling_params": sp})
                )
                done += len(c.output_ids)
            return done

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(run(r) for r in per_client)))
        wall = time.perf_counter() - t0
    return {
        "clients": len(per_client),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
    }


def pick(scale: str, smoke: Any, quick: Any, full: Any) -> Any:
    """The size of a figure at ``scale`` (``smoke``: a few requests, just to see the code run)."""
    return {"smoke": smoke, "quick": quick, "full": full}[scale]


def throughput(handle: ServerThread, model: Any, tok: Any, scale: str) -> dict[str, Any]:
    new = pick(scale, 4, 16, 32)
    prompts = [chat_prompt(tok, i, 12) for i in range(64)]
    serial = serial_generate(
        model, [(p, new) for p in prompts[: pick(scale, 2, 3, 6)]], tok.pad_token_id
    )
    out: dict[str, Any] = {
        "new_tokens": new,
        "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
        "serial_generate": serial,
        "server": {},
    }
    asyncio.run(concurrent_load(handle.url, [[(prompts[0], 4)]]))  # warm-up
    for clients in (1, 4, 16):
        rounds = pick(scale, 1, 2, 2 if clients == 16 else 3)
        work = [
            [(prompts[(c * rounds + r) % 64], new) for r in range(rounds)] for c in range(clients)
        ]
        res = asyncio.run(concurrent_load(handle.url, work))
        res["vs_serial"] = round(res["tokens_per_s"] / serial["tokens_per_s"], 2)
        out["server"][str(clients)] = res
        print(
            f"  {clients:2d} clients: {res['tokens_per_s']:7.1f} tok/s = {res['vs_serial']:.2f}x "
            f"serial ({serial['tokens_per_s']:.1f} tok/s)"
        )
    return out


def _engine_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Engine counters over a workload: time split, prompt tokens by where their KV came from."""
    delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
    busy = delta["prefill_s"] + delta["decode_s"]
    cached, computed = delta["cached_tokens"], delta["prefill_tokens"]
    shared = delta.get("shared_tokens", 0)
    return {
        "prefill_s": round(delta["prefill_s"], 3),
        "decode_s": round(delta["decode_s"], 3),
        "prefill_share": round(delta["prefill_s"] / busy, 3),
        "prefill_cpu_s": round(delta.get("prefill_cpu_s", float("nan")), 3),
        "decode_cpu_s": round(delta.get("decode_cpu_s", float("nan")), 3),
        "prompt_tokens_prefilled": computed,
        "prompt_tokens_from_prefix_cache": cached,
        "prompt_tokens_shared_in_batch": shared,
        "prefix_cache_share": round(cached / max(cached + computed, 1), 3),
        "not_recomputed_share": round((cached + shared) / max(cached + shared + computed, 1), 3),
        "prefill_calls": delta["prefill_calls"],
        "decode_steps": delta["decode_steps"],
        "prefill_tokens_per_s": round(computed / max(delta["prefill_s"], 1e-9), 1),
        "decode_tokens_per_s": round(delta["decode_tokens"] / max(delta["decode_s"], 1e-9), 1),
    }


def agent_workload(
    handle: ServerThread, model: Any, tok: Any, scale: str, *, episodes: bool
) -> dict[str, Any]:
    clients = agent_requests(tok, pick(scale, 16, 32, 64), episodes=episodes)
    reqs = [r for c in clients for r in c]
    engine = handle.server.engine if handle.server else None
    assert engine is not None
    engine.flush_cache()
    before = dict(engine.describe())
    res = asyncio.run(concurrent_load(handle.url, clients))
    stats = _engine_delta(before, engine.describe())
    first, last = (
        [c[0] for c in clients[: pick(scale, 2, 2, 4)]],
        [c[-1] for c in clients[: pick(scale, 0, 2, 2)]],
    )
    serial = serial_generate(model, first + last, tok.pad_token_id)
    out = {
        "shared_prefixes": episodes,
        "requests": len(reqs),
        "prompt_tokens_mean": round(statistics.mean(len(r[0]) for r in reqs), 1),
        "new_tokens_mean": round(statistics.mean(r[1] for r in reqs), 1),
        "server": res,
        **stats,
        "ideal_prefix_share": ideal_prefix_share(
            [c[t][0] for t in range(max(map(len, clients))) for c in clients if t < len(c)]
        ),
        "serial_generate": serial,
        "vs_serial": round(res["tokens_per_s"] / serial["tokens_per_s"], 2),
    }
    kind = "episodes (shared prefixes)" if episodes else "unrelated prompts"
    print(
        f"  agent workload, {kind}: prefill {out['prefill_share']:.0%} of engine time "
        f"({out['prefill_tokens_per_s']:.0f} prompt tok/s, {stats['prefix_cache_share']:.0%} of "
        f"prompt tokens from the prefix cache of at most {out['ideal_prefix_share']:.0%}), decode "
        f"{out['decode_tokens_per_s']:.0f} tok/s; {out['vs_serial']:.2f}x serial generate"
    )
    return out


class RecordingClient(SGLangClient):
    """The actors' client, remembering each request's prompt and completion length."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.requests: list[tuple[list[int], int]] = []

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
        timeout_s: float | None = None,
    ) -> list[Completion]:
        out = await super().generate(
            input_ids, params, n=n, return_logprob=return_logprob, timeout_s=timeout_s
        )
        self.requests += [(list(input_ids), len(c.output_ids)) for c in out]
        return out


def agent_rollouts(handle: ServerThread, model: Any, tok: Any, scale: str) -> dict[str, Any]:
    """Sokoban evaluation rollouts through the server (real multi-turn agent episodes)."""
    engine = handle.server.engine if handle.server else None
    assert engine is not None
    tasks, samples = pick(scale, (1, 2), (2, 8), (4, 16))
    env = make_env("sokoban", **PAPER_ROOMS)
    task_ids = env.tasks("test")[:tasks]
    env.close()
    engine.flush_cache()
    before = dict(engine.describe())
    client = RecordingClient(handle.url)
    request = paper_rollouts(task_ids, samples)

    async def run() -> Any:
        async with client:
            return await evaluate(request, engine=client, tokenizer=HFChatTokenizer(tok))

    t0 = time.perf_counter()
    result = asyncio.run(run())
    wall = time.perf_counter() - t0
    stats = _engine_delta(before, engine.describe())
    tokens = sum(n for _, n in client.requests)
    sample = random.Random(0).sample(
        client.requests, min(len(client.requests), pick(scale, 2, 4, 8))
    )
    serial = serial_generate(model, sample, tok.pad_token_id)
    out = {
        "episodes": result.episodes,
        "requests": len(client.requests),
        "prompt_tokens_mean": round(statistics.mean(len(r[0]) for r in client.requests), 1),
        "new_tokens_mean": round(tokens / len(client.requests), 1),
        "server": {
            "wall_s": round(wall, 3),
            "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
        },
        **stats,
        "ideal_prefix_share": ideal_prefix_share([ids for ids, _ in client.requests]),
        "serial_generate": serial,
        "vs_serial": round(tokens / wall / serial["tokens_per_s"], 2),
    }
    print(
        f"  agent rollouts ({result.episodes} Sokoban episodes, {len(client.requests)} requests): "
        f"prefill {stats['prefill_share']:.0%} of engine time, "
        f"{stats['prefix_cache_share']:.0%} of prompt tokens "
        f"from the prefix cache of at most {out['ideal_prefix_share']:.0%} "
        f"({stats['not_recomputed_share']:.0%} not recomputed); "
        f"{out['vs_serial']:.2f}x serial generate"
    )
    return out


def recorded_workload(handle: ServerThread, scale: str) -> dict[str, Any]:
    """The recorded agent workload replayed through this process's server (the peer section's
    workload; ``smoke``: recorded here with the tiny model, which checks the recorder too)."""
    if scale == "smoke":
        path = Path(tempfile.gettempdir()) / "sokoban_agent_tiny.json"
        record_workload(path, model="tiny", tasks=1, samples=2)
        reqs, meta = load_workload(path)
    else:
        reqs, meta = load_workload()
    out = asyncio.run(replay(SGLangTarget(handle.url), reqs, limit=pick(scale, None, 64, None)))
    out["workload_ideal_prefix_share"] = meta["ideal_prefix_share"]
    print(
        f"  recorded workload ({out['requests']} requests): "
        f"{out['completion_tokens_per_s']:.1f} tok/s, "
        f"latency {out['latency_mean_s']:.2f} s, prefix reuse {out['prefix_cache_share']:.0%}"
    )
    return out


def reload_latency(handle: ServerThread, model: Any, model_dir: Path, scale: str) -> dict[str, Any]:
    engine = handle.server.engine if handle.server else None
    assert engine is not None
    timings: dict[str, list[float]] = {
        "plain_load_s": [],
        "lazy_load_file_s": [],
        "manifest_check_s": [],
        "load_weight_dir_s": [],
        "reload_s": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "step-1"
        export_weights(model.state_dict(), target, config_dir=model_dir, version="step-1")
        size = (target / "model.safetensors").stat().st_size
        steps: list[tuple[str, Any]] = [
            ("plain_load_s", lambda: load((target / "model.safetensors").read_bytes())),
            ("lazy_load_file_s", lambda: load_file(str(target / "model.safetensors"))),
            ("manifest_check_s", lambda: verify_manifest(target)),
            (
                "load_weight_dir_s",
                lambda: load_weight_dir(target, engine.model, root=target.parent),
            ),
        ]

        async def update(version: str) -> None:
            async with SGLangClient(handle.url) as client:
                [r] = await client.update_weights_from_disk(str(target), version)
                assert r.success, r.message

        for i in range(pick(scale, 1, 2, 4)):
            for name, fn in steps:
                t0 = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            asyncio.run(update(f"step-{i + 1}"))
            timings["reload_s"].append(time.perf_counter() - t0)
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in timings.items()}
    out["bytes"] = size
    out["ratio"] = round(out["reload_s"] / out["plain_load_s"], 2)
    print(
        f"  weight reload {out['reload_s']:.2f} s vs plain safetensors load (into memory) "
        f"{out['plain_load_s']:.2f} s = {out['ratio']:.1f}x; sha256 manifest check alone "
        f"{out['manifest_check_s']:.2f} s (lazy mmap load_file {out['lazy_load_file_s']:.3f} s)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer requests (about 2-4 minutes on 2 cores)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny model, a few requests: runs? (tests; seconds)"
    )
    p.add_argument("--model", default=None, help="default smollm2-135m-instruct (--smoke: tiny)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads for both sides (0 = torch default)"
    )
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {RESULTS})")
    p.add_argument(
        "--peer", metavar="URL", help="only: A/B/A against this OpenAI-compatible peer (vLLM)"
    )
    p.add_argument(
        "--peer-kind",
        choices=("vllm", "llama_cpp"),
        default="vllm",
        help="--peer: vLLM CPU (section peer) or llama-cpp-python's server (peer_llama_cpp)",
    )
    p.add_argument(
        "--peer-pid",
        type=int,
        default=None,
        help="--peer: the peer server's process id, for CPU seconds a token (a shared machine)",
    )
    p.add_argument("--pairs", type=int, default=3, help="--peer: peer runs (ours runs one more)")
    p.add_argument(
        "--limit", type=int, default=None, help="--peer: replay only the first N requests"
    )
    p.add_argument(
        "--ours-url", default=None, help="--peer: our server already running (else started)"
    )
    p.add_argument(
        "--pin-core", type=int, default=1, help="--peer: core our started server is pinned to"
    )
    p.add_argument(
        "--record-workload", action="store_true", help="only: re-record the agent workload"
    )
    p.add_argument(
        "--floor", action="store_true", help="only: the decode_floor section, merged into --out"
    )
    p.add_argument(
        "--memory", action="store_true", help="only: the memory section, merged into --out"
    )
    a = p.parse_args(argv)
    if a.record_workload:
        print(json.dumps(record_workload(), indent=1))
        return 0
    if a.peer:
        return peer_section(a, a.out or RESULTS)
    scale = "smoke" if a.smoke else "quick" if a.quick else "full"
    name = a.model or ("tiny" if a.smoke else "smollm2-135m-instruct")
    out = a.out or (SMOKE_OUT if a.smoke else RESULTS)
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = resolve_model(name)
    if a.floor or a.memory:
        merged = json.loads(out.read_text()) if out.exists() else {}
        host = (
            host_record()
        )  # a merged section carries its own: the others may come from another host
        if a.floor:
            floor = floor_section(model_dir, pick(scale, 2, 10, 30), pick(scale, 40, 300, 300))
            merged["decode_floor"] = {"host": host, **floor}
        else:  # its own processes, each with its own host record
            merged["memory"] = memory_section(a.smoke, pick(scale, 1, 4, 12), pick(scale, 1, 2, 2))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merged, indent=1))
        print(json.dumps(merged["memory" if a.memory else "decode_floor"], indent=1))
        return 0
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    handle = start_in_thread(
        InferenceConfig(
            model=str(model_dir), port=0, max_batch=16, weights_root=tempfile.gettempdir()
        )
    )
    results: dict[str, Any] = {
        "model": name,
        "quick": a.quick,
        "smoke": a.smoke,
        "host": host_record(),
    }
    try:
        print(f"inference bench: {name}, {torch.get_num_threads()} torch threads, {scale}")
        results["throughput"] = throughput(handle, model, tok, scale)
        results["agent_unrelated"] = agent_workload(handle, model, tok, scale, episodes=False)
        results["agent_episodes"] = agent_workload(handle, model, tok, scale, episodes=True)
        results["agent_rollouts"] = agent_rollouts(handle, model, tok, scale)
        results["recorded_workload"] = recorded_workload(handle, scale)
        results["weight_reload"] = reload_latency(handle, model, model_dir, scale)
        results["decode_floor"] = floor_section(
            model_dir, pick(scale, 2, 10, 30), pick(scale, 40, 300, 300)
        )
    finally:
        handle.stop()
    results["loadavg_after"] = os.getloadavg()[0]
    results = keep_sections(out, results, ("peer", "peer_llama_cpp"))  # measured by --peer
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
