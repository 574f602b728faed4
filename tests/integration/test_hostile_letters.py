"""What the replayer refuses stays refused and visible, whatever an actor's credential publishes
first, on the session's real nats-server (deploy's permissions.json; the attacker is `actor-0`'s own
nkey user).

- A dead letter cannot be erased before it is written: it lives on a subject of its own
  (``leafe.<run>.dead.leafe_events.<seq>``) that only the replayer may publish, and is stored only
  if that subject is empty (``Nats-Expected-Last-Subject-Sequence: 0``). It used to carry the
  predictable ``Nats-Msg-Id`` ``dead.LEAFE_EVENTS.<seq>``: an actor storing that id first (on its
  own task dead-letter subject) made the real letter a "duplicate", taken as stored, and the refused
  event vanished.
- A redrive cannot be emptied: its copies' ids carry a random part, and what it already did is
  marked on subjects only the admin writes. Its ids used to be ``<run>.redrive.<letter seq>``, which
  an actor could publish first on its own events subject.
- Redrive chooses letters by their code (``Leafe-Error-Code``), never by the reason's text, which
  can quote the input: a Step on branch ``(max_open_pwn`` used to be republished as if refused for a
  cap.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from leafe.actors.fake_episodes import EventWriter
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.codec import MSG_ID_HEADER, encode
from leafe.protocol.events import EpisodeStarted, Step
from leafe.protocol.subjects import DEAD_LETTERS, EVENTS, TASKS, dead_letter_subject, event_subject
from leafe.services.bus import NatsOptions, read_stream
from leafe.services.bus.dead_letters import (
    ERROR_CODE_HEADER,
    ORIGINAL_SEQ_HEADER,
    ORIGINAL_SHA256_HEADER,
)
from leafe.services.replayer.redrive import redrive
from tests.support.hostile import flood_starts, publish_each, started_fields, step_fields
from tests.support.nats_auth import RoleClient
from tests.support.replaying import Running, dead_letters, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def _forge_letter_ids(actor: RoleClient, run_id: str, seqs: range) -> None:
    """As the actor: store ``dead.LEAFE_EVENTS.<seq>`` (the old letters' ids) on every dead-letter
    subject its user could ever write, for ``seqs``; refusals are expected (a refused publish is
    never answered)."""
    js = actor.nc.jetstream(timeout=0.2)
    tasks = dead_letter_subject(run_id, TASKS.name)
    for seq in seqs:
        for subject in (tasks, f"{tasks}.actor-0", f"{tasks}.actor-0.{seq}"):
            try:
                await js.publish(
                    subject, b"forged", headers={MSG_ID_HEADER: f"dead.{EVENTS.name}.{seq}"}
                )
            except NatsTimeoutError:
                continue


async def test_an_actor_cannot_erase_a_dead_letter_before_it_is_written(
    js: Any,
    nats_url: str,
    nats_roles: dict[str, NatsOptions],
    run_id: str,
    tokenizer: HFChatTokenizer,
) -> None:
    """actor-0 reads where LEAFE_EVENTS stands, forges the ids of the next 8 letters, then publishes
    a Step of an episode that never started: the replayer still dead-letters it, on its seq's
    subject, with the event's own bytes and sha256, and the Step is in the run's letters."""
    w = EventWriter(run_id, f"{run_id}-nowhere", actor_id="actor-0")
    stray = w.emit(Step, **step_fields("b0", 0))
    async with RoleClient(nats_roles["actor"]) as actor:
        next_seq = (await actor.js.stream_info(EVENTS.name)).state.last_seq + 1
        await _forge_letter_ids(actor, run_id, range(next_seq, next_seq + 8))
        [seq] = await publish_each(actor.js, [stray])
    assert seq < next_seq + 8, (
        "the forged ids must cover the stray's seq for the attack to mean anything"
    )
    async with Running(nats_url, run_id, "leafe", tokenizer) as r:
        await wait_for(r.settled(js), what="the stray dead-lettered and acked")
    [letter] = [
        m for m in await dead_letters(js, run_id) if m.headers[ORIGINAL_SEQ_HEADER] == str(seq)
    ]
    assert letter.subject == f"{dead_letter_subject(run_id, EVENTS.name)}.{seq}"
    assert letter.data == encode(stray)
    assert letter.headers[ORIGINAL_SHA256_HEADER] == hashlib.sha256(encode(stray)).hexdigest()
    assert letter.headers[ERROR_CODE_HEADER] == "rejected"


async def _events_with_redrive(js: Any, run_id: str) -> list[Any]:
    return [
        m
        async for m in read_stream(
            js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.events.>"
        )
        if "Leafe-Redrive" in (m.headers or {})
    ]


async def test_an_actor_cannot_empty_a_redrive_and_reasons_choose_nothing(
    js: Any,
    nats_url: str,
    nats_roles: dict[str, NatsOptions],
    run_id: str,
    tokenizer: HFChatTokenizer,
) -> None:
    """actor-0 floods 3 unfinished episodes past its cap of 1 (2 refused, code max_open_per_actor),
    and actor-1's episode gets a Step on branch ``(max_open_pwn`` (refused naming the branch, code
    rejected). Then actor-0, knowing the letters' seqs, publishes events with the old redrive ids
    first. Redrive still publishes both refused starts again (never the Step), and a second redrive
    publishes nothing."""
    flood = flood_starts(run_id, 3, actor_id="actor-0")
    w = EventWriter(run_id, f"{run_id}-pwn", actor_id="actor-1")
    pwn = [
        w.emit(EpisodeStarted, **started_fields(w.episode_id)),
        w.emit(Step, **step_fields("(max_open_pwn", 0)),
    ]
    await publish_each(js, flood + pwn)
    async with Running(nats_url, run_id, "leafe", tokenizer, max_open_per_actor=1) as r:
        await wait_for(r.settled(js, 2), what="the flood refused past the cap")
    letters = await dead_letters(js, run_id)
    codes = sorted(m.headers[ERROR_CODE_HEADER] for m in letters)
    assert codes == ["max_open_per_actor", "max_open_per_actor", "rejected"], codes
    assert any("(max_open_pwn" in m.headers["Leafe-Error"] for m in letters)
    async with RoleClient(nats_roles["actor"]) as actor:
        subject = event_subject(run_id, "step", "actor-0")
        for m in letters:
            await actor.js.publish(
                subject,
                b"x",
                headers={MSG_ID_HEADER: f"{run_id}.redrive.{m.metadata.sequence.stream}"},
            )
    first = await redrive(js, run_id)
    assert (first.selected, first.published, first.already) == (2, 2, 0), first
    copies = await _events_with_redrive(js, run_id)
    assert sorted(m.data for m in copies) == sorted(encode(e) for e in flood[1:])
    second = await redrive(js, run_id)
    assert (second.published, second.already) == (0, 2), second
    assert len(await _events_with_redrive(js, run_id)) == 2
    marks = [
        m
        async for m in read_stream(
            js, stream=DEAD_LETTERS.name, filter_subject=f"leafe.{run_id}.dead.redriven.>"
        )
    ]
    assert len(marks) == 2
