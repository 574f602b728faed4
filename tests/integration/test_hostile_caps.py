"""The replayer's caps against hostile publishers on a real nats-server: token ids outside the
vocabulary, a flood of unfinished episodes under rotating actor ids that fills
``max_open_episodes``, and one credential's flood of large unfinished episodes, which holds only its
own share of the byte cap (``max_open_bytes_per_actor``), so the others' episodes are still folded.

The flood case is a lockout of valid episodes at test size: 60 never-finished episodes, each under
its own ``actor_id`` (the per-actor cap keys on a field the publisher writes, so rotating it evades
that cap), fill ``max_open_episodes`` = 40 ahead of valid episodes, which are then refused and
dead-lettered. Once the flood is closed as abandoned (``stale_timeout_s``), ``leafe replayer
redrive`` publishes the valid episodes' dead-lettered events again and the replayer folds them: its
samples end up equal to the offline rebuild, and a second redrive publishes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from leafe.actors.fake_episodes import EventWriter
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.events import EpisodeEvent, EpisodeFinished, EpisodeStarted, Outcome, Step
from leafe.services.replayer.replay import stream_event_count
from tests.support.hostile import flood_starts, publish_each, started_fields, step_fields
from tests.support.replaying import (
    Running,
    assert_samples_match_offline,
    dead_letters,
    dead_reasons,
    make_log,
    publish,
    published_samples,
    unfinished,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def one_step_episode(run_id: str, name: str, token_ids: list[int]) -> list[EpisodeEvent]:
    """A finished, successful one-step explore episode whose Step carries ``token_ids``."""
    w = EventWriter(run_id, f"{run_id}-{name}", actor_id="mallory")
    w.emit(EpisodeStarted, **started_fields(w.episode_id))
    w.emit(Step, **step_fields("b0", 0, token_ids=token_ids, success=True, done=True))
    w.emit(Outcome, branch_id="b0", success=True, score=1.0, steps=1, reason="success")
    w.emit(EpisodeFinished, success=True, branches=1, actions=1, reflections=0)
    return w.events


async def test_steps_with_token_ids_outside_the_vocabulary_are_dead_lettered_not_sampled(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """Steps with ids -1, 2^40 and 49,152 (the vocabulary size): each is dead-lettered naming the
    id, no stored sample holds an id the model cannot embed, and the valid samples equal the offline
    rebuild."""
    vocab = len(tokenizer.tokenizer)  # what HFChatTokenizer.vocab_size says
    valid = make_log(run_id, tokenizer, episodes=3, groups=0)
    bad_ids = {"neg": -1, "huge": 2**40, "edge": vocab}
    hostile = {k: one_step_episode(run_id, k, [27, bad, 29]) for k, bad in bad_ids.items()}
    await publish(js, valid)
    seqs = {k: (await publish_each(js, events))[1] for k, events in hostile.items()}
    async with Running(
        nats_url, run_id, "leafe", tokenizer, options={"rehearsal_fraction": 1.0}
    ) as r:
        await wait_for(r.settled(js, unfinished(valid)), what="all events acked")
    reasons = await dead_reasons(js, run_id)
    for k, bad in bad_ids.items():
        assert f"token id {bad} is outside the vocabulary (0..{vocab - 1})" in reasons[seqs[k]]
    samples = await published_samples(js, run_id)
    assert samples and all(
        0 <= i < vocab for s in samples for i in (*s.prompt_ids, *s.completion_ids)
    )
    assert not {s.episode_id for s in samples} & {
        events[0].episode_id for events in hostile.values()
    }
    await assert_samples_match_offline(js, run_id, tokenizer)


async def test_valid_episodes_locked_out_by_a_flood_are_folded_after_a_redrive(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """The lockout (see the module docstring), then `leafe replayer redrive` once the flood is
    stale."""
    from leafe.services.replayer import main as replayer

    flood = [e for i in range(60) for e in flood_starts(run_id, 1, actor_id=f"flood{i}")]
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    await publish(js, flood + valid)
    caps = dict(max_ack_pending=64, max_open_episodes=40, max_open_per_actor=8, stale_timeout_s=6.0)
    async with Running(nats_url, run_id, "leafe", tokenizer, **caps) as r:
        await wait_for(r.settled(js, 0), limit_s=120, what="the flood closed as stale")
        reasons = await dead_reasons(js, run_id)
        locked = {e.episode_id for e in valid if isinstance(e, EpisodeStarted)}
        assert len(reasons) == 20 + len(
            valid
        )  # 20 flood starts past the cap, then every valid event
        assert all("max_open_episodes = 40" in why for why in reasons.values())
        assert not {s.episode_id for s in await published_samples(js, run_id)} & locked

        argv = ["redrive", "--nats", nats_url, "--run", run_id]
        assert await asyncio.to_thread(replayer.main, argv) == 0
        await wait_for(r.settled(js, 0), limit_s=120, what="the redriven episodes folded")
        assert r.replayer.stats.redriven == 20 + len(
            locked
        )  # the flood's refused starts come back too
    await assert_samples_match_offline(js, run_id, tokenizer)
    assert {s.episode_id for s in await published_samples(js, run_id)} & locked

    before = await stream_event_count(js, run_id)
    assert await asyncio.to_thread(replayer.main, argv) == 0
    assert await stream_event_count(js, run_id) == before, "a second redrive published again"


async def test_one_actor_fills_only_its_own_share_of_the_byte_cap(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """One credential (subject token `mallory`) starts 24 episodes of 600 KB that never finish,
    ahead of valid episodes of `actor-0`, under an 8 MiB run cap: it holds at most its 2 MiB
    (``max_open_bytes_per_actor``), the rest of its flood is dead-lettered with that code, and every
    valid episode is folded (samples equal to the offline rebuild). One run-wide counter once let
    such a flood lock every other actor out."""
    flood = [
        w.emit(EpisodeStarted, **started_fields(w.episode_id, observation="x" * 600_000))
        for w in (EventWriter(run_id, f"{run_id}-big{i}", actor_id="mallory") for i in range(24))
    ]
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    await publish_each(js, flood)
    await publish(js, valid)
    caps = dict(max_open_bytes=8 * 2**20, max_open_bytes_per_actor=2 * 2**20)
    async with Running(nats_url, run_id, "leafe", tokenizer, **caps) as r:
        await wait_for(r.settled(js, 3 + unfinished(valid)), limit_s=120, what="the flood refused")
        assert r.replayer.fold.open_episodes == 3 + unfinished(valid)
    letters = await dead_letters(js, run_id)
    assert len(letters) == 21 and {m.headers["Leafe-Error-Code"] for m in letters} == {
        "max_open_bytes_per_actor"
    }
    await assert_samples_match_offline(js, run_id, tokenizer)
