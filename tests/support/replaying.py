"""Running the online replayer in integration tests: logs, publishing, waiting, reading what came
out.

:class:`Running` runs a ``Replayer`` on its own connection as a task a test can cancel abruptly (a
crash at an arbitrary await); :func:`offline_samples` is the reference every test compares with: the
same materializer folded over the run's whole log as ``leafe replay`` reads it.

    async with Running(nats_url, run_id, "leafe", tokenizer) as r:
        await wait_for(r.settled(js), what="all events acked")
    assert by_id(await published_samples(js, run_id)) == await offline_samples(
        js, run_id, "leafe", tok
    )
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from leafe.actors.fake_episodes import (
    ExploreSpec,
    build_explore_episode,
    build_rollout_group,
    interleave,
)
from leafe.learner.materializers import fold_events, make_materializer
from leafe.protocol.codec import decode_sample
from leafe.protocol.events import EpisodeEvent, EpisodeFinished, EpisodeStarted
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import Sample
from leafe.protocol.subjects import (
    EVENTS,
    SAMPLES,
    dead_letter_subject,
    replayer_durable,
    samples_filter,
)
from leafe.services.bus import NatsOptions, Publisher, connect, read_stream
from leafe.services.bus.dead_letters import (
    ERROR_HEADER,
    ORIGINAL_SEQ_HEADER,
    ORIGINAL_STREAM_HEADER,
    SAMPLE_ID_HEADER,
    letters_filter,
)
from leafe.services.replayer.replay import stream_events
from leafe.services.replayer.service import Replayer, ReplayerConfig

__all__ = [
    "MODES",
    "OPTIONS",
    "Running",
    "assert_samples_match_offline",
    "by_id",
    "consumer_settled",
    "dead_letters",
    "dead_reasons",
    "dead_samples",
    "make_log",
    "offline_samples",
    "publish",
    "published_samples",
    "replayer_config",
    "unfinished",
    "wait_for",
]

OPTIONS: dict[str, dict[str, Any]] = {
    "leafe": {"rehearsal_fraction": 0.5},
    "grpo": {},
    "rft": {},
}
"""Materializer options of the tests' replayers and of their offline references."""


CORRECTED_SEED = 6
"""The explore episode (by its simulation seed) whose failed branch is reflected on and corrected:
one counterfactual sample and two rehearsal ones, whatever the run id."""


def make_log(
    run_id: str, tok: ChatTokenizer, *, episodes: int = 16, groups: int = 4
) -> list[EpisodeEvent]:
    """Interleaved explore episodes (some with reflections and branches) and GRPO groups of one run.

    The first episode is always the one with a corrected branch (:data:`CORRECTED_SEED`), so every
    log yields a counterfactual sample: rehearsal samples are kept by hashing their outcome's event
    id, which holds the run id, and without it a small log lost every sample under ~2% of run
    ids."""
    seeds = [CORRECTED_SEED, *(i for i in range(episodes) if i != CORRECTED_SEED)][:episodes]
    streams = [
        build_explore_episode(
            ExploreSpec(
                seed=i, max_depth=2, budget=16, horizon=5, p_success=0.3, reflect_every=3 * (i % 2)
            ),
            run_id=run_id,
            episode_id=f"{run_id}-ep{i}",  # event ids (Nats-Msg-Id) must be unique across runs
            tokenizer=tok,
        )
        for i in seeds
    ]
    rng = random.Random(1)
    for g in range(groups):
        streams += build_rollout_group(
            rng,
            run_id=run_id,
            group_id=f"{run_id}-g{g}",
            n=4,
            tokenizer=tok,
            p_success=0.12,
            retry=g == 0,
        )
    return interleave(streams, random.Random(2))


async def publish(js: Any, events: list[EpisodeEvent]) -> None:
    """Publish ``events`` in order, every ack awaited."""
    async with Publisher(js) as pub:
        for e in events:
            await pub.publish_event(e)


async def published_samples(js: Any, run_id: str) -> list[Sample]:
    """Every sample the run's replayers stored, in stream order."""
    return [
        decode_sample(m.data)
        async for m in read_stream(js, stream=SAMPLES.name, filter_subject=samples_filter(run_id))
    ]


async def dead_letters(js: Any, run_id: str, stream: str = EVENTS.name) -> list[Msg]:
    """The run's dead letters of ``stream``, in order."""
    subject = letters_filter(dead_letter_subject(run_id, stream))
    return [m async for m in read_stream(js, stream="LEAFE_DEAD", filter_subject=subject)]


async def dead_reasons(js: Any, run_id: str) -> dict[int, str]:
    """Original stream seq -> reason, of the run's dead-lettered events (asserting each seq
    once)."""
    out: dict[int, str] = {}
    for m in await dead_letters(js, run_id):
        if SAMPLE_ID_HEADER in m.headers:
            continue
        seq = int(m.headers[ORIGINAL_SEQ_HEADER])
        assert seq not in out, f"seq {seq} dead-lettered twice"
        out[seq] = m.headers[ERROR_HEADER]
    return out


async def dead_samples(js: Any, run_id: str) -> list[Msg]:
    """The run's dead letters of samples too large to store (on the replayer's dead-letter
    subject)."""
    dead = [m for m in await dead_letters(js, run_id) if SAMPLE_ID_HEADER in m.headers]
    assert all(m.headers[ORIGINAL_STREAM_HEADER] == SAMPLES.name for m in dead)
    return dead


def by_id(samples: list[Sample]) -> dict[str, Sample]:
    """Samples by id (asserting none is there twice)."""
    out = {s.sample_id: s for s in samples}
    assert len(out) == len(samples), "a sample was stored twice"
    return out


async def wait_for(
    cond: Callable[[], Awaitable[bool]], limit_s: float = 60.0, what: str = "condition"
) -> None:
    """Poll ``cond`` every 0.1 s; AssertionError naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def consumer_settled(js: Any, run_id: str, name: str, open_episodes: int = 0) -> bool:
    """Every event delivered and acked, except the anchors of ``open_episodes`` unreleased
    episodes."""
    try:
        info = await js.consumer_info(EVENTS.name, replayer_durable(run_id, name))
    except NotFoundError:
        return False  # the replayer has not created its durable yet
    return info.num_pending == 0 and info.num_ack_pending == open_episodes


MODES = {"leafe": "explore", "grpo": "rollout", "rft": "rollout"}
"""The episode mode each materializer (with the tests' options) holds; it ignores the others."""


def unfinished(events: list[EpisodeEvent], name: str = "leafe") -> int:
    """Episodes in ``events`` that materializer ``name`` holds and that have no EpisodeFinished: the
    anchors a settled replayer still holds (episodes it ignores hold none)."""
    starts = [e for e in events if isinstance(e, EpisodeStarted) and e.mode == MODES[name]]
    newest = {}
    for e in starts:
        newest[e.task_key] = max(newest.get(e.task_key, e.attempt), e.attempt)
    # an attempt is released (not held) once a later attempt of its task started: superseded
    held = {e.episode_id for e in starts if e.attempt == newest[e.task_key]}
    return len(held - {e.episode_id for e in events if isinstance(e, EpisodeFinished)})


async def offline_samples(
    js: Any, run_id: str, name: str, tok: ChatTokenizer, **options: Any
) -> dict[str, Sample]:
    """The reference: ``name`` folded over the run's whole log as ``leafe replay`` reads it."""
    fold = make_materializer(name, tok, **{**OPTIONS[name], **options})
    result = fold_events([e async for e in stream_events(js, run_id)], fold)
    return by_id(result.samples)


async def assert_samples_match_offline(
    js: Any,
    run_id: str,
    tok: ChatTokenizer,
    *,
    name: str = "leafe",
    minus: frozenset[str] = frozenset(),
) -> None:
    """The replayer stored each sample once, exactly the offline rebuild's (less ``minus``: the ones
    dead-lettered for their size), and there are some."""
    online = by_id(await published_samples(js, run_id))
    offline = await offline_samples(js, run_id, name, tok)
    assert online and online == {k: v for k, v in offline.items() if k not in minus}


def replayer_config(name: str, **kw: Any) -> ReplayerConfig:
    """A test replayer's config: small batches, short ack wait and polling, ``kw`` on top."""
    base: dict[str, Any] = dict(
        materializer=name,
        model="tiny",
        options=OPTIONS[name],
        batch=16,
        ack_wait_s=1.5,
        fetch_timeout_s=0.2,
        stale_check_s=0.5,
    )
    base.update(kw)
    return ReplayerConfig(**base)


class Running:
    """A replayer on its own connection, run as a task that a test can cancel abruptly.

    ``nats_url`` is a URL or a role's options (the replayer's own: its durable must exist then);
    ``tokenizer`` builds the fold (tests may wrap the real one); ``replayer_cls`` lets a test inject
    a crash at a chosen point; ``kw`` are :class:`ReplayerConfig` fields.
    """

    def __init__(
        self,
        nats_url: str | NatsOptions,
        run_id: str,
        name: str,
        tokenizer: ChatTokenizer,
        *,
        replayer_cls: type[Replayer] = Replayer,
        **kw: Any,
    ) -> None:
        self.args = (nats_url, run_id, name, tokenizer)
        self.replayer_cls = replayer_cls
        self.kw = kw
        self.stop = asyncio.Event()

    async def __aenter__(self) -> Running:
        url, run_id, name, tok = self.args
        self.nc = await connect(url)
        fold = make_materializer(name, tok, **OPTIONS[name])
        cfg = replayer_config(name, **self.kw)
        self.replayer = self.replayer_cls(self.nc.jetstream(), run_id=run_id, fold=fold, config=cfg)
        self.task = asyncio.create_task(self.replayer.run(self.stop))
        return self

    def alive(self) -> None:
        """Raise the replayer's exception if its task ended (a crash must fail the test at once)."""
        if self.task.done():
            self.task.result()
            raise AssertionError("the replayer stopped on its own")

    def settled(self, js: Any, open_episodes: int = 0) -> Callable[[], Awaitable[bool]]:
        """Condition for :func:`wait_for`: alive, and :func:`consumer_settled`."""
        _, run_id, name, _ = self.args

        async def cond() -> bool:
            self.alive()
            return await consumer_settled(js, run_id, name, open_episodes)

        return cond

    async def crash_after(self, events: int) -> None:
        """Cancel the task once the fold has seen ``events`` events (a crash at an arbitrary
        await)."""

        async def seen() -> bool:
            self.alive()
            return self.replayer.fold.stats.events >= events

        await wait_for(seen, what=f"{events} events folded")
        await self.crash()

    async def crash(self) -> None:
        """Cancel the task now."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def __aexit__(self, *exc: object) -> None:
        if not self.task.done():
            self.stop.set()
            await self.task
        await self.nc.close()
