"""Every benchmark in the Makefile's ``BENCH_AREAS`` still runs: its ``--smoke`` mode (tiny inputs,
the tiny random model, seconds) as a subprocess, exactly as ``make bench`` starts it (``python -m
bench.<area>`` from the repository root), writing to a temporary file (never the committed
``bench/results/<area>.json``). Each run must exit 0 and its JSON must hold the figures the bench
promises, finite and positive where they must be, so an API change that breaks a benchmark (as
``evaluate()``'s did to ``bench/inference.py``'s agent rollouts) fails here instead of when someone
next refreshes a figure.

The smoke figures are not measurements; only their presence and sanity are checked.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.integration  # nats-server, inference servers, subprocesses


def _get(data: dict[str, Any], path: str) -> Any:
    """``data["a"]["b"]`` for ``path`` ``"a.b"``; a missing key fails naming the whole path."""
    node: Any = data
    for key in path.split("."):
        assert isinstance(node, dict) and key in node, f"{path}: no {key!r} in {node!r:.300}"
        node = node[key]
    return node


def positive(data: dict[str, Any], *paths: str) -> None:
    """Each figure exists, is a number, finite and > 0."""
    for path in paths:
        value = _get(data, path)
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{path} = {value!r}"
        assert math.isfinite(value) and value > 0, f"{path} = {value!r}: must be finite and > 0"


def share(data: dict[str, Any], *paths: str) -> None:
    """Each figure is a fraction in [0, 1]."""
    for path in paths:
        value = _get(data, path)
        assert isinstance(value, int | float) and 0.0 <= value <= 1.0, f"{path} = {value!r}"


def where(r: dict[str, Any]) -> None:
    """The record says where it was measured (``bench/host.py``): CPU model, ISA flags, threads,
    commit."""
    from bench.host import FIELDS, ISA_FLAGS

    host = _get(r, "host")
    assert set(host) == set(FIELDS), f"host record keys {sorted(host)}"
    assert host["cpu_model"] and set(host["flags"]) == set(ISA_FLAGS)
    positive(host, "cpus", "torch_threads")


def check_event_log(r: dict[str, Any]) -> None:
    assert r["smoke"] is True and r["n"] > 0
    rows = (
        "raw_publish",
        "typed_publish",
        "raw_consume_naive",
        "typed_consume",
        "raw_consume_ack_sync",
    )
    positive(r, "event_bytes", *(f"events_per_s.{k}" for k in rows))
    positive(r, *(f"ratios.{k}" for k in r["ratios"]))
    assert set(r["targets_met"]) == {"publish_ge_0.7x_raw", "consume_beats_naive"}


def check_envs(r: dict[str, Any]) -> None:
    assert r["smoke"] is True and set(r["results"]) == {"sokoban", "humaneval"}
    for name, row in r["results"].items():
        positive(row, "steps_per_s")
        for how in ("replay", "snapshot"):
            assert row["rollback_s"][how], f"{name}: no {how} rollback timed"
            positive(row["rollback_s"], *(f"{how}.{tau}" for tau in row["rollback_s"][how]))


def check_inference(r: dict[str, Any]) -> None:
    assert r["smoke"] is True and r["model"] == "tiny"
    positive(r, "throughput.serial_generate.tokens_per_s")
    for clients in ("1", "4", "16"):
        positive(
            r, f"throughput.server.{clients}.tokens_per_s", f"throughput.server.{clients}.vs_serial"
        )
    for part in ("agent_unrelated", "agent_episodes", "agent_rollouts"):
        positive(r, f"{part}.requests", f"{part}.server.tokens_per_s", f"{part}.vs_serial")
        positive(
            r,
            f"{part}.prefill_s",
            f"{part}.prompt_tokens_prefilled",
            f"{part}.prefill_tokens_per_s",
        )
        share(
            r, f"{part}.prefill_share", f"{part}.prefix_cache_share", f"{part}.ideal_prefix_share"
        )
    # The agent rollouts are real evaluate() episodes (the section that once rotted).
    positive(r, "agent_rollouts.episodes", "agent_rollouts.prompt_tokens_mean")
    # The recorded agent workload (recorded on the spot with the tiny model, then replayed): exactly
    # the recorded completion lengths came back, and the episodes' shared prefixes were reused.
    positive(r, "recorded_workload.requests", "recorded_workload.completion_tokens_per_s")
    positive(r, "recorded_workload.latency_mean_s", "recorded_workload.prefix_cache_share")
    share(
        r, "recorded_workload.not_recomputed_share", "recorded_workload.workload_ideal_prefix_share"
    )
    positive(r, "weight_reload.reload_s", "weight_reload.plain_load_s", "weight_reload.bytes")
    # The decode step against its floors, with the server's kernels installed (oneDNN linear
    # layers).
    for dtype in ("float32", "bfloat16"):
        part = f"decode_floor.{dtype}"
        positive(
            r,
            f"{part}.step_ms",
            f"{part}.step_ms_aten",
            f"{part}.compute_floor_ms",
            f"{part}.memory_floor_ms",
        )
        positive(r, f"{part}.matmul_gflops", f"{part}.read_gb_per_s", f"{part}.breakdown_ms.linear")
    assert _get(r, "decode_floor.float32.kernels.linear") == "onednn", _get(
        r, "decode_floor.float32.kernels"
    )


def check_actor(r: dict[str, Any]) -> None:
    assert r["meta"]["smoke"] is True
    for row in ("overhead_at_100ms", "overhead_at_0ms"):
        positive(r, f"{row}.engine_calls", f"{row}.actions", f"{row}.wall_s")
        assert math.isfinite(_get(r, f"{row}.overhead_per_call_ms")), row
    for row in ("service_events", "service_events_byte"):
        positive(r, f"{row}.episodes", f"{row}.events_per_s", f"{row}.ratio_to_raw_publish")
    positive(r, "raw_publish.events_per_s")
    assert set(r["prompt_reuse"]) == {"2", "0", "4", "8"}
    for window in r["prompt_reuse"]:
        positive(r, f"prompt_reuse.{window}.prompt_tokens_per_step")
        share(r, f"prompt_reuse.{window}.cache_share")
    positive(
        r, "tree_cost.trees_per_engine_cpu_minute", "tree_cost.requests", "tree_cost.engine_cpu_s"
    )
    positive(
        r,
        "tree_cost.floor.floor_s",
        "tree_cost.floor.prefill.floor_s",
        "tree_cost.floor.decode.floor_s",
    )
    # the floor times the run's own work: its passes, and every decode step at its row count
    floor, counters = r["tree_cost"]["floor"], r["tree_cost"]["engine_counters"]
    assert floor["prefill"]["passes"] == counters["prefill_calls"]
    assert floor["decode"]["steps"] == counters["decode_steps"]
    assert floor["cpu_s"] == pytest.approx(r["tree_cost"]["engine_cpu_s"], abs=0.01)
    assert {"root_step", "reflection"} <= set(r["tree_cost"]["by_kind"])
    for kind in r["tree_cost"]["by_kind"]:
        positive(r, f"tree_cost.by_kind.{kind}.requests", f"tree_cost.by_kind.{kind}.prompt_tokens")
        share(r, f"tree_cost.by_kind.{kind}.cache_share", f"tree_cost.by_kind.{kind}.ideal_share")


def check_replay(r: dict[str, Any]) -> None:
    assert r["smoke"] is True
    for key in (
        "fold_fake_tok",
        "fold_fake_tok_noverify",
        "fold_grpo",
        "fold_rft",
        "fold_real_tok",
    ):
        positive(r, f"{key}.events", f"{key}.events_per_s", f"{key}.ratio_to_decode_baseline")
        assert _get(r, f"{key}.prompt_mismatches") == 0, key
    positive(r, "fold_fake_tok.samples", "fold_fake_tok.samples_per_s")
    positive(
        r, "reader.records", "reader.read_verified_mb_per_s", "reader.verified_over_unverified"
    )
    positive(r, "service.events", "service.events_per_s", "service.samples_per_s")
    assert r["service"]["dead_letters"] == 0


def check_learner(r: dict[str, Any]) -> None:
    entry = r["smoke"]  # the mode's entry; a smoke run writes only its own
    assert (
        set(r) == {"smoke"} and entry["throughput_model"] == entry["push_model"] == "tiny-llama-s0"
    )
    rows = (
        "naive_full_logits",
        "naive_padded",
        "bucketed",
        "packed",
        "bucketed_bf16",
        "packed_bf16",
    )
    for row in (*rows, "packed_bf16_shared"):
        positive(entry, f"throughput.{row}.tokens_per_s", f"throughput.{row}.real_tokens")
    positive(entry, "threads_2.bucketed.tokens_per_s", "threads_2.packed_bf16.tokens_per_s")
    # the same samples, their shared prompt prefix once a row: fewer tokens through the model
    tp = entry["throughput"]
    assert tp["packed_bf16_shared"]["real_tokens"] == tp["packed_bf16"]["real_tokens"]
    assert tp["packed_bf16_shared"]["padded_tokens"] < tp["packed_bf16"]["padded_tokens"]
    positive(
        entry,
        "push.export_s",
        "push.publish_to_serving_s",
        "push.server_update_s",
        "raw_save_load.seconds",
    )
    positive(entry, *(f"ratios.{k}" for k in entry["ratios"]))
    # peak RSS of the learner with and without the chunked LM head (bench/learner_memory.py)
    positive(
        entry, "memory.peak_rss_gb_before", "memory.peak_rss_gb_after", "memory.peak_rss_gb_glibc"
    )
    # the default allocator setting against glibc's: the second step's time and page faults
    positive(entry, "memory.second_step_seconds_after_over_glibc")
    assert (
        entry["memory"]["second_step_faults_after"] >= 0
        and entry["memory"]["second_step_faults_glibc"] > 0
    )
    assert entry["memory"]["losses_equal"] is True, entry["memory"]


def check_router(r: dict[str, Any]) -> None:
    """Both settings ran every request through the real router (its per-worker counts add up to
    the loops' requests); shares are fractions of at least one half."""
    assert r["smoke"] is True and set(r["settings"]) == {"default", "deployed"}
    for name, s in r["settings"].items():
        assert s["requests"] == r["loops"] * r["requests_per_loop"], name
        assert len(s["requests_per_engine"]) == r["engines"] == 2
        share(s, "largest_share")
        assert s["largest_share"] >= 0.5
        positive(s, "seconds", "seconds_vs_default")


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "event_log": check_event_log,
    "envs": check_envs,
    "inference": check_inference,
    "actor": check_actor,
    "replay": check_replay,
    "learner": check_learner,
    "router": check_router,
}


def test_every_makefile_bench_area_has_a_smoke_check() -> None:
    """A bench added to ``BENCH_AREAS`` without a smoke check here would rot unseen."""
    match = re.search(r"^BENCH_AREAS\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "no BENCH_AREAS in the Makefile"
    assert sorted(match.group(1).split()) == sorted(CHECKS)


@pytest.mark.parametrize("area", list(CHECKS))
def test_bench_smoke_mode_runs_and_reports_its_figures(area: str, tmp_path: Path) -> None:
    out = tmp_path / f"{area}.json"
    committed = ROOT / "bench" / "results" / f"{area}.json"
    before = committed.read_bytes() if committed.exists() else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", f"bench.{area}", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # a hang guard: the learner and inference smokes take 60-80 s on a loaded 2-core host
        timeout=300,
    )
    assert run.returncode == 0, (
        f"bench.{area} --smoke exited {run.returncode}:\n{run.stderr[-4000:]}"
    )
    assert out.is_file(), f"bench.{area} --smoke wrote no {out}:\n{run.stdout[-2000:]}"
    record = json.loads(out.read_text())
    CHECKS[area](record)
    where(record["smoke"] if area == "learner" else record)
    after = committed.read_bytes() if committed.exists() else None
    assert after == before, f"bench.{area} --smoke changed the committed {committed}"


def test_the_inference_memory_section_runs_and_reports_every_variant(tmp_path: Path) -> None:
    """``bench/inference.py --memory --smoke``: every variant, each in its own process, a pass each
    with its resident set and CPU, each with its trimming policy, and the ratios."""
    out = tmp_path / "inference.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "bench.inference", "--memory", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"exited {run.returncode}:\n{run.stderr[-4000:]}"
    memory = json.loads(out.read_text())["memory"]
    where(memory)
    for variant in ("kept", "periodic", "grown"):
        [p] = memory[variant]["passes"]
        positive(
            p, "rss_gb", "peak_rss_gb", "user_s", "completion_tokens", "completion_tokens_per_s"
        )
    assert memory["kept"]["trim_every_s"] == 0 and memory["kept"]["passes"][0]["trims"] == 0
    assert memory["periodic"]["trim_every_s"] > 0 and memory["periodic"]["trim_idle_s"] == 0
    assert memory["grown"]["trim_every_s"] == 0 and memory["grown"]["trim_idle_s"] > 0
    assert memory["grown"]["trim_growth_mb"] > 0
    for variant in ("periodic", "grown"):
        positive(
            memory,
            f"ratios.{variant}.rss",
            f"ratios.{variant}.peak_rss",
            f"ratios.{variant}.cpu_per_token",
            f"ratios.{variant}.completion_tokens_per_s",
        )
    positive(memory, "ratios_to_periodic.grown.cpu_per_token")
