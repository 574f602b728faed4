"""Benchmark of the CPU inference server (services/inference/server.py) against serial HF ``generate``.

    .venv/bin/python bench/inference.py [--quick] [--model smollm2-135m-instruct] [--threads 0]

Figures (saved to bench/results/inference.json), all measured in this process on the same model:
1. throughput: generated tokens/s of the server with 1, 4 and 16 concurrent clients (fixed-length
   completions, ``ignore_eos``) against serial ``model.generate`` calls: ratio per concurrency;
2. agent-like workload: prompts of 200-600 tokens, 5-20 new tokens, 16 concurrent clients, once with
   unrelated prompts and once as 16 episodes whose prompts grow step by step (shared prefixes): where the
   engine's time goes (prefill vs decode), how much the prefix cache saves, and the speedup over serial
   ``generate`` on requests of the same workload;
3. weight reload: ``/update_weights_from_disk`` round trip (manifest check + read + validation + swap)
   against a plain safetensors load of the same file into memory (``safetensors.torch.load`` of its
   bytes; ``load_file`` alone only maps the file lazily and is reported too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import load, load_file

from actors.client import SGLangClient, parse_completions
from learner.model_io import export_weights, load_model, load_tokenizer, resolve_model, verify_manifest
from services.inference.local import ServerThread, start_in_thread
from services.inference.server import InferenceConfig
from services.inference.weights import load_weight_dir

RESULTS = Path(__file__).resolve().parent / "results" / "inference.json"
WORDS = "the box is left of the target and the player stands below it near a wall".split()


def chat_prompt(tok: Any, i: int, words: int) -> list[int]:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    msgs = [{"role": "user", "content": f"Room {i}: {text}. Which move next?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def serial_generate(model: Any, requests: list[tuple[list[int], int]], pad_id: int) -> dict[str, float]:
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


async def concurrent_load(url: str, per_client: list[list[tuple[list[int], int]]]) -> dict[str, float]:
    """Each client sends its requests one after another; all clients run at once."""
    async with SGLangClient(url) as client:

        async def run(reqs: list[tuple[list[int], int]]) -> int:
            done = 0
            for ids, n in reqs:
                sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                [c] = parse_completions(await client.generate_raw({"input_ids": ids, "sampling_params": sp}))
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


def throughput(handle: ServerThread, model: Any, tok: Any, quick: bool) -> dict[str, Any]:
    new = 16 if quick else 32
    prompts = [chat_prompt(tok, i, 12) for i in range(64)]
    serial = serial_generate(model, [(p, new) for p in prompts[: 3 if quick else 6]], tok.pad_token_id)
    out: dict[str, Any] = {
        "new_tokens": new,
        "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
        "serial_generate": serial,
        "server": {},
    }
    asyncio.run(concurrent_load(handle.url, [[(prompts[0], 4)]]))  # warm-up
    for clients in (1, 4, 16):
        rounds = 2 if quick or clients == 16 else 3
        work = [[(prompts[(c * rounds + r) % 64], new) for r in range(rounds)] for c in range(clients)]
        res = asyncio.run(concurrent_load(handle.url, work))
        res["vs_serial"] = round(res["tokens_per_s"] / serial["tokens_per_s"], 2)
        out["server"][str(clients)] = res
        print(
            f"  {clients:2d} clients: {res['tokens_per_s']:7.1f} tok/s = {res['vs_serial']:.2f}x serial "
            f"({serial['tokens_per_s']:.1f} tok/s)"
        )
    return out


def agent_requests(tok: Any, count: int, *, episodes: bool) -> list[list[tuple[list[int], int]]]:
    """16 clients' request lists, prompts of 200-600 tokens and 5-20 new tokens each. ``episodes``: each
    client is one actor episode whose prompt grows by a step line per request (shared prefixes, as
    render_messages produces); otherwise every prompt is unrelated."""
    rng = random.Random(0)
    clients: list[list[tuple[list[int], int]]] = [[] for _ in range(16)]
    for i in range(count):
        c = i % 16
        if episodes:
            step = len(clients[c])
            task = " ".join(random.Random(c).choice(WORDS) for _ in range(140))
            history = "\n".join(
                f"{t}. {rng.choice(['up', 'down', 'left', 'right'])} -> "
                + " ".join(random.Random(c * 100 + t).choice(WORDS) for _ in range(45))
                for t in range(step * 3)
            )
            msgs = [
                {"role": "user", "content": f"Task: {task}\nPrevious steps:\n{history}\nYour next action?"}
            ]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)][:600]
        else:
            ids = chat_prompt(tok, 1000 + i, 400)[: rng.randint(200, 600)]
        clients[c].append((ids, rng.randint(5, 20)))
    return clients


def agent_workload(
    handle: ServerThread, model: Any, tok: Any, quick: bool, *, episodes: bool
) -> dict[str, Any]:
    clients = agent_requests(tok, 32 if quick else 64, episodes=episodes)
    reqs = [r for c in clients for r in c]
    engine = handle.server.engine if handle.server else None
    assert engine is not None
    engine.flush_cache()
    before = dict(engine.stats.__dict__)
    res = asyncio.run(concurrent_load(handle.url, clients))
    after = engine.stats.__dict__
    delta = {k: after[k] - before[k] for k in before}
    busy = delta["prefill_s"] + delta["decode_s"]
    serial = serial_generate(
        model, [c[0] for c in clients[: 2 if quick else 4]] + [c[-1] for c in clients[:2]], tok.pad_token_id
    )
    out = {
        "shared_prefixes": episodes,
        "requests": len(reqs),
        "prompt_tokens_mean": round(statistics.mean(len(r[0]) for r in reqs), 1),
        "new_tokens_mean": round(statistics.mean(r[1] for r in reqs), 1),
        "server": res,
        "prefill_s": round(delta["prefill_s"], 3),
        "decode_s": round(delta["decode_s"], 3),
        "prefill_share": round(delta["prefill_s"] / busy, 3),
        "prompt_tokens_prefilled": delta["prefill_tokens"],
        "prompt_tokens_from_prefix_cache": delta["cached_tokens"],
        "prefill_tokens_per_s": round(delta["prefill_tokens"] / delta["prefill_s"], 1),
        "decode_tokens_per_s": round(delta["decode_tokens"] / max(delta["decode_s"], 1e-9), 1),
        "serial_generate": serial,
        "vs_serial": round(res["tokens_per_s"] / serial["tokens_per_s"], 2),
    }
    kind = "episodes (shared prefixes)" if episodes else "unrelated prompts"
    print(
        f"  agent workload, {kind}: prefill {out['prefill_share']:.0%} of engine time "
        f"({out['prefill_tokens_per_s']:.0f} prompt tok/s, {delta['cached_tokens']} of "
        f"{delta['cached_tokens'] + delta['prefill_tokens']} prompt tokens from the prefix cache), "
        f"decode {out['decode_tokens_per_s']:.0f} tok/s; {out['vs_serial']:.2f}x serial generate"
    )
    return out


def reload_latency(handle: ServerThread, model: Any, model_dir: Path, quick: bool) -> dict[str, Any]:
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
            ("load_weight_dir_s", lambda: load_weight_dir(target, engine.model, root=target.parent)),
        ]

        async def update(version: str) -> None:
            async with SGLangClient(handle.url) as client:
                [r] = await client.update_weights_from_disk(str(target), version)
                assert r.success, r.message

        for i in range(2 if quick else 4):
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (about 2-4 minutes on 2 cores)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0 = torch default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = resolve_model(a.model)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    handle = start_in_thread(
        InferenceConfig(model=str(model_dir), port=0, max_batch=16, weights_root=tempfile.gettempdir())
    )
    results: dict[str, Any] = {
        "model": a.model,
        "quick": a.quick,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg()[0],
    }
    try:
        print(f"inference bench: {a.model}, {torch.get_num_threads()} torch threads, quick={a.quick}")
        results["throughput"] = throughput(handle, model, tok, a.quick)
        results["agent_unrelated"] = agent_workload(handle, model, tok, a.quick, episodes=False)
        results["agent_episodes"] = agent_workload(handle, model, tok, a.quick, episodes=True)
        results["weight_reload"] = reload_latency(handle, model, model_dir, a.quick)
    finally:
        handle.stop()
    results["loadavg_after"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
