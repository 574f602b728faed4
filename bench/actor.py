"""Actor benchmarks: per-step overhead excluding model time, and events/s of one actor process.

| row                 | what runs                                                                  |
|---------------------|----------------------------------------------------------------------------|
| overhead_at_100ms   | LEAFE trees on Sokoban, SmolLM2 chat template, events published to         |
|                     | nats-server; the engine answers after a fixed 100 ms. Overhead per engine  |
|                     | call = (wall - time inside engine.generate) / calls, against the 100 ms    |
|                     | baseline (target < 5%)                                                     |
| overhead_at_0ms     | the same with an instant engine:                                           |
|                     | the actor's own time per call, measured directly                           |
| service_events      | ``ActorService`` pulling Sokoban tasks from the work queue, concurrency 8, |
|                     | instant engine, real tokenizer; events acked by JetStream per second       |
| service_events_byte | the same with a byte tokenizer (the ceiling without chat-template cost)    |
| raw_publish         | baseline: ``Publisher.publish_event`` of the same events in a loop,        |
|                     | same server                                                                |
| tree_cost           | Stage 1: the first trees of a shipped Stage 1 log (``effect-hard``, W's    |
|                     | own trees) replayed against our server (exact prompts and completion       |
|                     | lengths): trees per engine CPU-minute, prefill/decode split, prefix-cache  |
|                     | share per request kind against a cache holding every earlier prompt        |
|                     | (``bench/actor_trees.py``)                                                 |
| prompt_reuse        | per history window: prompt tokens per step of scripted Sokoban eval        |
|                     | rollouts (the paper table's rooms and horizon, real chat template, answers |
|                     | shaped like the model's: half moves, half unique prose), and the share of  |
|                     | them a prefix cache holding every earlier prompt serves (the server's      |
|                     | radix tree, fed in step order as concurrent episodes send them); no model  |

    .venv/bin/python -m bench.actor            # ~10 minutes on 2 cores (tree_cost: 32 trees)
    .venv/bin/python -m bench.actor --quick    # ~2 minutes
    .venv/bin/python -m bench.actor --smoke --out /tmp/actor.json  # seconds: do all rows still run?
    .venv/bin/python -m bench.actor --tree-cost-only   # tree_cost alone, into actor.json

Writes ``bench/results/actor.json`` (``--out PATH`` elsewhere; ``--smoke``, the tests' check, writes
to a temporary file unless ``--out`` is given: one episode or a few tasks per row, not a
measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.actor_trees import tree_cost
from bench.host import host_record, keep_sections
from leafe.actors.config import ActorServiceConfig, ExplorerConfig, RolloutConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, ScriptedEngine
from leafe.actors.rollout import run_rollout
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv
from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.subjects import task_subject
from leafe.protocol.tasks import TaskAssignment
from leafe.services.actor.service import ActorService, PublisherSink
from leafe.services.bus import Publisher, connect, ensure_streams
from leafe.services.bus.nats_server import EmbeddedNats
from leafe.services.inference.prefix import PrefixCache
from leafe.services.logsetup import configure_logging

RESULTS = Path(__file__).resolve().parent / "results" / "actor.json"
SMOKE_OUT = Path(tempfile.gettempdir()) / "leafe-bench-smoke" / "actor.json"
MOVES = [
    "<action>up</action>",
    "<action>down</action>",
    "I go left",
    "right!",
    "<action>right</action>",
    "hmm",
]


def policy(seed: int) -> Any:
    """A scripted policy: random moves (some in prose, some unparseable) and tagged reflections."""
    rng = random.Random(seed)

    def script(kind: str, prompt: str) -> str:
        if kind == "reflection":
            return (
                f"<step>{rng.randint(0, 4)}</step>"
                "<experience>push the box from the other side</experience>"
            )
        return rng.choice(MOVES)

    return script


PROSE = (
    "the box is left of the target so I push it up then walk around the wall and try again".split()
)


def model_like_policy(seed: int) -> Any:
    """Answers shaped like SmolLM2-135M's in the paper table's evaluations: about half name a move,
    the rest are ~20 words of prose unique to the sample (parse failures ~47%), so histories diverge
    across samples as the model's do."""
    rng = random.Random(seed)

    def script(kind: str, prompt: str) -> str:
        if rng.random() < 0.5:
            return f"{rng.choice(['up', 'down', 'left', 'right'])}</action>"
        return " ".join(rng.choice(PROSE) for _ in range(20))

    return script


def sokoban_factory(name: str, **options: Any) -> SokobanEnv:
    return SokobanEnv(SokobanConfig(**options))


async def overhead(url: str, tok: ChatTokenizer, latency: float, episodes: int) -> dict[str, float]:
    """Sequential LEAFE episodes; returns wall time, engine calls and overhead per call."""
    nc = await connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    calls = steps = 0
    engine_s = 0.0
    start = time.perf_counter()
    for i in range(episodes):
        engine = ScriptedEngine(script=policy(i), latency_s=latency, record=False, tokenizer=tok)
        counted = CountingEngine(engine)
        async with Publisher(js) as pub:
            spec = EpisodeSpec(
                run_id="benchov",
                episode_id=f"ov{latency}-{i}.a1",
                actor_id="bench",
                task_key=f"ov-{i}",
                env="sokoban",
                task_id=f"sokoban/train/{i:05d}",
            )
            summary = await Explorer(
                engine=counted,
                tokenizer=tok,
                env=SokobanEnv(),
                config=ExplorerConfig.for_env("sokoban"),
                sink=PublisherSink(pub),
                spec=spec,
            ).run()
        calls += counted.n
        engine_s += counted.seconds
        steps += summary.actions
    wall = time.perf_counter() - start
    await nc.close()
    per_call = (wall - engine_s) / calls
    return {
        "wall_s": wall,
        "engine_s": engine_s,
        "engine_calls": calls,
        "actions": steps,
        "overhead_per_call_ms": per_call * 1e3,
    }


class CountingEngine:
    """Counts generate calls of a wrapped engine and the time spent inside them (the model's
    time)."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner, self.n, self.seconds = inner, 0, 0.0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.n += 1
        t0 = time.perf_counter()
        try:
            return await self.inner.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    async def weight_version(self) -> str:
        return await self.inner.weight_version()


async def service_events(url: str, tok: ChatTokenizer, tasks: int, run_id: str) -> dict[str, float]:
    """An ActorService serving ``tasks`` Sokoban explore tasks; events per second, end to end."""
    nc = await connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    async with Publisher(js) as pub:
        for i in range(tasks):
            task = TaskAssignment(
                task_key=f"{run_id}-{i}",
                run_id=run_id,
                env="sokoban",
                task_id=f"sokoban/train/{i:05d}",
                seed=i,
            )
            await pub.publish(task_subject(run_id), task)
    engine = ScriptedEngine(script=policy(7), record=False, tokenizer=tok)
    service = ActorService(
        nc=nc,
        run_id=run_id,
        engine=engine,
        tokenizer=tok,
        config=ActorServiceConfig(concurrency=8),
        actor_id="bench",
        env_factory=sokoban_factory,
        max_tasks=tasks,
    )
    start = time.perf_counter()
    stats = await service.run()
    wall = time.perf_counter() - start
    await nc.close()
    return {
        "wall_s": wall,
        "episodes": stats.done,
        "events": stats.events,
        "events_per_s": stats.events / wall,
    }


async def raw_publish(url: str, events: list[EpisodeEvent]) -> dict[str, float]:
    """Baseline: publish the same events with the bus Publisher in a tight loop, then flush."""
    import msgspec

    nc = await connect(url)
    js = nc.jetstream()
    fresh = [
        msgspec.structs.replace(e, run_id="benchraw", event_id=f"raw-{i}")
        for i, e in enumerate(events)
    ]
    start = time.perf_counter()
    async with Publisher(js) as pub:
        for e in fresh:
            await pub.publish_event(e)
    wall = time.perf_counter() - start
    await nc.close()
    return {"wall_s": wall, "events": len(fresh), "events_per_s": len(fresh) / wall}


async def sample_events(tok: ChatTokenizer, n_episodes: int) -> list[EpisodeEvent]:
    sink = ListSink()
    for i in range(n_episodes):
        spec = EpisodeSpec(
            run_id="x",
            episode_id=f"s{i}.a1",
            actor_id="b",
            task_key="s",
            env="sokoban",
            task_id=f"sokoban/train/{i:05d}",
        )
        await Explorer(
            engine=ScriptedEngine(script=policy(i), record=False),
            tokenizer=tok,
            env=SokobanEnv(),
            config=ExplorerConfig.for_env("sokoban"),
            sink=sink,
            spec=spec,
        ).run()
    return sink.events


PAPER_ROOMS = {"height": 5, "width": 5, "num_boxes": 1, "max_solution_len": 3, "max_steps": 8}
"""experiments/paper_table.py's ``full`` rooms; its evaluation runs horizon 8 with history window
2."""


async def episode_prompts(
    tok: ChatTokenizer, window: int, tasks: int, samples: int
) -> list[list[list[int]]]:
    """The action prompts of scripted eval rollouts, per episode in step order (the same moves for
    every window: the script depends only on the call count)."""
    env = SokobanEnv(SokobanConfig(**PAPER_ROOMS))
    config = RolloutConfig.for_env("sokoban", {"horizon": 8, "history_window": window})
    out = []
    for i, task_id in enumerate(env.tasks("test")[:tasks]):
        for s in range(samples):
            engine = ScriptedEngine(script=model_like_policy(1000 * i + s), tokenizer=tok)
            spec = EpisodeSpec(
                run_id="reuse", episode_id=f"r{i}-{s}.a1", actor_id="bench", task_key=f"r{i}-{s}",
                env="sokoban", task_id=task_id, split="test", mode="eval",
            )  # fmt: skip
            await run_rollout(
                engine=engine, tokenizer=tok, env=env, spec=spec, config=config, sink=ListSink()
            )
            out.append([c.input_ids for c in engine.calls])
    return out


def cache_share(episodes: list[list[list[int]]]) -> dict[str, float]:
    """Prompts fed to an unbounded prefix tree step by step across episodes (as concurrent episodes
    reach the server): tokens per step, new (not cached) tokens per step, cached share."""
    tree = PrefixCache(1 << 40)
    total = served = steps = 0
    for t in range(max(map(len, episodes))):
        for prompts in episodes:
            if t < len(prompts):
                ids = prompts[t]
                total, served, steps = total + len(ids), served + tree.match(ids).length, steps + 1
                tree.insert(ids, lambda a, b: torch.zeros(1, 1, 1, b - a, 1))
    return {
        "prompt_tokens_per_step": total / steps,
        "new_tokens_per_step": (total - served) / steps,
        "cache_share": served / total,
    }


SIZES = {  # scale -> overhead episodes, service tasks, prompt_reuse (tasks, samples)
    "smoke": (1, 4, (1, 2)),
    "quick": (3, 40, (4, 8)),
    "full": (10, 200, (16, 16)),
}
TREES = {  # scale -> tree_cost's model, trees, trees at a time
    "smoke": ("tiny", 1, 1),
    "quick": ("smollm2-135m-instruct", 8, 8),
    "full": ("smollm2-135m-instruct", 32, 8),
}
FLOOR_SECONDS = {"smoke": 0.05, "quick": 0.5, "full": 1.0}
"""tree_cost's compute floor: measuring time per row count."""


async def prompt_reuse(tok: ChatTokenizer, tasks: int, samples: int) -> dict[str, Any]:
    """Per history window (0 = all): prompt length and prefix reuse of scripted eval rollouts."""
    return {
        str(window): cache_share(await episode_prompts(tok, window, tasks, samples))
        for window in (2, 0, 4, 8)
    }


async def bench(url: str, scale: str) -> dict[str, Any]:
    hf = HFChatTokenizer.from_dir(tiny_model_dir())
    episodes, tasks, (reuse_tasks, reuse_samples) = SIZES[scale]
    out: dict[str, Any] = {}
    ov100 = await overhead(url, hf, 0.1, episodes)
    ov0 = await overhead(url, hf, 0.0, episodes * 3)
    out["overhead_at_100ms"] = {
        **ov100,
        "ratio_to_engine_latency": ov100["overhead_per_call_ms"] / 100.0,
    }
    out["overhead_at_0ms"] = {**ov0, "ratio_to_engine_latency": ov0["overhead_per_call_ms"] / 100.0}
    out["service_events"] = await service_events(url, hf, tasks, f"benchsvc{int(time.time())}")
    out["service_events_byte"] = await service_events(
        url, ByteChatTokenizer(), tasks, f"benchbyte{int(time.time())}"
    )
    events = await sample_events(ByteChatTokenizer(), tasks // 2)
    out["raw_publish"] = await raw_publish(url, events)
    for key in ("service_events", "service_events_byte"):
        out[key]["ratio_to_raw_publish"] = (
            out[key]["events_per_s"] / out["raw_publish"]["events_per_s"]
        )
    out["prompt_reuse"] = await prompt_reuse(hf, reuse_tasks, reuse_samples)
    model, trees, in_flight = TREES[scale]
    out["tree_cost"] = {
        "scale": scale,
        **await tree_cost(model, trees, in_flight=in_flight, floor_seconds=FLOOR_SECONDS[scale]),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="a few episodes per row: runs? (tests; seconds)"
    )
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {RESULTS})")
    p.add_argument(
        "--tree-cost-only",
        action="store_true",
        help="run only tree_cost and put it into the existing result file "
        "(the other rows stay as they are)",
    )
    args = p.parse_args()
    scale = "smoke" if args.smoke else "quick" if args.quick else "full"
    out = args.out or (SMOKE_OUT if args.smoke else RESULTS)
    if args.tree_cost_only:
        model, trees, in_flight = TREES[scale]
        row = {
            "host": host_record(),
            "scale": scale,
            **asyncio.run(
                tree_cost(model, trees, in_flight=in_flight, floor_seconds=FLOOR_SECONDS[scale])
            ),
        }
        merged = json.loads(out.read_text()) if out.is_file() else {}
        merged["tree_cost"] = row
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merged, indent=1, sort_keys=True))
        print(json.dumps(row, indent=1))
        return
    host = host_record()
    with tempfile.TemporaryDirectory() as store:
        # As in the service: JSON logs at info (per-episode lines; per-step lines are
        # debug, filtered).
        configure_logging(json=True, level="info", file=Path(store) / "bench.log")
        server = EmbeddedNats(Path(store)).start()
        try:
            results = asyncio.run(bench(server.url, scale))
        finally:
            server.stop()
    results["meta"] = {"quick": args.quick, "smoke": args.smoke}
    results["host"] = host
    results = keep_sections(out, results, ("tree_cost",))  # measured by --tree-cost-only
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))
    ov = results["overhead_at_100ms"]
    print(
        f"overhead per engine call at 100 ms latency: {ov['overhead_per_call_ms']:.2f} ms "
        f"= {ov['ratio_to_engine_latency']:.1%} of the engine time (target < 5%)"
    )
    own = results["overhead_at_0ms"]["overhead_per_call_ms"]
    print(f"actor's own time per call (instant engine): {own:.2f} ms")
    for key in ("service_events", "service_events_byte", "raw_publish"):
        r = results[key]
        ratio = (
            f" ({r['ratio_to_raw_publish']:.2f}x raw publish)"
            if "ratio_to_raw_publish" in r
            else ""
        )
        print(f"{key:>20}: {r['events_per_s']:8.0f} events/s{ratio}")
    for window, r in results["prompt_reuse"].items():
        print(
            f"history window {window}: {r['prompt_tokens_per_step']:.0f} prompt tokens/step, "
            f"{r['new_tokens_per_step']:.0f} not in the prefix cache "
            f"({r['cache_share']:.0%} cached)"
        )
    tc = results["tree_cost"]
    shares = ", ".join(
        f"{kind} {u['cache_share']:.0%} (ideal {u['ideal_share']:.0%})"
        for kind, u in tc["by_kind"].items()
    )
    counters = tc["engine_counters"]
    print(
        f"Stage 1 ({tc['trees']} recorded trees, {tc['requests']} requests): "
        f"{tc['trees_per_engine_cpu_minute']:.2f} trees per engine CPU-minute (prefill "
        f"{counters['prefill_cpu_s']:.0f} s, decode {counters['decode_cpu_s']:.0f} s); "
        f"prompt tokens from the prefix cache: {shares}"
    )
    floor = tc["floor"]
    print(
        f"  linear-layer floor {floor['floor_s']:.0f} s (engine {floor['over_floor']:.2f}x it: "
        f"prefill {floor['prefill']['over_floor']:.2f}x, "
        f"decode {floor['decode']['over_floor']:.2f}x): at most "
        f"{tc['trees_per_engine_cpu_minute_at_floor']:.2f} trees per engine CPU-minute here"
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
