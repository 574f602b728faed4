"""Weight push, disk against the wire: from the announcement to every engine serving the new
version, for 1, 2, 4 and 8 ``leafe inference`` processes, beside the floor: a plain
``torch.distributed`` gloo broadcast of the same tensors to as many bare receiver processes.

    python -m bench.weight_push            # SmolLM2-135M, 1/2/4/8 engines, 3 pushes each way
    python -m bench.weight_push --quick    # the tiny model, 1 and 2 engines, 1 push (a test runs)

Each engine has one thread. A push is timed from ``WeightSync.offer`` of a fresh announcement (the
export already on disk, as after the learner's ``WeightsPublished``) until ``WeightSync.sync``
returns with every engine serving it: ``disk`` loads one engine after another, as weight sync
always does; ``distributed`` broadcasts once to the group, formed before the first timed push
(its formation is reported apart). The two transports alternate push by push. Engine counts whose
memory the machine does not have free are skipped and say so. Results:
``bench/results/weight_push.json`` (figures as ratios to the floor of the same engine count).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.host import host_record
from leafe.learner.model_io import export_weights, load_model, resolve_model
from leafe.protocol import WeightsPublished
from leafe.services.inference.fleet import FleetConfig, ServerFleet
from leafe.services.weight_sync.broadcast import free_port
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig

RESULTS = Path(__file__).parent / "results" / "weight_push.json"
ENGINE_GB = {"tiny": 0.4, "smollm2-135m-instruct": 1.6}
"""Resident memory one engine needs while a push lands (weights twice, model, runtime)."""


def _export(model: Path, store: Path, index: int) -> WeightsPublished:
    version = f"v{index:06d}"
    state = {k: v * (1.0 + 1e-3 * index) for k, v in load_model(model).state_dict().items()}
    digest = export_weights(state, store / version, config_dir=model, version=version)
    return WeightsPublished(
        event_id=f"weights.bench.{version}",
        run_id="bench",
        version=version,
        uri=str(store / version),
        manifest_sha256=digest,
        learner_step=index,
        base_model=model.name,
        ts=time.time(),
    )


def _announce(event: WeightsPublished) -> WeightsPublished:
    import msgspec

    return msgspec.structs.replace(event, ts=time.time())


async def _push(sync: WeightSync, event: WeightsPublished) -> float:
    t0 = time.perf_counter()
    sync.offer(_announce(event))
    while True:
        results = await sync.sync()
        if sync.converged():
            return time.perf_counter() - t0
        if results and not all(r.success for r in results.values()):
            failed = {u: r.message for u, r in results.items() if not r.success}
            raise RuntimeError(f"push of {event.version} failed: {failed}")
        await asyncio.sleep(0.05)


def _receiver(rank: int, world: int, port: int, specs: list[tuple[Any, ...]], rounds: int) -> None:
    import torch
    from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    store = TCPStore("127.0.0.1", port, world, False, timeout=timeout, wait_for_workers=False)
    pg = ProcessGroupGloo(PrefixStore("floor", store), rank, world, timeout)
    opts = BroadcastOptions()
    opts.rootRank = 0
    for _ in range(rounds):
        out = [torch.empty(shape, dtype=dtype) for dtype, shape in specs]
        for w in [pg.broadcast([t], opts) for t in out]:
            w.wait()
        pg.barrier().wait()


def _floor(state: dict[str, Any], receivers: int, rounds: int) -> list[float]:
    """Seconds of a gloo broadcast of ``state`` (one op per tensor, as the push sends it) from this
    process to ``receivers`` processes, until all of them have it (a barrier)."""
    import torch
    import torch.multiprocessing as tmp
    from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

    port, world = free_port(), receivers + 1
    specs = [(t.dtype, tuple(t.shape)) for t in state.values()]
    ctx = tmp.get_context("spawn")
    procs = [
        ctx.Process(target=_receiver, args=(r, world, port, specs, rounds), daemon=True)
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    timeout = datetime.timedelta(seconds=300)
    store = TCPStore("0.0.0.0", port, world, True, timeout=timeout, wait_for_workers=False)
    pg = ProcessGroupGloo(PrefixStore("floor", store), 0, world, timeout)
    opts = BroadcastOptions()
    opts.rootRank = 0
    tensors = [t.contiguous() for t in state.values()]
    times = []
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for w in [pg.broadcast([t], opts) for t in tensors]:
                w.wait()
            pg.barrier().wait()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
        for p in procs:
            p.join(60)
    return times


def _free_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


async def _measure(
    model: Path, name: str, store: Path, engines: int, rounds: int, next_index: list[int]
) -> dict[str, Any]:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    fleet = ServerFleet(
        FleetConfig(
            model=str(model),
            servers=engines,
            max_batch=4,
            cores=cores,
            extra_args=("--weights-root", str(store)),
        )
    )
    async with fleet:
        os.environ["LEAFE_ENGINE_ADMIN_KEY_FILE"] = fleet.admin_key_file
        os.environ["LEAFE_ENGINE_API_KEY_FILE"] = fleet.api_key_file
        common = {"servers": fleet.urls, "reload_lease": False, "reconcile_interval_s": 5.0}
        disk = WeightSync(WeightSyncConfig(**common), run_id="bench")
        wire = WeightSync(
            WeightSyncConfig(**common, transport="distributed", broadcast_timeout_s=600.0),
            run_id="bench",
        )
        events = []
        for _ in range(2 * rounds + 1):
            events.append(_export(model, store, next_index[0]))
            next_index[0] += 1
        try:
            await _push(disk, events[0])  # every engine at a version of this store: joinable
            wire.served = dict(disk.served)
            t0 = time.perf_counter()
            assert wire.sender is not None
            await wire.sender.form(list(fleet.urls))
            formation = time.perf_counter() - t0
            times: dict[str, list[float]] = {"disk": [], "distributed": []}
            for i in range(rounds):
                wire.served = dict(disk.served)
                times["distributed"].append(await _push(wire, events[1 + 2 * i]))
                disk.served = dict(wire.served)
                times["disk"].append(await _push(disk, events[2 + 2 * i]))
        finally:
            await disk.close()
            await wire.close()
    for e in events:  # the store keeps the disk small: these were read, not needed again
        _remove(Path(e.uri))
    state = load_model(model).state_dict()
    floor = _floor({k: v for k, v in state.items() if k != "lm_head.weight"}, engines, rounds)
    row = {k: statistics.median(v) for k, v in times.items()}
    f = statistics.median(floor)
    return {
        "engines": engines,
        "seconds": {**row, "floor": f, "group_formation": formation},
        "all_seconds": {**times, "floor": floor},
        "ratio_to_floor": {k: v / f for k, v in row.items()},
        "disk_over_distributed": row["disk"] / row["distributed"],
    }


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    name = "tiny" if args.quick else args.model
    model = resolve_model(name)
    counts = [1, 2] if args.quick else [int(n) for n in args.engines.split(",")]
    rounds = 1 if args.quick else args.rounds
    weights_bytes = sum(
        t.numel() * t.element_size() for t in load_model(model).state_dict().values()
    )
    rows, skipped = [], {}
    next_index = [1]
    with tempfile.TemporaryDirectory(prefix="leafe-weight-push-") as tmp:
        store = Path(tmp) / "store"
        for n in counts:
            need = n * ENGINE_GB.get(name, 2.0) + 2.0
            if _free_gb() < need:
                skipped[str(n)] = f"needs ~{need:.0f} GiB free, {_free_gb():.1f} GiB available"
                print(f"weight_push: {n} engines skipped: {skipped[str(n)]}", flush=True)
                continue
            row = await _measure(model, name, store, n, rounds, next_index)
            print(f"weight_push: {json.dumps(row['seconds'])} for {n} engines", flush=True)
            rows.append(row)
    return {
        "area": "weight_push",
        "quick": bool(args.quick),
        "model": name,
        "weights_bytes": weights_bytes,
        "rounds": rounds,
        "threads_per_engine": 1,
        "host": host_record(),
        "note": "shared machine: other sessions' processes ran beside these; ratios are of one run",
        "rows": rows,
        "skipped": skipped,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.weight_push", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 and 2 engines, 1 push")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engines", default="1,2,4,8", help="engine counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="timed pushes per transport")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    result = asyncio.run(_main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"weight_push: wrote {args.out}")


if __name__ == "__main__":
    main()
