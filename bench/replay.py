"""Benchmark: materialization throughput of the replayer's pure fold and of the service end to end.

    .venv/bin/python -m bench.replay   # 1M-event fold, 200k with the real tokenizer, 100k service
    .venv/bin/python -m bench.replay --quick   # 200k / 20k / 20k
    .venv/bin/python -m bench.replay --smoke --out /tmp/replay.json   # 2k / 500 / 1k: does it run?
    .venv/bin/python -m bench.replay --only reader [--quick]   # just the log file reader (seconds)
    .venv/bin/python -m bench.replay --only fold \\
        --against ../base-worktree   # the fold, before/after

The log is synthetic but shaped like real runs: explore trees from ``actors/fake_episodes``
(breadth-first branches after periodic and failure reflections, experience in context, unparsable
completions, truncated/abandoned episodes) plus GRPO groups of 8 rollouts, interleaved across
episodes in windows. It is generated chunk by chunk and only the fold is timed, so memory stays
flat.

Figures (each also as a ratio to the baseline, msgpack-decoding the same events in the same process,
i.e. the unavoidable cost of reading the log):
- ``fold_fake_tok``: ``leafe`` over every event with a trivial byte tokenizer (prompt rendering,
  sample ids, validation and digest verification included; tokenization nearly free) -> the fold's
  own speed;
- ``fold_fake_tok_noverify``, ``fold_grpo``, ``fold_rft``: the same with verification off / other
  folds;
- ``fold_real_tok``: ``leafe`` with SmolLM2's tokenizer (the tiny model's), where tokenization
  dominates;
- ``service``: events published to an embedded nats-server, then ``Replayer`` (fake tokenizer) from
  start until every event is acked -> end-to-end events/s and samples/s including NATS;
- ``reader``: the first 200k events (50k with ``--quick``) written as a ``.leafelog`` file, whose
  records are then read back with verification (CRC32C per frame, sha256 of the whole file) and
  without, in alternating rounds over the same file -> MB/s of each and their ratio (the price of
  verification).
- ``fold_vs_base`` (``--only fold --against DIR``): the four folds above on the same 100k-event log,
  run by this script in child processes alternately on this tree's code and on DIR's (another
  worktree, e.g. the commit a change started from), ``--rounds`` times each, each fold repeated 3
  times per round; each side's best (the least disturbed on a shared machine) in events per
  wall-clock and per CPU second, and the ratios after/before (CPU time is the one other processes
  disturb least).
Results go to ``bench/results/replay.json`` (``--only reader|fold`` updates just its entry), or to
``--out``; ``--smoke`` (the tests' check that every figure still runs; not a measurement) writes to
a temporary file unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.host import host_record
from leafe.actors.fake_episodes import (
    ExploreSpec,
    build_explore_episode,
    build_rollout_group,
    interleave,
)
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import make_materializer
from leafe.protocol.codec import decode_event, encode
from leafe.protocol.events import EpisodeEvent, EpisodeFinished
from leafe.protocol.prompt import ChatTokenizer
from leafe.services.eventlog.fileformat import iter_log_records, write_events

RUN = "bench"
RESULTS = Path(__file__).resolve().parent / "results" / "replay.json"
SMOKE_OUT = Path(tempfile.gettempdir()) / "leafe-bench-smoke" / "replay.json"
SIZES = {  # scale -> events of: the fold, the real-tokenizer fold, the service, the reader
    "smoke": (2_000, 500, 1_000, 1_000),
    "quick": (200_000, 20_000, 20_000, 50_000),
    "full": (1_000_000, 200_000, 100_000, 200_000),
}


def synthetic_chunks(
    n_events: int,
    *,
    seed: int = 0,
    tokenizer: ChatTokenizer | None = None,
    window: int = 48,
    run_id: str = RUN,
) -> Iterator[list[EpisodeEvent]]:
    """Interleaved windows of ``window`` episodes until ``n_events`` events have been produced."""
    rng = random.Random(seed)
    made, k = 0, 0
    while made < n_events:
        streams: list[list[EpisodeEvent]] = []
        for _ in range(window):
            k += 1
            if rng.random() < 0.1:
                streams += build_rollout_group(
                    rng,
                    run_id=run_id,
                    group_id=f"g{k}",
                    n=8,
                    tokenizer=tokenizer,
                    p_success=0.12,
                    horizon=8,
                    retry=rng.random() < 0.1,
                )
                continue
            spec = ExploreSpec(
                seed=rng.randrange(1 << 30),
                max_depth=rng.choice([2, 3]),
                budget=rng.randint(20, 40),
                horizon=rng.randint(4, 10),
                reflect_every=rng.choice([0, 3, 4]),
                p_success=rng.choice([0.05, 0.1, 0.2]),
                p_parse_fail=0.15,
                experience_scope=rng.choice(["all", "first"]),
                history_window=rng.choice([0, 4]),
                stop_on_success=rng.random() < 0.5,
                truncate=0.5 if rng.random() < 0.03 else None,
            )
            streams.append(
                build_explore_episode(spec, run_id=run_id, episode_id=f"e{k}", tokenizer=tokenizer)
            )
        chunk = interleave(streams, rng)[: n_events - made]
        made += len(chunk)
        yield chunk


def time_fold(
    name: str,
    chunks: list[list[EpisodeEvent]] | Iterator[list[EpisodeEvent]],
    tokenizer: ChatTokenizer,
    **options: Any,
) -> dict[str, Any]:
    """Fold every chunk, timing only the fold (and the decode baseline of the same events)."""
    fold = make_materializer(name, tokenizer, **options)
    fold_s = decode_s = cpu_s = 0.0
    events = samples = 0
    for chunk in chunks:
        blobs = [encode(e) for e in chunk]
        t0 = time.perf_counter()
        for b in blobs:
            decode_event(b)
        t1, c1 = time.perf_counter(), time.process_time()
        for e in chunk:
            samples += len(fold.apply(e))
        t2, c2 = time.perf_counter(), time.process_time()
        decode_s += t1 - t0
        fold_s += t2 - t1
        cpu_s += c2 - c1
        events += len(chunk)
    t0, c0 = time.perf_counter(), time.process_time()
    samples += len(fold.close_all())
    fold_s += time.perf_counter() - t0
    cpu_s += time.process_time() - c0
    stats = fold.stats
    return {
        "materializer": name,
        "options": options,
        "events": events,
        "samples": samples,
        "fold_s": round(fold_s, 3),
        "events_per_s": round(events / fold_s),
        "events_per_cpu_s": round(events / cpu_s),
        "samples_per_s": round(samples / fold_s),
        "baseline_decode_events_per_s": round(events / decode_s),
        "ratio_to_decode_baseline": round(decode_s / fold_s, 3),
        "tokenize_calls": fold.prompts.misses,
        "tokenize_cache_hits": fold.prompts.hits,
        "prompt_mismatches": stats.prompt_mismatches,
        "prompts_verified": stats.prompts_verified,
        "samples_by_kind": dict(stats.samples),
        "rejected": stats.rejected,
    }


async def time_service(n_events: int, tokenizer: ChatTokenizer) -> dict[str, Any]:
    """Publish ``n_events`` to an embedded nats-server, then run the replayer until all are
    acked."""
    from leafe.protocol.subjects import EVENTS
    from leafe.protocol.subjects import replayer_durable as durable_name
    from leafe.services.bus import Publisher, connect, ensure_streams
    from leafe.services.bus.nats_server import EmbeddedNats
    from leafe.services.replayer.service import Replayer, ReplayerConfig

    events = [e for c in synthetic_chunks(n_events, seed=7, tokenizer=tokenizer) for e in c]
    unfinished = len(
        {e.episode_id for e in events}
        - {e.episode_id for e in events if isinstance(e, EpisodeFinished)}
    )
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(Path(store)) as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        t0 = time.perf_counter()
        async with Publisher(js) as pub:
            for e in events:
                await pub.publish_event(e)
        publish_s = time.perf_counter() - t0
        fold = make_materializer("leafe", tokenizer)
        replayer = Replayer(
            js, run_id=RUN, fold=fold, config=ReplayerConfig(batch=512, fetch_timeout_s=0.2)
        )
        stop = asyncio.Event()
        t0 = time.perf_counter()
        task = asyncio.create_task(replayer.run(stop))
        while True:
            await asyncio.sleep(0.05)
            try:
                info = await js.consumer_info(EVENTS.name, durable_name(RUN, "leafe"))
            except Exception:
                continue
            if info.num_pending == 0 and info.num_ack_pending <= unfinished:
                break
        run_s = time.perf_counter() - t0
        stop.set()
        await task
        await nc.close()
    s = replayer.stats
    return {
        "events": len(events),
        "publish_events_per_s": round(len(events) / publish_s),
        "replayer_s": round(run_s, 3),
        "events_per_s": round(len(events) / run_s),
        "samples": s.samples_published,
        "samples_per_s": round(s.samples_published / run_s),
        "dead_letters": s.dead_letters,
        "tokenizer": "byte (fake)",
    }


def time_reader(chunks: Iterator[list[EpisodeEvent]], *, rounds: int = 10) -> dict[str, Any]:
    """Write the events as a log file, then read its records back verified and unverified,
    alternating.

    Each round reads the whole file once each way (the order alternates, so neither always runs on a
    warm page cache after the other). On a shared machine the fastest round is the least disturbed
    one, so rates and the headline ratio come from each side's best round; the ratio of the medians
    is kept too.
    """
    events = [e for chunk in chunks for e in chunk]  # generated first: only the write is timed
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.leafelog"
        t0 = time.perf_counter()
        records = write_events(path, events, run_id=RUN)
        write_s = time.perf_counter() - t0
        del events
        size = path.stat().st_size
        times: dict[bool, list[float]] = {True: [], False: []}
        for k in range(rounds):
            for verify in (True, False) if k % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                n = sum(1 for _ in iter_log_records(path, verify=verify))
                times[verify].append(time.perf_counter() - t0)
                assert n == records, (n, records)
    mb = size / 1e6
    verified, unverified = min(times[True]), min(times[False])
    median = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    return {
        "records": records,
        "file_mb": round(mb, 1),
        "bytes_per_record": round(size / records),
        "write_mb_per_s": round(mb / write_s, 1),
        "read_verified_mb_per_s": round(mb / verified, 1),
        "read_unverified_mb_per_s": round(mb / unverified, 1),
        "read_verified_records_per_s": round(records / verified),
        "verified_over_unverified": round(unverified / verified, 3),
        "verified_over_unverified_median": round(median[False] / median[True], 3),
        "rounds": rounds,
    }


def report_reader(r: dict[str, Any]) -> None:
    print(
        f"{'reader (.leafelog)':24s} verified {r['read_verified_mb_per_s']:,} MB/s  unverified "
        f"{r['read_unverified_mb_per_s']:,} MB/s  x{r['verified_over_unverified']:.3f} "
        f"(medians x{r['verified_over_unverified_median']:.3f})  "
        f"({r['records']} records, {r['file_mb']} MB, {r['bytes_per_record']} B/record; "
        f"write {r['write_mb_per_s']:,} MB/s)"
    )


FOLDS: dict[str, tuple[str, dict[str, Any]]] = {
    "fold_fake_tok": ("leafe", {}),
    "fold_fake_tok_noverify": ("leafe", {"verify_prompts": False}),
    "fold_grpo": ("grpo", {}),
    "fold_rft": ("rft", {"modes": ["rollout", "explore"]}),
}


def fold_events_per_s(n_events: int, repeats: int = 3) -> dict[str, dict[str, int]]:
    """Best of ``repeats`` events/s (wall and CPU time) of each of :data:`FOLDS` over one synthetic
    log (a child process of ``--against``)."""
    fake = ByteChatTokenizer()
    chunks = list(synthetic_chunks(n_events, tokenizer=fake))
    out: dict[str, dict[str, int]] = {}
    for key, (name, opts) in FOLDS.items():
        runs = [time_fold(name, chunks, fake, **opts) for _ in range(repeats)]
        out[key] = {
            unit: max(r[unit] for r in runs) for unit in ("events_per_s", "events_per_cpu_s")
        }
    return out


def _fold_child(tree: Path, n_events: int) -> dict[str, dict[str, int]]:
    """:func:`fold_events_per_s` in a child process on ``tree``'s packages (this file, run by path:
    its own directory must not come first on ``sys.path``, where ``bench/envs.py`` would shadow
    ``envs``)."""
    code = f"import runpy, sys; sys.argv = ['replay', '--fold-child', '{n_events}']; "
    code += f"runpy.run_path({__file__!r}, run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True, text=True
    )
    figures: dict[str, dict[str, int]] = json.loads(run.stdout.strip().splitlines()[-1])
    return figures


def compare_folds(base: Path, n_events: int, rounds: int) -> dict[str, Any]:
    """Best-of fold speeds of this tree's code and of ``base``'s, measured alternately; the ratio
    uses CPU time (less disturbed than wall time by other processes on a shared machine)."""
    here = Path(__file__).resolve().parents[1]
    best: dict[str, dict[str, dict[str, int]]] = {"before": {}, "after": {}}
    for k in range(rounds):
        for side in ("before", "after") if k % 2 == 0 else ("after", "before"):
            figures = _fold_child(base if side == "before" else here, n_events)
            for key, rates in figures.items():
                kept = best[side].setdefault(key, {})
                for unit, rate in rates.items():
                    kept[unit] = max(rate, kept.get(unit, 0))
            shown = "  ".join(
                f"{key} {r['events_per_cpu_s']:,}/cpu-s" for key, r in figures.items()
            )
            print(f"round {k + 1} {side:6s} {shown}")
    commit = subprocess.run(
        ["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    ratio = {
        unit: {key: round(best["after"][key][unit] / best["before"][key][unit], 3) for key in FOLDS}
        for unit in ("events_per_cpu_s", "events_per_s")
    }
    return {
        "base": commit.stdout.strip() or str(base),
        "events": n_events,
        "rounds": rounds,
        "repeats_per_round": 3,
        "best": best,
        "after_over_before": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller logs (a minute or two)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny logs: every figure runs? (tests; seconds)"
    )
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {RESULTS})")
    p.add_argument(
        "--only", choices=["reader", "fold"], default=None, help="run one figure, update its entry"
    )
    p.add_argument(
        "--against", type=Path, default=None, help="with --only fold: the worktree to compare to"
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="with --against: rounds per side (best kept)"
    )
    p.add_argument("--fold-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from leafe.services.logsetup import configure_logging

    configure_logging(json=False, level="error")
    if args.fold_child is not None:
        print(json.dumps(fold_events_per_s(args.fold_child)))
        return 0
    scale = "smoke" if args.smoke else "quick" if args.quick else "full"
    n_fold, n_real, n_service, n_reader = SIZES[scale]
    out = args.out or (SMOKE_OUT if args.smoke else RESULTS)
    if args.only == "fold":
        if args.against is None:
            p.error("--only fold needs --against DIR (the worktree to compare with)")
        results = json.loads(out.read_text()) if out.exists() else {}
        host = (
            host_record()
        )  # merged sections carry their own host: the others may come from another
        results["fold_vs_base"] = r = compare_folds(args.against, 100_000, args.rounds)
        r["host"] = host
        for unit, ratios in r["after_over_before"].items():
            print(
                f"after/before ({unit}): " + "  ".join(f"{k} x{v:.3f}" for k, v in ratios.items())
            )
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"saved {out}")
        return 0
    if args.only == "reader":
        results = json.loads(out.read_text()) if out.exists() else {}
        results["reader"] = r = time_reader(
            synthetic_chunks(n_reader, seed=11, tokenizer=ByteChatTokenizer())
        )
        r["measured_alone"] = (
            True  # by --only reader: the other entries come from an earlier full run
        )
        r["host"] = host_record()
        report_reader(r)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"saved {out}")
        return 0
    fake = ByteChatTokenizer()
    results: dict[str, Any] = {"quick": args.quick, "smoke": args.smoke, "host": host_record()}
    results["log"] = {"fold_events": n_fold}
    t0 = time.perf_counter()
    chunks = list(synthetic_chunks(n_fold, tokenizer=fake))
    results["log"]["generate_s"] = round(time.perf_counter() - t0, 1)
    results["log"]["episodes"] = len({e.episode_id for c in chunks for e in c})
    print(
        f"log: {n_fold} events, {results['log']['episodes']} episodes (generated in "
        f"{results['log']['generate_s']} s)"
    )
    for key, (name, opts) in FOLDS.items():
        results[key] = r = time_fold(name, chunks, fake, **opts)
        print(
            f"{key:24s} {r['events_per_s']:>9,} events/s  {r['samples_per_s']:>8,} samples/s  "
            f"x{r['ratio_to_decode_baseline']:.3f} of decode "
            f"({r['baseline_decode_events_per_s']:,}/s)  "
            f"samples={r['samples']} mismatches={r['prompt_mismatches']}"
        )
    rounds = 2 if args.smoke else 10
    results["reader"] = r = time_reader(
        synthetic_chunks(n_reader, seed=11, tokenizer=fake), rounds=rounds
    )
    report_reader(r)
    del chunks
    from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir

    real = HFChatTokenizer.from_dir(tiny_model_dir())
    results["fold_real_tok"] = r = time_fold("leafe", synthetic_chunks(n_real, seed=3), real)
    print(
        f"{'fold_real_tok':24s} {r['events_per_s']:>9,} events/s  "
        f"{r['samples_per_s']:>8,} samples/s  "
        f"x{r['ratio_to_decode_baseline']:.3f} of decode  tokenize calls={r['tokenize_calls']} "
        f"cache hits={r['tokenize_cache_hits']} ({n_real} events)"
    )
    results["service"] = s = asyncio.run(time_service(n_service, fake))
    print(
        f"{'service (end to end)':24s} {s['events_per_s']:>9,} events/s  "
        f"{s['samples_per_s']:>8,} samples/s  "
        f"(publish {s['publish_events_per_s']:,}/s; {s['events']} events)"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
