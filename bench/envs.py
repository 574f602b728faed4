"""Environment speed and rollback cost: steps/s per environment, snapshot vs replay against depth
tau.

For each environment a fixed random action sequence (seeded; actions that would end the episode,
such as ScienceWorld's "focus on" or TextWorld's "eat", are avoided) is replayed to measure steps/s,
then ``leafe.envs.base.rollback_to`` restores the state before step tau for tau in 1, 2, 4, 8, 16,
by reset + replay and, where the env has one, by snapshot. Ratios are printed against tau = 1 replay
and against the snapshot restore of the same depth, all measured in this process.

Run: ``.venv/bin/python -m bench.envs [--quick] [--only sokoban,humaneval] [--out PATH]``; writes
bench/results/envs.json. ``--smoke`` (the tests' check that the bench still runs, seconds) measures
Sokoban and HumanEval once each, tau <= 2, and writes to a temporary file unless ``--out`` says
otherwise; TextWorld and ScienceWorld (game generation, a JVM) are left to the real runs.

``--probe-model`` instead measures how often SmolLM2-135M-Instruct (temperature 1, the actors'
prompt and lenient parser) solves Sokoban rooms and TextWorld games of several difficulties, to pick
defaults with success above 0 and below saturation; writes bench/results/envs_difficulty.json. It
runs the model on the CPU and takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.host import host_record
from leafe.envs.base import Env, rollback_to
from leafe.envs.registry import make_env

TAUS = (1, 2, 4, 8, 16)
SMOKE_ENVS = ("sokoban", "humaneval")
RESULTS = Path(__file__).resolve().parent / "results" / "envs.json"
SMOKE_OUT = Path(tempfile.gettempdir()) / "leafe-bench-smoke" / "envs.json"
AVOID = ("focus on", "eat ", "reset task")


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def random_actions(
    env: Env, task_id: str, n: int, rng: random.Random, fixed: list[str] | None
) -> list[str]:
    """``n`` actions: from ``fixed`` (e.g. Sokoban moves) or the env's valid ones, avoiding episode
    enders."""
    env.reset(task_id)
    actions = []
    for _ in range(n):
        valid = fixed or [a for a in (env.valid_actions() or []) if not a.startswith(AVOID)]
        action = rng.choice(valid)
        actions.append(action)
        env.step(action)
    return actions


def reps_for(quick: bool, smoke: bool, full: int) -> int:
    """Repetitions per timing: 1 for ``--smoke`` (it checks the code runs), 3 for ``--quick``."""
    return 1 if smoke else 3 if quick else full


def bench_env(
    name: str,
    options: dict,
    task_split: str,
    fixed: list[str] | None,
    quick: bool,
    smoke: bool = False,
) -> dict:
    taus = TAUS[:2] if smoke else TAUS
    env = make_env(name, **options)
    try:
        task_id = env.tasks(task_split)[0]
        env.reset(task_id)  # warm: JVM start, game generation, room generation
        rng = random.Random(0)
        horizon = max(taus)
        actions = random_actions(env, task_id, horizon, rng, fixed)
        reps = reps_for(quick, smoke, 10)
        reset_s = timed(lambda: env.reset(task_id), reps)

        def episode() -> None:
            env.reset(task_id)
            for a in actions:
                env.step(a)

        episode_s = timed(episode, reps)
        steps_per_s = len(actions) / max(episode_s - reset_s, 1e-9)
        rollback: dict[str, dict[int, float]] = {"replay": {}, "snapshot": {}}
        for tau in taus:
            prefix = actions[:tau]
            rollback["replay"][tau] = timed(partial(rollback_to, env, task_id, prefix), reps)
            if env.supports_snapshot:
                rollback_to(env, task_id, prefix)
                snap = env.snapshot()
                rollback["snapshot"][tau] = timed(
                    partial(rollback_to, env, task_id, [], snapshot=snap), reps
                )
        return {
            "options": options,
            "task_id": task_id,
            "steps_per_s": steps_per_s,
            "reset_s": reset_s,
            "rollback_s": rollback,
            "supports_snapshot": env.supports_snapshot,
        }
    finally:
        env.close()


def humaneval_bench(quick: bool, smoke: bool = False) -> dict:
    """HumanEval: a step is one sandboxed submission; the horizon is 4 turns, so tau <= 4."""
    from leafe.envs.humaneval.env import HumanEvalConfig, HumanEvalEnv

    env = HumanEvalEnv(HumanEvalConfig(num_test=164))
    task_id = "humaneval/test/53"
    wrong = "def add(x, y):\n    return x - y\n"
    reps = reps_for(quick, smoke, 8)
    env.reset(task_id)
    step_s = timed(lambda: (env.reset(task_id), env.step(wrong)), reps)
    rollback: dict[str, dict[int, float]] = {"replay": {}, "snapshot": {}}
    for tau in (1,) if smoke else (1, 2, 3):
        prefix = [wrong] * tau
        rollback["replay"][tau] = timed(
            partial(rollback_to, env, task_id, prefix), max(1 if smoke else 2, reps // 2)
        )
        rollback_to(env, task_id, prefix)
        snap = env.snapshot()
        rollback["snapshot"][tau] = timed(
            partial(rollback_to, env, task_id, [], snapshot=snap), reps
        )
    return {
        "options": {},
        "task_id": task_id,
        "steps_per_s": 1.0 / step_s,
        "reset_s": 0.0,
        "rollback_s": rollback,
        "supports_snapshot": True,
    }


def report(results: dict[str, dict]) -> None:
    base = results.get("sokoban", {}).get("steps_per_s")
    print(f"{'env':<18} {'steps/s':>10} {'vs sokoban':>11} {'reset ms':>9}")
    for name, r in results.items():
        ratio = f"{r['steps_per_s'] / base:.2e}" if base else "-"
        print(f"{name:<18} {r['steps_per_s']:>10.1f} {ratio:>11} {r['reset_s'] * 1e3:>9.2f}")
    print("\nrollback cost: replay ms (x tau=1 replay) | snapshot ms (replay / snapshot)")
    for name, r in results.items():
        replay, snap = r["rollback_s"]["replay"], r["rollback_s"]["snapshot"]
        first = replay[min(replay)]
        cells = []
        for tau, s in replay.items():
            cell = f"tau={tau}: {s * 1e3:.2f} (x{s / first:.1f})"
            if tau in snap:
                cell += f" | {snap[tau] * 1e3:.4f} ({s / snap[tau]:.0f}x)"
            cells.append(cell)
        print(f"{name}:\n  " + "\n  ".join(cells))


PROBE_CONFIGS: list[tuple[str, dict]] = [
    ("sokoban", {"height": 5, "width": 5, "max_solution_len": 2, "max_steps": 5}),
    ("sokoban", {"height": 6, "width": 6, "max_solution_len": 3, "max_steps": 8}),
    ("sokoban", {"max_steps": 10}),
    ("textworld-cooking", {"max_steps": 8}),
]


def probe_model(rooms: int, samples: int) -> list[dict]:
    """Success rate of the 135M model per difficulty (episodes in lockstep, one batch per move)."""
    import torch

    from leafe.actors.parsing import parse_action
    from leafe.learner.model_io import HFChatTokenizer, load_model, resolve_model
    from leafe.protocol.prompt import HistoryEntry, render_messages

    path = resolve_model("smollm2-135m-instruct")
    tok, model = HFChatTokenizer.from_dir(path), load_model(path)
    tok.tokenizer.padding_side = "left"
    torch.manual_seed(0)
    out = []
    for name, options in PROBE_CONFIGS:
        start = time.perf_counter()
        envs: list[Env] = []
        tasks: list[str] = []
        state: list[dict[str, Any]] = []
        task_ids = make_env(name, **options).tasks("test")[:rooms]
        for task_id in task_ids:
            for _ in range(samples):
                env = make_env(name, **options)
                r = env.reset(task_id)
                envs.append(env)
                tasks.append(task_id)
                state.append(
                    {
                        "task": r.task,
                        "obs": r.observation,
                        "history": [],
                        "done": False,
                        "success": False,
                    }
                )
        while active := [i for i, s in enumerate(state) if not s["done"]]:
            prompts = [
                tok.encode_chat(
                    render_messages(
                        instructions=envs[i].instructions,
                        task=state[i]["task"],
                        history=state[i]["history"],
                        observation=state[i]["obs"],
                    )
                )
                for i in active
            ]
            texts = _generate(model, tok, prompts)
            print(f"  {name}: {len(active)} active", file=sys.stderr, flush=True)
            for i, text in zip(active, texts, strict=True):
                parsed = parse_action(text, envs[i].valid_actions())
                s = state[i]
                t = envs[i].step(parsed.action if parsed.action is not None else text)
                s["history"].append(HistoryEntry(parsed.action, text, t.observation, t.feedback))
                s["obs"], s["done"], s["success"] = t.observation, t.done, t.success
        solved = [s["success"] for s in state]
        per_task = [any(solved[k * samples : (k + 1) * samples]) for k in range(len(task_ids))]
        row = {
            "env": name,
            "options": options,
            "episodes": len(solved),
            "success_rate": sum(solved) / len(solved),
            "tasks_solved_at_least_once": sum(per_task) / len(per_task),
            "seconds": time.perf_counter() - start,
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _generate(model: Any, tok: Any, prompts: list[list[int]]) -> list[str]:
    import torch

    width = max(len(p) for p in prompts)
    pad = tok.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=16,
            pad_token_id=pad,
        )
    return [tok.decode(row[width:].tolist()) for row in gen]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--smoke", action="store_true", help=f"{', '.join(SMOKE_ENVS)}, once: runs? (tests)"
    )
    parser.add_argument("--only", default="", help="comma-separated env names")
    parser.add_argument("--out", type=Path, default=None, help=f"result file (default {RESULTS})")
    parser.add_argument(
        "--probe-model", action="store_true", help="success of SmolLM2-135M per difficulty"
    )
    parser.add_argument("--rooms", type=int, default=8, help="tasks per difficulty (--probe-model)")
    parser.add_argument("--samples", type=int, default=4, help="episodes per task (--probe-model)")
    args = parser.parse_args(argv)
    if args.probe_model:
        host = host_record()
        rows = probe_model(args.rooms, args.samples)
        out = Path(__file__).parent / "results" / "envs_difficulty.json"
        record = {"rooms": args.rooms, "samples": args.samples, "host": host, "results": rows}
        out.write_text(json.dumps(record, indent=2))
        print(f"wrote {out}")
        return 0
    plans: dict[str, Callable[[], dict]] = {
        "sokoban": lambda: bench_env(
            "sokoban",
            {"max_steps": 1000, "end_on_deadlock": False},
            "test",
            ["up", "down", "left", "right"],
            args.quick,
            args.smoke,
        ),
        "textworld-cooking": lambda: bench_env(
            "textworld-cooking", {"max_steps": 1000}, "test", None, args.quick
        ),
        "scienceworld": lambda: bench_env(
            "scienceworld",
            {"task_names": ["find-plant"], "max_steps": 1000},
            "train",
            None,
            args.quick,
        ),
        "humaneval": lambda: humaneval_bench(args.quick, args.smoke),
    }
    only = [n for n in args.only.split(",") if n] or list(SMOKE_ENVS if args.smoke else plans)
    unknown = sorted(set(only) - set(plans))
    if unknown:
        parser.error(f"--only {args.only}: unknown env(s) {unknown}; known: {sorted(plans)}")
    host = host_record()
    results = {name: plans[name]() for name in only}
    report(results)
    out = args.out or (SMOKE_OUT if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"quick": args.quick, "smoke": args.smoke, "host": host, "results": results}
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
