"""How the sglang router spreads a shared-prefix load over engines: requests per engine for
concurrent loops whose prompts share a prefix (agents on one task family share their system prompt
and instructions), under the router's default balance thresholds and under the settings deploy/
runs (``leafe.services.run.router.ROUTING``), through the real sglang-router 0.3.2 in front of two
CPU inference servers.

    python -m bench.router            # 12 loops x 20 requests per setting
    python -m bench.router --quick    # 12 loops x 8
    python -m bench.router --smoke --out /tmp/router.json   # seconds, for tests

Each setting gets a fresh router (an empty routing tree) over the same two engines; the settings run
in turn, twice over in alternating order (A B B A), so a slow spell of a shared machine falls on
both. What the router chose is read from its own ``smg_worker_cb_outcomes_total`` series (every
answered request, per worker). Figures: each engine's share of the requests, the larger share, and
the wall time of the load relative to the default setting's (two engines busy instead of one).
Results: ``bench/results/router.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.host import host_record
from leafe.actors.client import SGLangClient
from leafe.actors.engine import SamplingParams
from leafe.services.inference.server import InferenceConfig, InferenceServer
from leafe.services.run.router import ROUTING, RouterProcess, open_router

__all__ = ["SETTINGS", "main", "measure", "requests_per_worker"]

RESULTS = Path(__file__).resolve().parent / "results" / "router.json"
SETTINGS: dict[str, dict[str, str]] = {
    "default": {
        "--policy": "cache_aware",
        "--balance-abs-threshold": "64",
        "--balance-rel-threshold": "1.5",
    },
    "deployed": dict(ROUTING),
}
"""Routing flags compared: sglang-router 0.3.2's defaults and what deploy/ and ``leafe run`` use."""
SHARED_PREFIX = [1, *range(500, 548)]
"""48 tokens every loop's prompts start with (a system prompt and the task's instructions)."""
_OUTCOME = re.compile(r'^smg_worker_cb_outcomes_total\{worker="([^"]+)",outcome="(\w+)"\} (\S+)$')


def requests_per_worker(metrics: str) -> dict[str, int]:
    """Answered requests per worker URL from the router's Prometheus text (successes and
    failures)."""
    counts: dict[str, int] = {}
    for line in metrics.splitlines():
        m = _OUTCOME.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(3)))
    return counts


async def _load(router: RouterProcess, loops: int, requests: int, new_tokens: int) -> float:
    """``loops`` concurrent loops of ``requests`` each; every prompt is the shared prefix, the
    loop's own token, then the step (a growing episode); returns the wall seconds."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    async with SGLangClient(router.url, retries=0) as client:

        async def loop(i: int) -> None:
            history: list[int] = []
            for step in range(requests):
                history.append(600 + step)
                await client.generate([*SHARED_PREFIX, 700 + i, *history], params)

        started = time.monotonic()
        await asyncio.gather(*(loop(i) for i in range(loops)))
        return time.monotonic() - started


async def measure(
    model: str, *, loops: int, requests: int, new_tokens: int, rounds: int, work: Path
) -> dict[str, Any]:
    """Every setting of ``SETTINGS`` over two engines of ``model``, ``rounds`` times in alternating
    order; per setting the requests per engine (summed over rounds), the larger share and the wall
    seconds."""
    config = InferenceConfig(model=model, port=0, threads=1, max_batch=8)
    async with InferenceServer(config) as one, InferenceServer(config) as two:
        engines = [one.url, two.url]
        seen: dict[str, dict[str, Any]] = {
            name: {"requests": dict.fromkeys(engines, 0), "seconds": 0.0} for name in SETTINGS
        }
        order = list(SETTINGS)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                router = await open_router(
                    engines, work / f"router-{name}-{r}.log", overrides=SETTINGS[name]
                )
                try:
                    seen[name]["seconds"] += await _load(router, loops, requests, new_tokens)
                    async with (
                        aiohttp.ClientSession() as http,
                        http.get(router.metrics_url) as resp,
                    ):
                        counts = requests_per_worker(await resp.text())
                finally:
                    await router.stop(10.0)
                for url in engines:
                    seen[name]["requests"][url] += counts.get(url, 0)
    out: dict[str, Any] = {}
    for name, s in seen.items():
        per_engine = list(s["requests"].values())
        total = sum(per_engine)
        out[name] = {
            "flags": SETTINGS[name],
            "requests_per_engine": per_engine,
            "requests": total,
            "largest_share": round(max(per_engine) / total, 3) if total else None,
            "seconds": round(s["seconds"], 2),
        }
    base = out["default"]["seconds"]
    for entry in out.values():
        entry["seconds_vs_default"] = round(entry["seconds"] / base, 3) if base else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="12 loops x 8 requests, one round")
    mode.add_argument("--smoke", action="store_true", help="seconds, the tiny model (tests)")
    p.add_argument("--model", default="", help="engine model (default: SmolLM2; tiny in --smoke)")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    from leafe.learner.model_io import resolve_model, tiny_model_dir

    model = a.model or (str(tiny_model_dir()) if a.smoke else str(resolve_model("")))
    loops, requests, rounds = (4, 3, 1) if a.smoke else (12, 8, 1) if a.quick else (12, 20, 2)
    host = host_record()
    with tempfile.TemporaryDirectory(prefix="bench-router-") as work:
        settings = asyncio.run(
            measure(
                model,
                loops=loops,
                requests=requests,
                new_tokens=2 if a.smoke else 8,
                rounds=rounds,
                work=Path(work),
            )
        )
    record = {
        "host": host,
        "smoke": a.smoke,
        "quick": a.quick,
        "model": Path(model).name,
        "loops": loops,
        "requests_per_loop": rounds * requests,
        "engines": 2,
        "shared_prefix_tokens": len(SHARED_PREFIX),
        "settings": settings,
        "note": "CPU engines (1 thread each) on a shared machine; shares, not timings, are the "
        "result",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    for name, s in settings.items():
        print(
            f"{name:9s} requests per engine {s['requests_per_engine']}  largest share "
            f"{s['largest_share']}  time x{s['seconds_vs_default']} of default"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
