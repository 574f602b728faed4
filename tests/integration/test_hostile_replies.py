"""Reply-subject injection, on the session's real nats-server with the run's own credentials
(deploy's permissions.json and accounts.json; the attacker is ``actor-0``'s nkey user, or the
``log-import`` or ``weight-sync`` role's).

A NATS request names the subject its answer goes to, and the server publishes that answer without
checking the requester's publish permissions: an actor allowed ``$JS.API.STREAM.INFO.LEAFE_EVENTS``
once asked it with the reply subject ``leafe.<run>.dead.leafe_events.<next seq>`` and the stream
stored the answer, where the replayer's letter was then refused as "already stored", so a refused
event was acked and lost. The same went for redrive markers, weights, samples, another actor's
events and the task queue, and for every request an actor may send (a JetStream publish's PubAck
too).

Now actors, the log importer and weight sync live in NATS accounts of their own
(``deploy/base/nats/accounts.json``) that import only the JetStream subjects they use from the
account that holds the streams: a reply subject they name is one of their own account, where no
stream exists. And, behind that, a letter or a redrive marker counts as written only if it carries
its writer's header (``Leafe-Writer``), which no server answer does: an answer that a role of the
streams' account injects (the learner's credential, below) is stepped over, never taken for a
letter or a marker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from leafe.actors.fake_episodes import EventWriter
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.codec import decode_task, encode
from leafe.protocol.events import Step
from leafe.protocol.subjects import (
    DEAD_LETTERS,
    EVENTS,
    SAMPLES,
    TASKS,
    WEIGHTS,
    actors_durable,
    dead_letter_subject,
    event_subject,
    sample_subject,
    task_subject,
    weights_subject,
)
from leafe.services.admin.streams import durables_for_run
from leafe.services.bus import Consumer, NatsOptions, ensure_durables, read_stream
from leafe.services.bus.dead_letters import (
    ERROR_CODE_HEADER,
    ORIGINAL_SEQ_HEADER,
    REDRIVE_HEADER,
    letters_filter,
)
from leafe.services.replayer.redrive import redrive, redriven_subject
from tests.support.hostile import flood_starts, headers_of, publish_each, step_fields
from tests.support.nats_auth import RoleClient
from tests.support.replaying import Running, replayer_config, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

Target = Callable[[Any, str], Awaitable[str]]
WRITER_HEADER = "Leafe-Writer"
"""Who wrote a letter (services/bus/dead_letters.py): what no server answer carries."""


async def _next_letter(js: Any, run_id: str) -> str:
    """The subject of the replayer's letter for the next event stored."""
    seq = (await js.stream_info(EVENTS.name)).state.last_seq + 1
    return f"{dead_letter_subject(run_id, EVENTS.name)}.{seq}"


async def _next_marker(js: Any, run_id: str) -> str:
    """The subject of redrive's marker for the next dead letter stored."""
    return redriven_subject(run_id, (await js.stream_info(DEAD_LETTERS.name)).state.last_seq + 1)


def _fixed(subject: Callable[[str], str]) -> Target:
    async def target(js: Any, run_id: str) -> str:
        return subject(run_id)

    return target


TARGETS: dict[str, Target] = {
    "next dead letter": _next_letter,
    "redrive marker": _next_marker,
    "weights": _fixed(weights_subject),
    "samples": _fixed(lambda run_id: sample_subject(run_id, "cf")),
    "another actor's events": _fixed(lambda run_id: event_subject(run_id, "step", "actor-1")),
    "task queue": _fixed(task_subject),
}
"""Where an answer must never be stored: each subject of the issue, for the test's run."""


async def _count(js: Any, subject: str) -> int:
    """Messages stored on ``subject`` (in any LEAFE stream)."""
    stream = await js.find_stream_name_by_subject(subject)
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


def _own_step(run_id: str, actor_id: str, name: str) -> Any:
    w = EventWriter(run_id, f"{run_id}-{name}", actor_id=actor_id)
    return w.emit(Step, **step_fields("b0", 0))


async def _ask(client: RoleClient, role: str, run_id: str, reply: str, name: str) -> str | None:
    """Send every request ``role`` may send with ``reply`` as the reply subject; returns the subject
    of the one event it published (stored under its own identity, whoever gets the PubAck), if it
    may publish one."""
    nc = client.nc
    last = json.dumps({"last_by_subj": weights_subject(run_id)}).encode()
    own = None
    if role in ("actor", "log-import"):
        actor = "actor-0" if role == "actor" else "actor-7"
        event = _own_step(run_id, actor, name)
        own = event_subject(run_id, "step", actor)
        await nc.publish(own, encode(event), headers=headers_of(event), reply=reply)
    if role == "actor":
        durable = actors_durable(run_id)
        for subject, body in (
            (f"$JS.API.STREAM.INFO.{EVENTS.name}", b""),
            (f"$JS.API.STREAM.INFO.{DEAD_LETTERS.name}", b""),
            (f"$JS.API.STREAM.MSG.GET.{WEIGHTS.name}", last),
            (f"$JS.API.CONSUMER.INFO.{TASKS.name}.{durable}", b""),
            (f"$JS.API.CONSUMER.MSG.NEXT.{TASKS.name}.{durable}", b'{"batch":1,"no_wait":true}'),
        ):
            await nc.publish(subject, body, reply=reply)
    if role == "weight-sync":
        await nc.publish(f"$JS.API.STREAM.INFO.{WEIGHTS.name}", b"", reply=reply)
        await nc.publish(f"$JS.API.STREAM.MSG.GET.{WEIGHTS.name}", last, reply=reply)
    await nc.flush()
    return own


async def _settle(client: RoleClient, role: str) -> None:
    """Let the server answer what was asked: a round trip, then a pause for the JetStream API's
    queue."""
    if role != "log-import":  # it may ask the JetStream API nothing
        await client.js.stream_info(EVENTS.name if role == "actor" else WEIGHTS.name)
    await client.nc.flush()
    await asyncio.sleep(0.5)


@pytest.mark.parametrize("role", ["actor", "log-import", "weight-sync"])
@pytest.mark.parametrize("where", list(TARGETS))
async def test_no_answer_to_an_actors_request_is_stored_where_it_may_not_publish(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    role: str,
    where: str,
) -> None:
    """Every request the role may send (its events' PubAck; for an actor also stream and consumer
    info, the weights' last message, a pull; for weight sync the weights' stream info and last
    message), each with the reply subject ``where``: its own event is stored as before, and nothing
    new is stored on ``where``."""
    js = admin_client.js
    await ensure_durables(js, durables_for_run(run_id))
    target = await TARGETS[where](js, run_id)
    before = await _count(js, target)
    async with RoleClient(nats_roles[role]) as client:
        own = await _ask(client, role, run_id, target, "own")
        await _settle(client, role)
        assert client.violations == []
    stored = await _count(js, target) - before
    assert own is None or await _count(js, own) == 1, "the role's own event was not stored"
    assert stored == 0, f"{stored} answers to {role}'s requests stored on {target} ({where})"


async def _refused(js: Any, run_id: str, seqs: set[int] | None) -> list[Any]:
    """The run's event letters (each has a code) of the originals at ``seqs`` (None: all)."""
    subject = letters_filter(dead_letter_subject(run_id, EVENTS.name))
    return [
        m
        async for m in read_stream(js, stream=DEAD_LETTERS.name, filter_subject=subject)
        if ERROR_CODE_HEADER in (m.headers or {})
        and (seqs is None or int(m.headers[ORIGINAL_SEQ_HEADER]) in seqs)
    ]


async def _answers_on(js: Any, run_id: str) -> int:
    """Messages on the run's event-letter subjects that are no letter (no code): injected
    answers."""
    subject = letters_filter(dead_letter_subject(run_id, EVENTS.name))
    stored = [m async for m in read_stream(js, stream=DEAD_LETTERS.name, filter_subject=subject)]
    return sum(1 for m in stored if ERROR_CODE_HEADER not in (m.headers or {}))


async def _copies(js: Any, run_id: str) -> int:
    """Events that redrive published again (``Leafe-Redrive``)."""
    stored = [
        m async for m in read_stream(js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.>")
    ]
    return sum(1 for m in stored if REDRIVE_HEADER in (m.headers or {}))


async def _replay(
    nats_roles: dict[str, NatsOptions],
    js: Any,
    run_id: str,
    tokenizer: HFChatTokenizer,
    open_episodes: int,
) -> None:
    """Run the replayer under its own role (cap: 1 open episode per actor) until it settled."""
    config = replayer_config("leafe", max_open_per_actor=1)
    await ensure_durables(js, durables_for_run(run_id, replayer=config))
    async with Running(
        nats_roles["replayer"], run_id, "leafe", tokenizer, max_open_per_actor=1
    ) as r:
        await wait_for(r.settled(js, open_episodes), what="the refusals dead-lettered and acked")


async def test_600_injected_answers_neither_erase_nor_hide_27_refusals(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    tokenizer: HFChatTokenizer,
) -> None:
    """The issue's case: actor-0 reads where LEAFE_EVENTS stands and asks stream info 600 times,
    each answer to the letter subject of one of the next 600 events; then actor-1 starts 28
    episodes under a cap of one open episode per actor. All 27 refused starts are dead-lettered (on
    main their letter subjects held an answer: taken as stored, acked, lost), no answer is stored,
    and a redrive publishes the 27 again."""
    js = admin_client.js
    async with RoleClient(nats_roles["actor.actor-0"]) as attacker:
        first = (await attacker.js.stream_info(EVENTS.name)).state.last_seq + 1
        letters = dead_letter_subject(run_id, EVENTS.name)
        for seq in range(first, first + 600):
            await attacker.nc.publish(
                f"$JS.API.STREAM.INFO.{EVENTS.name}", b"", reply=f"{letters}.{seq}"
            )
        await _settle(attacker, "actor")
    flood = flood_starts(run_id, 28, actor_id="actor-1")
    async with RoleClient(nats_roles["actor.actor-1"]) as victim:
        seqs = await publish_each(victim.js, flood)
    assert max(seqs) < first + 600, "the answers must cover the refusals for the case to hold"
    await _replay(nats_roles, js, run_id, tokenizer, open_episodes=1)
    injected = await _answers_on(js, run_id)
    stored = len(await _refused(js, run_id, set(seqs[1:])))
    stats = await redrive(js, run_id)
    figures = {"injected": injected, "letters": stored, "lost": 27 - stored}
    figures["redriven"] = stats.published
    assert figures == {"injected": 0, "letters": 27, "lost": 0, "redriven": 27}, figures
    assert await _copies(js, run_id) == 27


async def test_an_injected_answer_on_a_marker_does_not_empty_a_redrive(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    tokenizer: HFChatTokenizer,
) -> None:
    """actor-0 starts 3 episodes under a cap of one (2 refused), then asks stream info with the
    marker subject of every letter of LEAFE_DEAD up to 10 past its end as the reply: the redrive
    still publishes both refused starts (on main it reported them "already published")."""
    js = admin_client.js
    async with RoleClient(nats_roles["actor.actor-0"]) as actor:
        await publish_each(actor.js, flood_starts(run_id, 3, actor_id="actor-0"))
    await _replay(nats_roles, js, run_id, tokenizer, open_episodes=1)
    letters = await _refused(js, run_id, None)
    assert len(letters) == 2
    async with RoleClient(nats_roles["actor.actor-0"]) as actor:
        end = (await actor.js.stream_info(DEAD_LETTERS.name)).state.last_seq
        for seq in range(min(m.metadata.sequence.stream for m in letters), end + 10):
            await actor.nc.publish(
                f"$JS.API.STREAM.INFO.{DEAD_LETTERS.name}", b"", reply=redriven_subject(run_id, seq)
            )
        await _settle(actor, "actor")
    stats = await redrive(js, run_id)
    assert (stats.published, stats.already) == (2, 0), stats
    assert await _copies(js, run_id) == 2


async def test_a_server_answer_on_a_letter_subject_is_never_taken_for_the_letter(
    nats_roles: dict[str, NatsOptions],
    admin_client: RoleClient,
    run_id: str,
    tokenizer: HFChatTokenizer,
) -> None:
    """Defence in depth, with a credential of the streams' own account: the learner (which may not
    publish letters) asks stream info with the letter subjects of the next 8 events as replies,
    and the server stores its answers there. actor-1's 3 starts under a cap of one are still both
    dead-lettered (stored after the answer), a redrive publishes both again, and answers on their
    marker subjects do not stop a second run's redrive either."""
    js = admin_client.js
    first = (await js.stream_info(EVENTS.name)).state.last_seq + 1
    letters = dead_letter_subject(run_id, EVENTS.name)
    async with RoleClient(nats_roles["learner"]) as learner:
        for seq in range(first, first + 8):
            await learner.nc.publish(
                f"$JS.API.STREAM.INFO.{SAMPLES.name}", b"", reply=f"{letters}.{seq}"
            )
        await learner.nc.flush()
    await wait_for(lambda: _answers(js, run_id, 8), limit_s=10, what="the learner's answers stored")
    async with RoleClient(nats_roles["actor.actor-1"]) as victim:
        seqs = await publish_each(victim.js, flood_starts(run_id, 3, actor_id="actor-1"))
    assert max(seqs) < first + 8
    await _replay(nats_roles, js, run_id, tokenizer, open_episodes=1)
    refused = await _refused(js, run_id, set(seqs[1:]))
    assert len(refused) == 2, "a refused start was acked without its letter"
    async with RoleClient(nats_roles["learner"]) as learner:
        for m in refused:
            await learner.nc.publish(
                f"$JS.API.STREAM.INFO.{SAMPLES.name}",
                b"",
                reply=redriven_subject(run_id, m.metadata.sequence.stream),
            )
        await learner.nc.flush()
    await asyncio.sleep(0.5)
    stats = await redrive(js, run_id)
    assert (stats.published, stats.already) == (2, 0), stats
    again = await redrive(js, run_id)
    assert (again.published, again.already) == (0, 2), again
    assert await _copies(js, run_id) == 2


async def _answers(js: Any, run_id: str, n: int) -> bool:
    return await _answers_on(js, run_id) >= n


async def test_a_foreign_message_on_an_actors_letter_subject_does_not_eat_its_letter(
    nats_roles: dict[str, NatsOptions], admin_client: RoleClient, run_id: str
) -> None:
    """The same for an actor's own task letters (read back through its account's import of a
    direct get pinned to its letter subjects): a message without ``Leafe-Writer`` on the subject of
    the next task's letter, then an undecodable task: actor-0 still stores its letter, after it."""
    js = admin_client.js
    await ensure_durables(js, durables_for_run(run_id))
    seq = (await js.stream_info(TASKS.name)).state.last_seq + 1
    letters = f"{dead_letter_subject(run_id, TASKS.name)}.actor-0"
    await js.publish(
        f"{letters}.{seq}", b'{"type":"io.nats.jetstream.api.v1.stream_info_response"}'
    )
    assert (await js.publish(task_subject(run_id), b"not a task")).seq == seq
    async with RoleClient(nats_roles["actor.actor-0"]) as actor:
        consumer = Consumer(
            actor.js,
            stream=TASKS.name,
            durable=actors_durable(run_id),
            filter_subject=task_subject(run_id),
            decode=decode_task,
            dead_letter_subject=letters,
            batch=1,
        )
        await consumer.start()
        assert await consumer.fetch(2.0) == []
        await consumer.close()
        assert actor.violations == []
    stored = [
        m
        async for m in read_stream(js, stream=DEAD_LETTERS.name, filter_subject=f"{letters}.{seq}")
    ]
    assert [(m.headers or {}).get(WRITER_HEADER) for m in stored] == [None, "actor"]
    assert stored[1].data == b"not a task" and stored[1].headers[ORIGINAL_SEQ_HEADER] == str(seq)
