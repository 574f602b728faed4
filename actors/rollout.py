"""Plain rollouts: independent samples of a task with no reflection, rollback or branching.

Used for evaluation (Pass@k) and for the GRPO/RFT baselines. A rollout is an exploration tree of one
branch (``ExplorerConfig.from_rollout``), so it emits the same events (EpisodeStarted, Steps, one
Outcome, EpisodeFinished) through the same code; only Reflection/Rollback/Branch never appear.

```python
summaries = await run_rollouts(
    engine=client,
    tokenizer=tok,
    env_factory=lambda: make_env("sokoban"),
    spec=EpisodeSpec(..., mode="eval"),
    config=RolloutConfig.for_env("sokoban"),
    sink=ListSink(),
    n=16,
)
```
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from leafe.actors.config import ExplorerConfig, RolloutConfig
from leafe.actors.engine import Engine
from leafe.actors.episode import EpisodeSpec, EpisodeSummary, EventSink
from leafe.actors.explorer import Explorer
from leafe.envs.base import Env
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.tasks import OWNER_MARK, episode_owner, owned_episode_id

__all__ = ["run_rollout", "run_rollouts"]


async def run_rollout(
    *,
    engine: Engine,
    tokenizer: ChatTokenizer,
    env: Env,
    spec: EpisodeSpec,
    config: RolloutConfig,
    sink: EventSink,
) -> EpisodeSummary:
    """One plain episode of ``spec.task_id`` on ``env`` (``spec.mode`` should be rollout or
    eval)."""
    explorer = Explorer(
        engine=engine,
        tokenizer=tokenizer,
        env=env,
        config=ExplorerConfig.from_rollout(config),
        sink=sink,
        spec=spec,
    )
    return await explorer.run()


async def run_rollouts(
    *,
    engine: Engine,
    tokenizer: ChatTokenizer,
    env_factory: Callable[[], Env],
    spec: EpisodeSpec,
    config: RolloutConfig,
    sink: EventSink,
    n: int,
) -> list[EpisodeSummary]:
    """``n`` independent samples of one task, concurrently, each on its own env instance.

    Sample i is episode ``<stem>.s<i>@<actor>`` (``stem``: ``spec.episode_id`` without its owner,
    ``leafe.protocol.tasks.owned_episode_id``) with seed ``spec.seed + i``, all in one group
    (``spec.group_id``, else ``spec.episode_id``) of size ``n``. Envs are closed afterwards.
    """
    if n < 1:
        raise ValueError(f"n = {n}: need at least one rollout")
    group = spec.group_id or spec.episode_id

    async def one(i: int) -> EpisodeSummary:
        env = env_factory()
        try:
            sample = _sample_spec(spec, i, group, n)
            return await run_rollout(
                engine=engine, tokenizer=tokenizer, env=env, spec=sample, config=config, sink=sink
            )
        finally:
            env.close()

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(i)) for i in range(n)]
    return [t.result() for t in tasks]


def _sample_spec(spec: EpisodeSpec, i: int, group: str, n: int) -> EpisodeSpec:
    stem = spec.episode_id
    if episode_owner(stem) is not None:
        stem = stem.rpartition(OWNER_MARK)[0]
    return EpisodeSpec(
        run_id=spec.run_id,
        episode_id=owned_episode_id(f"{stem}.s{i}", spec.actor_id),
        actor_id=spec.actor_id,
        task_key=spec.task_key,
        env=spec.env,
        task_id=spec.task_id,
        split=spec.split,
        seed=spec.seed + i,
        mode=spec.mode,
        attempt=spec.attempt,
        group_id=group,
        group_size=n,
        config_digest=spec.config_digest,
    )
