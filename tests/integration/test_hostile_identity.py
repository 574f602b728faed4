"""The replayer's per-actor cap keys on the publisher's NATS identity (the event subject's actor
token), not on the payload's ``actor_id``: one credential flooding under forged ids fills nothing
but its own cap.

The session server pins each actor's credentials to its token
(``tests/integration/test_nats_auth.py``); here the flood is published as that actor would (its own
token, payloads naming other actors), among valid episodes of another actor, and the replayer's
verdicts are checked against the offline rebuild.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.codec import encode
from tests.support.hostile import flood_starts, headers_of, publish_raw
from tests.support.replaying import (
    Running,
    assert_samples_match_offline,
    dead_reasons,
    make_log,
    publish,
    unfinished,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def test_a_flood_under_forged_actor_ids_fills_only_its_publishers_cap(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """One publisher (subject token ``mallory``, which NATS pins its credentials to) floods 300
    never-finished episodes, each naming another actor in its payload (``forged-<i>``, or the valid
    actor's own id), then 300 more as itself: the forged ones are dead-lettered as published on
    mallory's subject, its own stop at its cap of 8, and the valid actor's episodes after the flood
    are all admitted and give the offline rebuild's samples (the 40-episode run cap never fills).
    Before actor tokens, the per-actor cap keyed on the payload: 40 forged ids filled
    max_open_episodes and locked every later valid episode out."""
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    victim = valid[0].actor_id
    flood = flood_starts(run_id, 300, actor_id="mallory")
    forged = [
        msgspec.structs.replace(e, actor_id=victim if i % 10 == 0 else f"forged-{i}")
        for i, e in enumerate(flood)
    ]
    own = flood_starts(run_id, 300, actor_id="mallory", name="mallory-2")
    subject = f"leafe.{run_id}.events.episode_started.mallory"
    forged_seqs = {await publish_raw(js, subject, encode(e), headers_of(e)) for e in forged}
    own_seqs = [await publish_raw(js, subject, encode(e), headers_of(e)) for e in own]
    await publish(js, valid)
    async with Running(
        nats_url,
        run_id,
        "leafe",
        tokenizer,
        max_ack_pending=64,
        max_open_episodes=40,
        max_open_per_actor=8,
    ) as r:
        await wait_for(r.settled(js, 8 + unfinished(valid)), limit_s=180, what="all events acked")
        assert r.replayer.fold.held_episodes == 8 + unfinished(valid)
    reasons = await dead_reasons(js, run_id)
    assert reasons.keys() == forged_seqs | set(own_seqs[8:])
    for seq in forged_seqs:
        assert "published on actor 'mallory'" in reasons[seq], reasons[seq]
    assert all("actor 'mallory' already holds 8" in reasons[seq] for seq in own_seqs[8:])
    await assert_samples_match_offline(js, run_id, tokenizer)
