"""Side by side with a peer engine (vLLM CPU or llama.cpp) on the recorded agent workload (for
``bench/inference.py``).

``record_workload`` records ``bench/workloads/sokoban_agent.json`` with the project's own actors;
``peer_ab`` replays it interleaved A/B/A against our server (started here, pinned to one core with
one compute thread, or given by URL) and the peer (started by the user, pinned the same way). Given
the peer's process id it also reports each side's CPU seconds a completion token (user + system of
the server process, read from ``/proc``): on a shared machine the wall time also holds the time a
server waited for its core. The commands (install, start the peer, run) are in docs/benchmarks.md,
"Side by side with vLLM CPU" and "Side by side with llama.cpp".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.host import commit, host_record
from bench.inference_replay import (
    WORKLOAD,
    LlamaCppTarget,
    OpenAITarget,
    RecordingClient,
    SGLangTarget,
    ideal_share,
    load_workload,
    replay,
    save_workload,
)
from leafe.actors.evaluate import EvalRequest

__all__ = [
    "PAPER_ROOMS",
    "cpu_seconds",
    "ours_pinned",
    "paper_rollouts",
    "peer_ab",
    "peer_section",
    "record_workload",
]

ROOT = Path(__file__).resolve().parents[1]
PAPER_ROOMS = {"height": 5, "width": 5, "num_boxes": 1, "max_solution_len": 3, "max_steps": 8}
"""experiments/paper_table.py's ``full`` scale rooms (its evaluation: horizon 8, history window
2)."""


def paper_rollouts(task_ids: list[str], samples: int) -> EvalRequest:
    """Evaluation rollouts with the paper table's settings, 16 in flight (the agent workload's
    shape)."""
    return EvalRequest(
        env="sokoban", env_options=PAPER_ROOMS, task_ids=task_ids, split="test", samples=samples,
        ks=[1], run_id="bench", label="bench", concurrency=16, seed=12345,
        rollout_overrides={"horizon": 8, "history_window": 2},
    )  # fmt: skip


def record_workload(
    out: Path = WORKLOAD, *, model: str = "smollm2-135m-instruct", tasks: int = 4, samples: int = 8
) -> dict[str, Any]:
    """Record Sokoban evaluation rollouts (``tasks`` test tasks x ``samples``, 16 in flight, horizon
    8, history window 2) sent through our server (bf16, one thread) and save them to ``out``;
    returns the recording's meta. 4 x 8 gives about 256 requests (most episodes use all 8 turns)."""
    from leafe.actors.evaluate import evaluate
    from leafe.envs.registry import make_env
    from leafe.learner.model_io import HFChatTokenizer, load_tokenizer, resolve_model
    from leafe.services.inference.local import start_in_thread
    from leafe.services.inference.server import InferenceConfig

    model_dir = resolve_model(model)
    env = make_env("sokoban", **PAPER_ROOMS)
    task_ids = env.tasks("test")[:tasks]
    env.close()
    config = InferenceConfig(
        model=str(model_dir), port=0, max_batch=16, dtype="bfloat16", threads=1
    )
    handle = start_in_thread(config)
    client = RecordingClient(handle.url)
    request = paper_rollouts(task_ids, samples)

    async def run() -> Any:
        async with client:
            return await evaluate(
                request, engine=client, tokenizer=HFChatTokenizer(load_tokenizer(model_dir))
            )

    t0 = time.perf_counter()
    try:
        result = asyncio.run(run())
    finally:
        handle.stop()
    reqs = client.recorded
    meta = {
        "model": model,
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "server": {"dtype": "bfloat16", "threads": 1, "max_batch": 16},
        "evaluation": {"env": "sokoban", "rooms": PAPER_ROOMS, "task_ids": task_ids,
                       "samples": samples, "concurrency": 16, "seed": 12345, "horizon": 8,
                       "history_window": 2},
        "episodes": result.episodes,
        "requests": len(reqs),
        "prompt_tokens_mean": round(statistics.mean(len(r.input_ids) for r in reqs), 1),
        "completion_tokens_mean": round(statistics.mean(r.completion_tokens for r in reqs), 2),
        "ideal_prefix_share": ideal_share(reqs),
        "record_wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    save_workload(out, reqs, meta)
    return meta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"our server exited with {proc.returncode} before {url}/ready answered"
            )
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"our server at {url} not ready after {timeout_s} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads; ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def ours_pinned(
    model: str, core: int | None, *, dtype: str = "bfloat16"
) -> Iterator[tuple[str, int]]:
    """``leafe inference`` in a subprocess, one compute thread, pinned to ``core`` with ``taskset``
    (as the peer is); the benchmark's own process then keeps off that core. Yields the server's
    URL and process id (``taskset`` execs the server)."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "leafe.services.cli", "inference", "--model", model,
        "--port", str(port), "--dtype", dtype, "--threads", "1", "--max-batch", "16",
        "--log-level", "warning",
    ]  # fmt: skip
    if core is not None:
        if not shutil.which("taskset"):
            raise RuntimeError("--pin-core needs taskset (util-linux)")
        cmd = ["taskset", "-c", str(core), *cmd]
        others = os.sched_getaffinity(0) - {core}
        if others:
            os.sched_setaffinity(0, others)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, 300)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _warm(
    target: SGLangTarget | OpenAITarget | LlamaCppTarget, reqs: list[Any], limit: int
) -> None:
    """A few requests first: lazy initialisation (ours: torch's first calls) is not the engine's
    speed."""
    asyncio.run(replay(target, reqs, limit=limit))


def peer_ab(
    peer_url: str,
    *,
    pairs: int = 3,
    limit: int | None = None,
    ours_url: str | None = None,
    model: str = "smollm2-135m-instruct",
    pin_core: int | None = 1,
    workload: Path = WORKLOAD,
    pause_s: float = 5.0,
    peer_kind: str = "vllm",
    peer_pid: int | None = None,
    ours_pid: int | None = None,
) -> dict[str, Any]:
    """Interleaved A/B/A: ours, peer, ours, peer, ..., ours (``pairs`` peer runs bracketed by
    ``pairs + 1`` runs of ours), each from an empty prefix cache. Ratio ``i`` is ours/peer
    completion tokens/s with ours the mean of the two runs around peer run ``i`` (drift on the
    machine cancels to first order). Each run starts ``pause_s`` after the last ended: both servers
    share the pinned core, and vLLM CPU's worker keeps spinning on it for 2-3 s after its burst
    (measured with top), which would bill our next run."""
    if ours_url is None:
        with ours_pinned(model, pin_core) as (url, pid):
            out = peer_ab(
                peer_url,
                pairs=pairs,
                limit=limit,
                ours_url=url,
                model=model,
                workload=workload,
                pause_s=pause_s,
                peer_kind=peer_kind,
                peer_pid=peer_pid,
                ours_pid=pid,
            )
        return {
            **out,
            "ours_pinned_core": pin_core,
            "ours": f"leafe inference --model {model} --dtype "
            "bfloat16 --threads 1 --max-batch 16, started by the bench",
        }
    reqs, meta = load_workload(workload)
    peer: OpenAITarget | LlamaCppTarget = OpenAITarget(peer_url)
    if peer_kind == "llama_cpp":
        from leafe.learner.model_io import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(model))
        peer = LlamaCppTarget(
            peer_url,
            decode=lambda ids: tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            ),
        )
    ours = SGLangTarget(ours_url)
    pids = {"ours": ours_pid, "peer": peer_pid}
    for target in (ours, peer):
        _warm(target, reqs, 16)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "peer": []}
    for i in range(2 * pairs + 1):
        target = ours if i % 2 == 0 else peer
        time.sleep(pause_s)  # vLLM CPU's worker spins at 100% of its core for ~2-3 s after a burst
        pid = pids[target.name]
        cpu0 = cpu_seconds(pid) if pid else 0.0
        row = asyncio.run(replay(target, reqs, limit=limit))
        if pid:
            row["server_cpu_s"] = round(cpu_seconds(pid) - cpu0, 2)
            row["server_cpu_ms_per_token"] = round(
                1000 * row["server_cpu_s"] / row["completion_tokens"], 2
            )
        row["loadavg"] = round(os.getloadavg()[0], 2)
        runs[target.name].append(row)
        print(
            f"  {target.name:4s} run {len(runs[target.name])}: "
            f"{row['completion_tokens_per_s']:6.1f} tok/s, "
            f"latency {row['latency_mean_s']:.2f} s, wall {row['wall_s']:.1f} s, prefix reuse "
            f"{row['prefix_cache_share']}",
            flush=True,
        )
    tps = {k: [r["completion_tokens_per_s"] for r in v] for k, v in runs.items()}
    ratios = [
        round((tps["ours"][i] + tps["ours"][i + 1]) / 2 / tps["peer"][i], 3) for i in range(pairs)
    ]
    lat = [
        round((runs["ours"][i]["latency_mean_s"] + runs["ours"][i + 1]["latency_mean_s"]) / 2
              / runs["peer"][i]["latency_mean_s"], 3)
        for i in range(pairs)
    ]  # fmt: skip
    cpu: dict[str, Any] = {}
    if ours_pid and peer_pid:  # peer CPU / ours CPU a token: > 1 when ours needs less
        per = {k: [r["server_cpu_ms_per_token"] for r in v] for k, v in runs.items()}
        pair_cpu = [
            round(per["peer"][i] / ((per["ours"][i] + per["ours"][i + 1]) / 2), 3)
            for i in range(pairs)
        ]
        cpu = {"ratio_cpu_per_token_peer_over_ours": {
            "pairs": pair_cpu, "mean": round(statistics.mean(pair_cpu), 3)}}  # fmt: skip
    return {
        "workload": {"file": str(workload.relative_to(ROOT)), **{k: meta[k] for k in (
            "requests", "episodes", "prompt_tokens_mean", "completion_tokens_mean",
            "ideal_prefix_share")}},
        "requests_replayed": runs["ours"][0]["requests"],
        "peer_url": peer_url,
        "peer_kind": peer_kind,
        "peer_model": peer.model,
        "ours_pinned_core": None,
        "ours": f"given by URL ({ours_url}): pinned by whoever started it",
        "runs": runs,
        "ratio_tokens_per_s": {"pairs": ratios, "mean": round(statistics.mean(ratios), 3),
                               "min": min(ratios), "max": max(ratios)},
        "ratio_latency": {"pairs": lat, "mean": round(statistics.mean(lat), 3)},
        **cpu,
    }  # fmt: skip


def peer_section(a: argparse.Namespace, out: Path) -> int:
    """``--peer``: only the A/B/A side by side, merged as ``peer`` into ``out`` (other sections
    kept)."""
    results = json.loads(out.read_text()) if out.exists() else {}
    print(
        f"inference bench: ours vs peer {a.peer}, {a.pairs} pairs, ours pinned to core {a.pin_core}"
    )
    host = host_record()
    row = peer_ab(
        a.peer,
        pairs=a.pairs,
        limit=a.limit,
        ours_url=a.ours_url,
        pin_core=a.pin_core,
        peer_kind=a.peer_kind,
        peer_pid=a.peer_pid,
    )
    when = datetime.now(UTC).isoformat(timespec="seconds")
    section = "peer" if a.peer_kind == "vllm" else f"peer_{a.peer_kind}"
    results[section] = {"measured_at": when, "host": host, **row}
    ratio = row["ratio_tokens_per_s"]
    print(f"  ours/peer completion tokens/s: {ratio['mean']:.2f} (pairs {ratio['pairs']})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"saved {out}")
    return 0
