"""Pass@k evaluation: n plain rollouts per task through the actor path, scored with the unbiased estimator.

Every sample is an ordinary ``mode="eval"`` rollout (``actors.rollout.run_rollout``: the same prompts,
parsing and events as training rollouts), so an evaluation can be published to the log and replayed.
One semaphore bounds the rollouts in flight over *all* tasks and samples: the inference server's dynamic
batching then sees about ``concurrency`` requests at once. Rollouts are scheduled task by task, so the
samples of a task share their prompt prefix in the server's cache.

Identity is deterministic and matches ``leafe tasks submit --mode eval --prefix <label>``: sample s of
task i (``task_ids[i]``) is task key ``<run>-<label>-<task slug>-x<s>``, episode ``<task key>.a1``,
group ``<run>-<label>-<task slug>`` of size n, seed ``seed + 1000 * i + s``.

```python
result = await evaluate(engine=client, tokenizer=tok, env_name="sokoban", env_options={},
                        task_ids=["sokoban/test/0", "sokoban/test/1"], split="test", samples=16,
                        ks=[1, 4, 16], run_id="r1", label="v0", concurrency=16, sink=None)
result.passk[4], result.successes["sokoban/test/0"]
```
``leafe eval`` (``services/eval.py``) wraps this with servers, files and a table.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import structlog

from actors.config import Override, RolloutConfig
from actors.engine import Engine
from actors.env_pool import EnvFactory, EnvPool
from actors.episode import EpisodeSpec, EpisodeSummary, EventSink
from actors.passk import pass_at_k_table
from actors.rollout import run_rollout
from protocol.events import EpisodeEvent, Step
from protocol.prompt import ChatTokenizer
from protocol.tasks import episode_id_for

__all__ = ["EVAL_ROLLOUT_DEFAULTS", "EvalResult", "EvalSample", "eval_samples", "evaluate", "task_slug"]

log = structlog.get_logger(__name__)

EVAL_ROLLOUT_DEFAULTS: Override = {"return_logprob": False}
"""Rollout overrides every evaluation starts from (Pass@k needs no behaviour logprobs); the caller's
``rollout_overrides`` win over these, the per-env defaults of ``actors.config`` lose to both."""


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """Pass@k of one model (or weight version) over n samples of each task, and what it cost."""

    label: str
    """Name of what was evaluated (model, weight version); part of every episode id."""
    run_id: str
    """Run the episodes belong to."""
    env: str
    """Environment registry name."""
    split: str
    """Task split."""
    samples: int
    """n: rollouts per task."""
    task_ids: list[str]
    """Tasks, in evaluation order."""
    successes: dict[str, list[bool]]
    """Task id -> success of each sample, in sample order."""
    passk: dict[int, float]
    """k -> mean unbiased Pass@k over tasks, as a fraction (k > n left out)."""
    success_rate: float
    """Successful samples / all samples."""
    mean_steps: float
    """Policy actions per episode (invalid ones included)."""
    parse_failure_rate: float
    """Completions with no valid action / all policy actions (0 when there were none)."""
    mean_prompt_tokens: float
    """Prompt tokens per policy step."""
    wall_s: float
    """Wall-clock seconds from the first rollout to the last."""
    weight_version: str
    """Version the engine reported before the first rollout."""
    policy_versions: list[str]
    """Distinct versions stamped on the steps (more than one: weights changed mid-evaluation)."""
    episodes: int
    """Rollouts run (tasks x samples)."""
    env_errors: int
    """Rollouts that ended with an environment error (scored as failures)."""


class EvalSample(msgspec.Struct, frozen=True, kw_only=True):
    """Where one evaluation sample sits: task index i, sample s, and its episode identity."""

    task_index: int
    """Index of the task in ``task_ids``."""
    sample: int
    """Sample index s (0..n-1)."""
    spec: EpisodeSpec
    """The episode's identity and seed."""


def task_slug(task_id: str) -> str:
    """A task id as a key-safe token: ``sokoban/test/3`` -> ``sokoban-test-3``.

    The same as ``services.tasks.task_slug``, kept here because actors must not import services (a unit
    test pins that both agree)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in task_id)


def _digest(config: RolloutConfig) -> str:
    # Same formula as services.config.config_digest (actors must not import services).
    return hashlib.sha256(msgspec.json.encode(msgspec.to_builtins(config), order="sorted")).hexdigest()


def eval_samples(
    *,
    run_id: str,
    label: str,
    env_name: str,
    task_ids: Sequence[str],
    split: str,
    samples: int,
    seed: int = 0,
    actor_id: str = "eval",
    config_digest: str = "",
) -> list[EvalSample]:
    """Every (task, sample) of an evaluation with its deterministic episode spec, task by task."""
    if samples < 1:
        raise ValueError(f"samples = {samples}: need at least one rollout per task")
    if not task_ids:
        raise ValueError("task_ids is empty: nothing to evaluate")
    if len(set(task_ids)) != len(task_ids):
        raise ValueError(
            f"task_ids has duplicates: {sorted(t for t in set(task_ids) if task_ids.count(t) > 1)}"
        )
    out = []
    for i, task_id in enumerate(task_ids):
        group = f"{run_id}-{label}-{task_slug(task_id)}"
        for s in range(samples):
            key = f"{group}-x{s}"
            spec = EpisodeSpec(
                run_id=run_id, episode_id=episode_id_for(key, 1), actor_id=actor_id, task_key=key,
                env=env_name, task_id=task_id, split=split, seed=seed + 1000 * i + s, mode="eval",
                group_id=group, group_size=samples, config_digest=config_digest,
            )  # fmt: skip
            out.append(EvalSample(task_index=i, sample=s, spec=spec))
    return out


class _Tally:
    """Forwards events to the caller's sink (if any) and sums what the summaries do not carry."""

    def __init__(self, inner: EventSink | None) -> None:
        self.inner = inner
        self.steps = 0
        self.prompt_tokens = 0
        self.versions: dict[str, None] = {}

    async def emit(self, event: EpisodeEvent) -> None:
        if isinstance(event, Step):
            self.steps += 1
            self.prompt_tokens += event.prompt_tokens
            self.versions.setdefault(event.policy_version, None)
        if self.inner is not None:
            await self.inner.emit(event)


async def evaluate(
    *,
    engine: Engine,
    tokenizer: ChatTokenizer,
    env_name: str,
    env_options: Mapping[str, Any],
    task_ids: Sequence[str],
    split: str,
    samples: int,
    ks: Sequence[int],
    run_id: str,
    label: str,
    concurrency: int,
    sink: EventSink | None,
    seed: int = 0,
    rollout_overrides: Override | None = None,
    env_factory: EnvFactory | None = None,
    on_episode: Callable[[EvalSample, EpisodeSummary], None] | None = None,
    actor_id: str = "eval",
) -> EvalResult:
    """Run ``samples`` eval rollouts of every task, at most ``concurrency`` at once, and score Pass@k.

    ``sink`` receives every event (``None``: discarded); ``env_factory(name, **options)`` defaults to
    ``envs.registry.make_env``; ``on_episode`` is called after each rollout (progress displays). An
    ``EngineError`` (or any non-env failure) cancels the remaining rollouts and propagates.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency = {concurrency}: must be >= 1")
    config = RolloutConfig.for_env(env_name, {**EVAL_ROLLOUT_DEFAULTS, **(rollout_overrides or {})})
    plan = eval_samples(
        run_id=run_id, label=label, env_name=env_name, task_ids=task_ids, split=split, samples=samples,
        seed=seed, actor_id=actor_id, config_digest=_digest(config),
    )  # fmt: skip
    if not ks or min(ks) < 1:
        raise ValueError(f"ks = {list(ks)}: need at least one k, all >= 1")
    if min(ks) > samples:
        raise ValueError(f"ks = {list(ks)}: every k exceeds samples = {samples}, so no Pass@k is defined")
    if env_factory is None:
        from envs.registry import make_env

        env_factory = make_env
    pool = EnvPool(env_factory, max_idle=concurrency)
    tally, gate = _Tally(sink), asyncio.Semaphore(concurrency)
    options = dict(env_options)
    version = await engine.weight_version()
    log.info("actor.eval.started", label=label, env=env_name, tasks=len(task_ids), samples=samples,
             concurrency=concurrency, weight_version=version)  # fmt: skip

    async def one(item: EvalSample) -> EpisodeSummary:
        async with gate:
            env = await pool.acquire(env_name, options, in_thread=config.env_in_thread)
            reusable = False
            try:
                summary = await run_rollout(
                    engine=engine, tokenizer=tokenizer, env=env, spec=item.spec, config=config, sink=tally
                )
                reusable = not summary.error
            finally:
                pool.release(env, env_name, options, reusable=reusable)
        if on_episode is not None:
            on_episode(item, summary)
        return summary

    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(item)) for item in plan]
    except BaseExceptionGroup as eg:  # surface the first failure itself, not a group of one
        raise eg.exceptions[0] from eg
    finally:
        pool.close()
    wall = time.perf_counter() - t0
    result = _score(plan, [t.result() for t in tasks], tally, ks, wall_s=wall, version=version, label=label)
    log.info("actor.eval.finished", label=label, passk=result.passk, success_rate=result.success_rate,
             wall_s=round(wall, 2))  # fmt: skip
    return result


def _score(
    plan: Sequence[EvalSample],
    summaries: Sequence[EpisodeSummary],
    tally: _Tally,
    ks: Sequence[int],
    *,
    wall_s: float,
    version: str,
    label: str,
) -> EvalResult:
    first = plan[0].spec
    task_ids = list(dict.fromkeys(item.spec.task_id for item in plan))
    successes: dict[str, list[bool]] = {t: [] for t in task_ids}
    for item, summary in zip(plan, summaries, strict=True):
        successes[item.spec.task_id].append(summary.success)
    actions = sum(s.actions for s in summaries)
    n = len(summaries)
    return EvalResult(
        label=label,
        run_id=first.run_id,
        env=first.env,
        split=first.split,
        samples=first.group_size,
        task_ids=task_ids,
        successes=successes,
        passk=pass_at_k_table(successes, ks),
        success_rate=sum(s.success for s in summaries) / n,
        mean_steps=actions / n,
        parse_failure_rate=sum(s.parse_failures for s in summaries) / actions if actions else 0.0,
        mean_prompt_tokens=tally.prompt_tokens / tally.steps if tally.steps else 0.0,
        wall_s=round(wall_s, 3),
        weight_version=version,
        policy_versions=list(tally.versions),
        episodes=n,
        env_errors=sum(bool(s.error) for s in summaries),
    )
