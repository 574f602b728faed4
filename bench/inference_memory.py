"""The inference server's resident memory over a long workload, with and without giving glibc's free
heap pages back, by each trimming policy of the engine; the ``memory`` section of
``bench/inference.py``.

| variant  | the server                                                                           |
|----------|--------------------------------------------------------------------------------------|
| kept     | no trims: glibc's default, free holes stay resident (the server before any fix)      |
| periodic | ``trim_every_s = 10``: ``malloc_trim`` between steps or once idle, at most every 10 s|
|          | (the default before ``trim_idle_s``/``trim_growth_mb``)                              |
| grown    | the defaults: a trim once idle ``trim_idle_s`` after work, and between steps only    |
|          | once the resident set grew by ``trim_growth_mb`` since the last trim                 |
| jemalloc | no trims, jemalloc instead of glibc's malloc (``LD_PRELOAD``, pages returned by its  |
|          | background thread after ``dirty_decay_ms``); only where ``LEAFE_BENCH_JEMALLOC``     |
|          | names a ``libjemalloc.so`` (no Python package ships one: e.g. Debian's libjemalloc2) |

The workload is Stage 1's own: the first ``trees`` recorded LEAFE trees of
``bench/actor_trees.py``'s log (steps and reflections with their exact prompt ids and completion
lengths), replayed ``passes`` times against a server serving SmolLM2-135M (one thread, bf16 where
the CPU has it natively, as ``leafe run`` serves it), ``in_flight`` trees at once. Each variant is
its own process (the server in a thread, the replay client beside it): after each pass its resident
set, the 64 MB arena heaps glibc has mapped, the process's CPU seconds (user and kernel: page faults
are kernel time), its minor page faults, completion tokens a second and the trims so far, and its
peak resident set (its own ``VmHWM``; ``ru_maxrss`` would include the forking parent's).
``--smoke``: the tiny model on a workload it records itself (a check that the section runs, not a
measurement).

    .venv/bin/python -m bench.inference --memory   # the section, merged into the results
    .venv/bin/python -m bench.inference_memory --child grown --trees 2 --passes 1   # one variant
    .venv/bin/python -m bench.inference_memory --rounds 2 --trees 4   # all, twice in turn (stdout)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("kept", "periodic", "grown", "jemalloc")
PERIODIC_S = 10.0
"""``trim_every_s`` of the ``periodic`` variant: the engine's default before the growth bound."""
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
HEAP_BYTES = 64 * 2**20
"""Size of a glibc arena heap (``HEAP_MAX_SIZE`` on 64-bit): a thread's arena grows by these."""


def _rss_gb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e9


def _arena_heaps() -> int:
    """Anonymous mappings of 50-64 MB: glibc's arena heaps (a torch tensor that size is one too,
    rarely)."""
    n = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        n += len(fields) == 5 and 50 * 2**20 < hi - lo <= HEAP_BYTES
    return n


def _workload(smoke: bool, trees: int) -> tuple[str, list[Any]]:
    from bench.actor_trees import LOG, workload_from_log
    from bench.inference_replay import load_workload
    from leafe.learner.model_io import HFChatTokenizer, resolve_model
    from leafe.services.eventlog.fileformat import read_events

    if smoke:
        from bench.inference_peer import record_workload

        path = Path(tempfile.gettempdir()) / "sokoban_agent_tiny_memory.json"
        record_workload(path, model="tiny", tasks=1, samples=2)
        return "tiny", load_workload(path)[0]
    model_dir = resolve_model("smollm2-135m-instruct")
    return str(model_dir), workload_from_log(
        read_events(LOG), trees, HFChatTokenizer.from_dir(model_dir)
    )[0]


def _child(variant: str, smoke: bool, trees: int, passes: int, in_flight: int) -> dict[str, Any]:
    import msgspec

    from bench.host import peak_rss_kib
    from bench.inference_replay import SGLangTarget, replay
    from leafe.learner.fsdp import cpu_has_native_bf16
    from leafe.services.inference.local import start_in_thread
    from leafe.services.inference.server import InferenceConfig

    model, requests = _workload(smoke, trees)
    config = InferenceConfig(model=model, port=0, threads=1, weights_root=tempfile.gettempdir())
    trims = {
        "kept": {"trim_idle_s": 0.0, "trim_growth_mb": 0, "trim_every_s": 0.0},
        "periodic": {"trim_idle_s": 0.0, "trim_growth_mb": 0, "trim_every_s": PERIODIC_S},
        "grown": {},
        "jemalloc": {"trim_idle_s": 0.0, "trim_growth_mb": 0, "trim_every_s": 0.0},
    }[variant]
    config = msgspec.structs.replace(
        config, dtype="bfloat16" if cpu_has_native_bf16() else "float32", **trims
    )
    handle = start_in_thread(config)
    out: dict[str, Any] = {
        "variant": variant,
        "dtype": config.dtype,
        "trim_idle_s": config.trim_idle_s,
        "trim_growth_mb": config.trim_growth_mb,
        "trim_every_s": config.trim_every_s,
    }
    out |= {"requests": len(requests), "rss_start_gb": round(_rss_gb(), 3), "passes": []}

    try:
        for _ in range(passes):
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run = asyncio.run(replay(SGLangTarget(handle.url), requests, in_flight=in_flight))
            after = resource.getrusage(resource.RUSAGE_SELF)
            assert handle.server is not None and handle.server.engine is not None
            stats = handle.server.engine.stats
            out["passes"].append(
                {
                    "rss_gb": round(_rss_gb(), 3),
                    "peak_rss_gb": round(peak_rss_kib() * 1024 / 1e9, 3),
                    "arena_heaps": _arena_heaps(),
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "user_s": round(after.ru_utime - before.ru_utime, 1),
                    "kernel_s": round(after.ru_stime - before.ru_stime, 1),
                    "minor_faults": after.ru_minflt - before.ru_minflt,
                    "completion_tokens": run["completion_tokens"],
                    "completion_tokens_per_s": run["completion_tokens_per_s"],
                    "trims": stats.trims,
                    "busy_trims": stats.busy_trims,
                    "trim_s": round(stats.trim_s, 3),
                }
            )
            print(json.dumps(out["passes"][-1]), file=sys.stderr, flush=True)
    finally:
        handle.stop()
    return out


def memory_section(
    smoke: bool, trees: int, passes: int, in_flight: int = 16, rounds: int = 1
) -> dict[str, Any]:
    """Run each variant in a process of its own, one after another, ``rounds`` times in turn (the
    rounds interleave them on a shared machine); ratios of the last pass of each round against
    ``kept`` and against ``periodic`` of the same round."""
    from bench.host import host_record

    jemalloc = os.environ.get("LEAFE_BENCH_JEMALLOC", "")
    variants = [v for v in VARIANTS if v != "jemalloc" or jemalloc]
    section: dict[str, Any] = {
        "host": host_record(),
        "trees": trees,
        "passes": passes,
        "in_flight": in_flight,
        "rounds": [],
    }
    for _ in range(rounds):
        section["rounds"].append(_round(variants, smoke, trees, passes, in_flight, jemalloc))
    section |= section["rounds"][-1]  # the last round's variants and ratios, under their names
    return section


def _ratios(of: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    def cpu_per_token(p: dict[str, Any]) -> float:
        return (p["user_s"] + p["kernel_s"]) / p["completion_tokens"]

    return {
        "rss": round(of["rss_gb"] / base["rss_gb"], 3),
        "peak_rss": round(of["peak_rss_gb"] / base["peak_rss_gb"], 3),
        "cpu_per_token": round(cpu_per_token(of) / cpu_per_token(base), 3),
        "completion_tokens_per_s": round(
            of["completion_tokens_per_s"] / base["completion_tokens_per_s"], 3
        ),
    }


def _round(
    variants: list[str], smoke: bool, trees: int, passes: int, in_flight: int, jemalloc: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in variants:
        args = [
            "--child",
            variant,
            "--trees",
            str(trees),
            "--passes",
            str(passes),
            "--in-flight",
            str(in_flight),
        ]
        env = dict(os.environ)
        if variant == "jemalloc":
            env |= {"LD_PRELOAD": jemalloc, "MALLOC_CONF": JEMALLOC_CONF}
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.inference_memory",
                *args,
                *(["--smoke"] if smoke else []),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"variant {variant} exited {run.returncode}:\n{run.stderr[-3000:]}")
        out[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    last = {v: out[v]["passes"][-1] for v in variants}
    out["ratios"] = {v: _ratios(last[v], last["kept"]) for v in variants if v != "kept"}
    out["ratios_to_periodic"] = {
        v: _ratios(last[v], last["periodic"]) for v in variants if v not in ("kept", "periodic")
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=VARIANTS, help="run one variant, print its JSON")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--trees", type=int, default=12)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--rounds", type=int, default=0, help="all variants this many times, in turn")
    a = p.parse_args(argv)
    if a.rounds:
        print(json.dumps(memory_section(a.smoke, a.trees, a.passes, a.in_flight, a.rounds)))
        return 0
    if a.child is None:
        p.error("--child VARIANT or --rounds N")
    print(json.dumps(_child(a.child, a.smoke, a.trees, a.passes, a.in_flight)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
