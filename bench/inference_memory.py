"""The inference server's resident memory over a long workload, with and without giving glibc's free
heap pages back (``trim_every_s``); the ``memory`` section of ``bench/inference.py``.

| variant | the server                                                                             |
|---------|----------------------------------------------------------------------------------------|
| kept    | ``trim_every_s = 0``: glibc's default, free holes stay resident                        |
|         | (the server before the fix)                                                            |
| trimmed | the default ``trim_every_s``: ``malloc_trim`` between steps or once idle after work    |

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
    .venv/bin/python -m bench.inference_memory --child trimmed --trees 2 --passes 1   # one variant
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("kept", "trimmed")
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
    config = msgspec.structs.replace(
        config,
        dtype="bfloat16" if cpu_has_native_bf16() else "float32",
        trim_every_s=config.trim_every_s if variant == "trimmed" else 0.0,
    )
    handle = start_in_thread(config)
    out: dict[str, Any] = {
        "variant": variant,
        "dtype": config.dtype,
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
                    "trim_s": round(stats.trim_s, 3),
                }
            )
            print(json.dumps(out["passes"][-1]), file=sys.stderr, flush=True)
    finally:
        handle.stop()
    return out


def memory_section(smoke: bool, trees: int, passes: int, in_flight: int = 16) -> dict[str, Any]:
    """Run each variant in a process of its own; ratios ``trimmed / kept`` of the last pass."""
    from bench.host import host_record

    section: dict[str, Any] = {
        "host": host_record(),
        "trees": trees,
        "passes": passes,
        "in_flight": in_flight,
    }
    for variant in VARIANTS:
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
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.inference_memory",
                *args,
                *(["--smoke"] if smoke else []),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"variant {variant} exited {run.returncode}:\n{run.stderr[-3000:]}")
        section[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    kept, trimmed = section["kept"]["passes"][-1], section["trimmed"]["passes"][-1]

    def cpu_per_token(p: dict[str, Any]) -> float:
        return (p["user_s"] + p["kernel_s"]) / p["completion_tokens"]

    section["ratios"] = {
        "rss": round(trimmed["rss_gb"] / kept["rss_gb"], 3),
        "peak_rss": round(trimmed["peak_rss_gb"] / kept["peak_rss_gb"], 3),
        "cpu_per_token": round(cpu_per_token(trimmed) / cpu_per_token(kept), 3),
        "completion_tokens_per_s": round(
            trimmed["completion_tokens_per_s"] / kept["completion_tokens_per_s"], 3
        ),
    }
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--child", choices=VARIANTS, required=True, help="run one variant, print its JSON"
    )
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--trees", type=int, default=12)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=16)
    a = p.parse_args(argv)
    print(json.dumps(_child(a.child, a.smoke, a.trees, a.passes, a.in_flight)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
