"""Event-log throughput: the typed bus against raw nats-py, same bytes, same server, same process.

Persists ``--n`` ~1 KB ``Step`` events (board text + completion + token ids) to a file-backed
``LEAFE_EVENTS`` stream on a fresh embedded nats-server, then consumes and acks them:

| row                  | what runs                                                                 |
|----------------------|---------------------------------------------------------------------------|
| raw_publish          | ``js.publish_async`` of pre-encoded bytes; acks awaited 2000 at a time    |
| typed_publish        | ``Publisher.publish_event`` (encode + Nats-Msg-Id + backpressure), flush  |
| raw_consume_naive    | ``PullSubscription.fetch(256)`` + one awaited ``msg.ack()`` per message   |
| typed_consume        | ``Consumer.consume`` (batched pulls, decode, handler, then the ack)       |
| raw_consume_ack_sync | ``fetch(256)`` + ``ack_sync`` (awaits the server) per message; <= 5k msgs |

Targets: typed_publish >= 0.7x raw_publish; typed_consume beats raw_consume_naive. Raw and
typed alternate every ``--chunk`` events, so on a shared machine both see the same load; each rate
is events over the summed time of its chunks.

    .venv/bin/python -m bench.event_log            # 100k events
    .venv/bin/python -m bench.event_log --quick    # 10k events
    .venv/bin/python -m bench.event_log --n 20000 --chunk 5000
    .venv/bin/python -m bench.event_log --smoke \\
        --out /tmp/event_log.json                  # 500 events: does it run?

Writes ``bench/results/event_log.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from nats.js.api import AckPolicy, ConsumerConfig

from bench.host import host_record
from leafe.protocol import Step, decode_event, encode
from leafe.protocol.subjects import dead_letter_subject, events_filter
from leafe.services.bus import Consumer, Publisher, connect, ensure_streams
from leafe.services.bus.nats_server import EmbeddedNats

STREAM = "LEAFE_EVENTS"
BATCH = 256
RESULTS = Path(__file__).resolve().parent / "results" / "event_log.json"
SMOKE_N = 500
SMOKE_OUT = Path(tempfile.gettempdir()) / "leafe-bench-smoke" / "event_log.json"
"""Events of ``--smoke``: two raw/typed alternations, a fraction of a second; not a measurement."""


def make_events(n: int, run_id: str) -> list[Step]:
    """``n`` realistic Step events (~1 KB each): a Sokoban-sized board, a completion and its token
    ids."""
    board = "\n".join(
        ["#########", "#  .  $ #", "# @ #   #", "#   $ . #", "#       #", "#########"] * 6
    )
    events = []
    for i in range(n):
        ep, t = divmod(i, 50)
        events.append(
            Step(
                event_id=f"{run_id}-ep{ep:06d}.{t:06d}",
                run_id=run_id,
                episode_id=f"{run_id}-ep{ep:06d}",
                actor_id="actor-0",
                seq=t,
                policy_version="v000001",
                ts=1_700_000_000.0 + i,
                branch_id="b0",
                t=t,
                action="up",
                raw_text=f"I should push the box up towards the target. <action>up</action> {i}",
                token_ids=[(i * 7919 + k * 104729) % 49152 for k in range(120)],
                observation=board,
                reward=0.0,
                feedback="You moved up.",
                prompt_tokens=180,
                finish_reason="stop",
            )
        )
    return events


async def raw_publish(js, subject: str, payloads: list[bytes], ids: list[str]) -> float:
    """Seconds to publish ``payloads`` with ``publish_async``, awaiting acks in batches of 2000."""
    start = time.perf_counter()
    futures = []
    for data, msg_id in zip(payloads, ids, strict=True):
        futures.append(
            await js.publish_async(
                subject, data, headers={"Nats-Msg-Id": msg_id, "Leafe-Codec": "1"}
            )
        )
        if len(futures) >= 2000:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)
    return time.perf_counter() - start


async def typed_publish(js, events: list[Step]) -> float:
    """Seconds to publish ``events`` with the typed Publisher and flush."""
    start = time.perf_counter()
    async with Publisher(js) as pub:
        for event in events:
            await pub.publish_event(event)
    assert pub.acked == len(events), (pub.acked, len(events))
    return time.perf_counter() - start


async def raw_consume(sub, n: int, *, sync_ack: bool) -> float:
    """Seconds for the naive loop to take ``n`` messages: ``fetch`` then one awaited ack per
    message."""
    start = time.perf_counter()
    got = 0
    while got < n:
        for msg in await sub.fetch(min(BATCH, n - got), timeout=5):
            if sync_ack:
                await msg.ack_sync()
            else:
                await msg.ack()
            got += 1
    return time.perf_counter() - start


async def typed_consume(consumer: Consumer, n: int) -> float:
    """Seconds for ``Consumer.consume`` to decode, handle and ack ``n`` messages."""
    seen = 0

    async def handler(delivery) -> None:
        nonlocal seen
        seen += 1

    start = time.perf_counter()
    handled = await consumer.consume(handler, limit=n)
    assert handled == seen == n, (handled, seen, n)
    return time.perf_counter() - start


async def raw_subscription(js, run_id: str, durable: str):
    config = ConsumerConfig(
        durable_name=durable, ack_policy=AckPolicy.EXPLICIT, filter_subject=events_filter(run_id)
    )
    await js.add_consumer(STREAM, config)
    return await js.pull_subscribe_bind(durable=durable, stream=STREAM)


async def bench(n: int, chunk: int) -> dict:
    """Alternate raw and typed chunks so both see the same machine load; rates are totals over
    chunks."""
    store = Path(tempfile.mkdtemp(prefix="leafe-bench-"))
    server = EmbeddedNats(store).start()
    secs = dict.fromkeys(
        ("raw_publish", "typed_publish", "raw_consume_naive", "typed_consume"), 0.0
    )
    try:
        nc = await connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        events = make_events(n, "typed")
        payloads = [encode(e) for e in make_events(n, "raw")]
        ids = [f"raw-{i}" for i in range(n)]
        for i in range(0, n, chunk):
            secs["raw_publish"] += await raw_publish(
                js, "leafe.raw.events.step", payloads[i : i + chunk], ids[i : i + chunk]
            )
            secs["typed_publish"] += await typed_publish(js, events[i : i + chunk])
        sub = await raw_subscription(js, "raw", "raw")
        consumer = Consumer(
            js,
            stream=STREAM,
            durable="typed",
            filter_subject="leafe.typed.events.>",
            decode=decode_event,
            dead_letter_subject=dead_letter_subject("typed", STREAM),
            batch=BATCH,
        )
        await consumer.start()
        for i in range(0, n, chunk):
            secs["raw_consume_naive"] += await raw_consume(sub, min(chunk, n - i), sync_ack=False)
            secs["typed_consume"] += await typed_consume(consumer, min(chunk, n - i))
        await consumer.close()
        m = min(n, 5_000)
        sync_sub = await raw_subscription(js, "raw", "rawsync")
        sync_rate = m / await raw_consume(sync_sub, m, sync_ack=True)
        await nc.close()
    finally:
        server.stop()
    rates = {k: n / v for k, v in secs.items()}
    return {
        "n": n,
        "chunk": chunk,
        "event_bytes": len(payloads[0]),
        "events_per_s": {**rates, "raw_consume_ack_sync": sync_rate},
        "ratios": {
            "typed_publish_vs_raw_publish": rates["typed_publish"] / rates["raw_publish"],
            "typed_consume_vs_raw_naive": rates["typed_consume"] / rates["raw_consume_naive"],
            "typed_consume_vs_raw_ack_sync": rates["typed_consume"] / sync_rate,
        },
        "targets_met": {
            "publish_ge_0.7x_raw": rates["typed_publish"] >= 0.7 * rates["raw_publish"],
            "consume_beats_naive": rates["typed_consume"] > rates["raw_consume_naive"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000, help="events per phase (default 100000)")
    parser.add_argument("--quick", action="store_true", help="10000 events")
    parser.add_argument(
        "--smoke", action="store_true", help="500 events: checks the bench runs (tests)"
    )
    parser.add_argument(
        "--chunk", type=int, default=10_000, help="events per raw/typed alternation (10000)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"result file (default {RESULTS}; --smoke: {SMOKE_OUT})",
    )
    args = parser.parse_args(argv)
    args.out = args.out or (SMOKE_OUT if args.smoke else RESULTS)
    n = SMOKE_N if args.smoke else 10_000 if args.quick else args.n
    chunk = n // 2 if args.smoke else min(args.chunk, n)
    host = host_record()
    result = {"smoke": args.smoke, "host": host, **asyncio.run(bench(n, chunk))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    rates, ratios = result["events_per_s"], result["ratios"]
    print(
        f"\n{n} Step events of {result['event_bytes']} bytes, raw/typed alternating every "
        f"{result['chunk']}:"
    )
    for name, rate in rates.items():
        print(f"  {name:<22} {rate:>10,.0f} events/s")
    for name, ratio in ratios.items():
        print(f"  {name:<32} {ratio:5.2f}x")
    print(f"  targets met: {result['targets_met']}\n  saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
