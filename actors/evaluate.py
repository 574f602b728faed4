"""Pass@k evaluation: n plain rollouts per task through the actor path, scored with the unbiased
estimator.

Every sample is an ordinary ``mode="eval"`` rollout (``leafe.actors.rollout.run_rollout``: the same
prompts, parsing and events as training rollouts), so an evaluation can be published to the log and
replayed. One semaphore bounds the rollouts in flight over *all* tasks and samples: the inference
server's dynamic batching then sees about ``concurrency`` requests at once. Rollouts are scheduled
task by task, so the samples of a task share their prompt prefix in the server's cache.

Identity is deterministic and matches ``leafe tasks submit --mode eval --prefix <label>``: sample s
of task i (``task_ids[i]``) is task key ``<run>-<label>-<task slug>-x<s>``, episode ``<task
key>.a1@<actor id>`` (``leafe.protocol.tasks.episode_id_for``), group ``<run>-<label>-<task slug>``
of size n, seed ``seed + 1000 * i + s``.

```python
request = EvalRequest(env="sokoban", task_ids=["sokoban/test/0", "sokoban/test/1"], samples=16,
                      ks=[1, 4, 16], run_id="r1", label="v0")
result = await evaluate(request, engine=client, tokenizer=tok)
result.passk[4], result.successes["sokoban/test/0"]
```
``leafe eval`` (``services/eval/main.py``) wraps this with servers, files and a table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import structlog

from leafe.actors.config import Override, RolloutConfig
from leafe.actors.engine import Engine
from leafe.actors.env_pool import EnvFactory, EnvPool
from leafe.actors.episode import EpisodeSpec, EpisodeSummary, EventSink
from leafe.actors.passk import pass_at_k_table
from leafe.actors.rollout import run_rollout
from leafe.envs.registry import make_env
from leafe.protocol.config import config_digest
from leafe.protocol.events import EpisodeEvent, Step
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.tasks import episode_id_for, task_slug

__all__ = [
    "EVAL_ROLLOUT_DEFAULTS",
    "EvalRequest",
    "EvalResult",
    "EvalSample",
    "eval_samples",
    "evaluate",
]

log = structlog.get_logger(__name__)

Seeds = Literal["yes", "no", "unknown"]
"""Whether seeded sampling is honoured (and so whether an evaluation is reproducible)."""

EVAL_ROLLOUT_DEFAULTS: Override = {"return_logprob": False}
"""Rollout overrides every evaluation starts from (Pass@k needs no behaviour logprobs); the caller's
``rollout_overrides`` win over these, the per-env defaults of ``leafe.actors.config`` lose to
both."""


class EvalRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One evaluation: which tasks, how many samples each, how they are identified and sampled."""

    env: str
    """Environment registry name."""
    task_ids: list[str]
    """Tasks evaluated, in order (their index seeds the samples)."""
    env_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Environment constructor options."""
    split: str = "test"
    """Split the tasks come from (recorded in the events)."""
    samples: int = 16
    """n: rollouts per task."""
    ks: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8, 16])
    """k values scored (each <= ``samples``)."""
    run_id: str = "eval"
    """Run the eval episodes belong to."""
    label: str = "eval"
    """Names the evaluated weights in episode ids and reports (key-safe)."""
    concurrency: int = 16
    """Rollouts in flight at once, over all tasks."""
    seed: int = 0
    """Base sampling seed: sample s of task i uses ``seed + 1000 * i + s``."""
    rollout_overrides: dict[str, Any] = msgspec.field(default_factory=dict)
    """``RolloutConfig`` fields over the env's defaults (e.g. the actors' ``[actor.rollout]``
    table)."""
    actor_id: str = "eval"
    """Actor id stamped on the events."""
    seeds_honoured: Seeds = "unknown"
    """Does the engine honour ``sampling_seed``? Our CPU server: ``yes``; SGLang only when started
    with ``--enable-deterministic-inference``, which a client cannot see, so whoever points an
    evaluation at an external engine says so (``leafe eval --seeds-honoured``)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency = {self.concurrency}: must be >= 1")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks = {list(self.ks)}: need at least one k, all >= 1")
        if min(self.ks) > self.samples:
            raise ValueError(f"ks = {list(self.ks)}: every k exceeds samples = {self.samples}")


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
    """Version of the first completion (its ``meta_info.weight_version``, the server that generated
    it; never ``/get_model_info``, which a router answers from its first healthy worker);
    ``default`` when no policy step ran."""
    policy_versions: list[str]
    """Distinct versions stamped on the steps (more than one: weights changed mid-evaluation)."""
    episodes: int
    """Rollouts run (tasks x samples)."""
    env_errors: int
    """Rollouts that ended with an environment error (scored as failures)."""
    reproducible: Seeds = "unknown"
    """Would a rerun draw the same samples? ``yes``: seeded sampling on and the engine honours
    seeds; ``no``: seeded sampling off or seeds ignored; ``unknown``: an engine whose seed handling
    nobody stated (``EvalRequest.seeds_honoured``)."""


class EvalSample(msgspec.Struct, frozen=True, kw_only=True):
    """Where one evaluation sample sits: task index i, sample s, and its episode identity."""

    task_index: int
    """Index of the task in ``task_ids``."""
    sample: int
    """Sample index s (0..n-1)."""
    spec: EpisodeSpec
    """The episode's identity and seed."""


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
                run_id=run_id,
                episode_id=episode_id_for(key, 1, actor_id),
                actor_id=actor_id,
                task_key=key,
                env=env_name,
                task_id=task_id,
                split=split,
                seed=seed + 1000 * i + s,
                mode="eval",
                group_id=group,
                group_size=samples,
                config_digest=config_digest,
            )
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
    request: EvalRequest,
    *,
    engine: Engine,
    tokenizer: ChatTokenizer,
    sink: EventSink | None = None,
    env_factory: EnvFactory | None = None,
    on_episode: Callable[[EvalSample, EpisodeSummary], None] | None = None,
) -> EvalResult:
    """Run ``request.samples`` eval rollouts of every task, at most ``request.concurrency`` at once,
    and score Pass@k.

    ``sink`` receives every event (``None``: discarded); ``env_factory(name, **options)`` defaults
    to ``leafe.envs.registry.make_env``; ``on_episode`` is called after each rollout (progress
    displays). An ``EngineError`` (or any non-env failure) cancels the remaining rollouts and
    propagates.
    """
    r = request
    config = RolloutConfig.for_env(r.env, {**EVAL_ROLLOUT_DEFAULTS, **r.rollout_overrides})
    plan = eval_samples(
        run_id=r.run_id,
        label=r.label,
        env_name=r.env,
        task_ids=r.task_ids,
        split=r.split,
        samples=r.samples,
        seed=r.seed,
        actor_id=r.actor_id,
        config_digest=config_digest(config),
    )
    pool = EnvPool(env_factory or make_env, max_idle=r.concurrency)
    tally, gate = _Tally(sink), asyncio.Semaphore(r.concurrency)
    options = dict(r.env_options)
    log.info(
        "actor.eval.started",
        label=r.label,
        env=r.env,
        tasks=len(r.task_ids),
        samples=r.samples,
        concurrency=r.concurrency,
    )

    async def one(item: EvalSample) -> EpisodeSummary:
        async with gate:
            env = await pool.acquire(r.env, options, in_thread=config.env_in_thread)
            reusable = False
            try:
                summary = await run_rollout(
                    engine=engine,
                    tokenizer=tokenizer,
                    env=env,
                    spec=item.spec,
                    config=config,
                    sink=tally,
                )
                reusable = not summary.error
            finally:
                pool.release(env, r.env, options, reusable=reusable)
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
    summaries = [t.result() for t in tasks]
    reproducible: Seeds = r.seeds_honoured if config.seeded_sampling else "no"
    result = _score(
        plan, summaries, tally, r.ks, wall_s=wall, label=r.label, reproducible=reproducible
    )
    log.info(
        "actor.eval.finished",
        label=r.label,
        weight_version=result.weight_version,
        reproducible=result.reproducible,
        passk=result.passk,
        success_rate=result.success_rate,
        wall_s=round(wall, 2),
    )
    return result


def _score(
    plan: Sequence[EvalSample],
    summaries: Sequence[EpisodeSummary],
    tally: _Tally,
    ks: Sequence[int],
    *,
    wall_s: float,
    label: str,
    reproducible: Seeds,
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
        weight_version=next(iter(tally.versions), "default"),
        policy_versions=list(tally.versions),
        episodes=n,
        env_errors=sum(bool(s.error) for s in summaries),
        reproducible=reproducible,
    )
