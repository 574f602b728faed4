"""Hostile input against the online replayer on a real nats-server: no crash, no stall, nothing
lost.

Each case publishes what an authenticated publisher could (messages that bypass the ``Publisher``
included) among valid episodes, runs the replayer, and asserts: it is still running; every hostile
message is in the dead letters with its reason; the valid episodes' samples equal the offline
rebuild (``leafe.learner.materializers.fold_events`` over the same log, as ``leafe replay`` reads
it). Cases that need a restart crash the replayer at a chosen point and check that recovery decides
the same way. The 20k-episode flood and the 8 MiB samples are ``slow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.errors import BadRequestError

from leafe.actors.fake_episodes import EventWriter, fake_episode_id
from leafe.learner.dataset import iter_samples
from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir
from leafe.protocol.codec import CODEC_HEADER, MSG_ID_HEADER, encode
from leafe.protocol.config import ConfigError
from leafe.protocol.events import EpisodeStarted, Step
from leafe.protocol.subjects import EVENTS, MAX_PAYLOAD, event_subject
from leafe.services.bus import ERROR_HEADER, Publisher, ensure_streams
from leafe.services.bus.dead_letters import (
    ORIGINAL_BYTES_HEADER,
    ORIGINAL_SEQ_HEADER,
    ORIGINAL_SHA256_HEADER,
    SAMPLE_ID_HEADER,
)
from leafe.services.bus.nats_server import free_port
from leafe.services.bus.publisher import MessageTooLargeError
from leafe.services.config import load_config
from leafe.services.replayer.service import Replayer, ReplayerConfig
from tests.support.hostile import (
    PoisonTokenizer,
    branch_chain,
    child_pids,
    flood_starts,
    headers_of,
    is_running,
    pad_to,
    publish_each,
    publish_raw,
    started_fields,
    step_fields,
    wire_size,
)
from tests.support.replaying import (
    Running,
    assert_samples_match_offline,
    by_id,
    dead_letters,
    dead_reasons,
    dead_samples,
    make_log,
    offline_samples,
    publish,
    published_samples,
    unfinished,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


async def test_a_chain_of_1200_branches_is_folded_online_in_recovery_and_by_leafe_replay(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer, cache_dir: Path, tmp_path: Path
) -> None:
    """1,200 Branch events each the child of the previous one: the replayer folds them, a restart
    re-folds them in recovery, `leafe replay` rebuilds the same samples; the deepest branch's
    counterfactual is among them (nothing recursed on the chain's depth)."""
    valid = make_log(run_id, tokenizer, episodes=6, groups=0)
    chain = branch_chain(run_id, f"{run_id}-chain", depth=1200)
    half = len(valid) // 2
    await publish(js, valid[:half] + chain[:-1])
    async with Running(nats_url, run_id, "leafe", tokenizer) as r1:
        await wait_for(
            r1.settled(js, unfinished(valid[:half] + chain[:-1])), what="first half settled"
        )
        await r1.crash()
    await publish(js, chain[-1:] + valid[half:])
    async with Running(nats_url, run_id, "leafe", tokenizer) as r2:
        await wait_for(r2.settled(js, unfinished(valid)), what="all events acked")
        assert r2.replayer.stats.recovered_events > len(chain) // 2
    assert await dead_reasons(js, run_id) == {}
    await assert_samples_match_offline(js, run_id, tokenizer)
    deep = [s for s in await published_samples(js, run_id) if s.episode_id == chain[0].episode_id]
    assert [s.kind for s in deep if s.kind == "cf"] == ["cf"]

    from leafe.services.replayer import replay

    argv = [
        "--from",
        nats_url,
        "--run",
        run_id,
        "--model",
        str(tiny_model_dir(cache_dir)),
        "--no-progress",
    ]
    cfg = tmp_path / "replay.toml"
    cfg.write_text('materializer = "leafe"\n[options]\nrehearsal_fraction = 0.5\n')
    out = tmp_path / "dataset"
    assert (
        await asyncio.to_thread(replay.main, [*argv, "--out", str(out), "--config", str(cfg)]) == 0
    )
    assert {s.sample_id for s in iter_samples(out)} == set(
        await offline_samples(js, run_id, "leafe", tokenizer)
    )


@contextlib.asynccontextmanager
async def events_limit_lifted(js: Any) -> AsyncIterator[None]:
    """LEAFE_EVENTS without its server-side 1 MiB limit (as a stream made before it was set), so
    that the replayer's own limits, the second line, can be tested; `ensure_streams` puts the limit
    back."""
    info = await js.stream_info(EVENTS.name)
    await js.update_stream(info.config.evolve(max_msg_size=-1))
    try:
        yield
    finally:
        await ensure_streams(js)


async def test_messages_at_the_servers_max_payload_are_dead_lettered_truncated_with_their_digest(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """Undecodable bytes and a decodable Step, each exactly max_payload on the wire (stored on a
    stream without the events limit): their dead letters would not fit, so they carry a truncated
    body, the original's seq, size and sha256; the replayer keeps its connection and every valid
    sample flows."""
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    await publish(js, valid[:5])
    junk_headers = {MSG_ID_HEADER: f"{run_id}-junk", CODEC_HEADER: "1"}
    junk = b"\xc1" * (MAX_PAYLOAD - wire_size(b"", junk_headers))
    ghost = Step(
        **step_fields("b0", 0),
        event_id=f"{run_id}-ghost.000001",
        run_id=run_id,
        episode_id=f"{run_id}-ghost",
        actor_id="mallory",
        seq=1,
    )
    big_step = pad_to(ghost, "raw_text", total=MAX_PAYLOAD, headers=headers_of(ghost))
    subject = event_subject(run_id, "step", "mallory")
    with pytest.raises(BadRequestError, match="message size exceeds maximum allowed"):
        await publish_raw(js, subject, junk, junk_headers)  # the server's own limit
    async with events_limit_lifted(js):
        originals = {
            await publish_raw(js, subject, junk, junk_headers): junk,
            await publish_raw(js, subject, big_step, headers_of(ghost)): big_step,
        }
    await publish(js, valid[5:])
    async with Running(nats_url, run_id, "leafe", tokenizer) as r:
        await wait_for(r.settled(js, unfinished(valid)), what="all events acked")
    dead = {int(m.headers[ORIGINAL_SEQ_HEADER]): m for m in await dead_letters(js, run_id)}
    assert dead.keys() == originals.keys()
    for seq, data in originals.items():
        m = dead[seq]
        assert m.headers[ORIGINAL_SHA256_HEADER] == hashlib.sha256(data).hexdigest()
        assert int(m.headers[ORIGINAL_BYTES_HEADER]) == len(data)
        assert data.startswith(m.data) and len(m.data) < len(data)
        assert wire_size(m.data, dict(m.headers)) <= MAX_PAYLOAD
    assert "bytes" in dead[min(dead)].headers[ERROR_HEADER]
    await assert_samples_match_offline(js, run_id, tokenizer)


class CrashBeforeDeadLetter(Replayer):
    """Dies between rejecting an event and dead-lettering it (the point where a crash used to lose
    it)."""

    async def _dead_letter(self, d: Any, reason: str, code: str) -> None:
        raise RuntimeError("crashed before the dead letter was stored")


async def test_a_rejected_event_whose_dead_letter_was_not_stored_is_dead_lettered_after_a_restart(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """Recovery never acks what it has not dead-lettered: a Step of an unknown episode rejected just
    before a crash is dead-lettered by the next process, once."""
    valid = make_log(run_id, tokenizer, episodes=3, groups=0)
    nowhere = fake_episode_id(f"{run_id}-stray", "mallory")  # an id of its own, never started
    stray = Step(
        **step_fields("b0", 0),
        event_id=f"{nowhere}.000001",
        run_id=run_id,
        episode_id=nowhere,
        actor_id="mallory",
        seq=1,
    )
    await publish(js, valid[:4])
    (seq,) = await publish_each(js, [stray])
    await publish(js, valid[4:])
    async with Running(
        nats_url, run_id, "leafe", tokenizer, replayer_cls=CrashBeforeDeadLetter
    ) as r1:
        with pytest.raises(RuntimeError, match="crashed before the dead letter"):
            await wait_for(r1.settled(js, unfinished(valid)), what="the crash")
    async with Running(nats_url, run_id, "leafe", tokenizer) as r2:
        await wait_for(r2.settled(js, unfinished(valid)), what="all events acked")
    assert (await dead_reasons(js, run_id)).keys() == {seq}
    await assert_samples_match_offline(js, run_id, tokenizer)


async def test_an_episode_too_large_to_publish_is_refused_and_later_episodes_flow(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """An EpisodeStarted with a 5.6 MB observation (its samples would exceed 8 MiB) is refused by
    the server; on a stream without that limit the replayer refuses it as over the event limit, the
    rest of its episode with it; valid episodes published after it get samples."""
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    huge = branch_chain(
        run_id, f"{run_id}-huge", depth=1, tau=0, observation="lorem ipsum " * 470_000
    )
    await publish(js, valid[:5])
    with pytest.raises(BadRequestError, match="message size exceeds maximum allowed"):
        await publish_each(js, huge[:1])
    async with events_limit_lifted(js):
        seqs = await publish_each(js, huge)
    await publish(js, valid[5:])
    async with Running(nats_url, run_id, "leafe", tokenizer) as r:
        await wait_for(r.settled(js, unfinished(valid)), what="all events acked")
    reasons = await dead_reasons(js, run_id)
    assert reasons.keys() == set(seqs)
    assert "over the limit" in reasons[seqs[0]]
    await assert_samples_match_offline(js, run_id, tokenizer)


async def test_a_sample_over_the_limit_is_dead_lettered_not_a_crash_loop(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """A valid episode whose samples exceed the samples limit: each is dead-lettered once (sha256,
    sample id), every other sample flows, and a restart that re-folds the episode does not crash on
    it."""
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    wide = branch_chain(
        run_id, f"{run_id}-wide", depth=1, tau=0, observation="lorem ipsum " * 12_000
    )
    await publish(js, valid[:5] + wide + valid[5:])
    limits = dict(max_sample_bytes=96_000)
    async with Running(nats_url, run_id, "leafe", tokenizer, **limits) as r1:
        await wait_for(r1.settled(js, unfinished(valid)), what="all events acked")
    async with Running(nats_url, run_id, "leafe", tokenizer, **limits) as r2:
        await asyncio.sleep(1.0)
        r2.alive()
    dead = await dead_samples(js, run_id)
    offline = await offline_samples(js, run_id, "leafe", tokenizer)
    assert dead and all("bytes" in m.headers[ERROR_HEADER] for m in dead)
    for m in dead:
        sample = offline[m.headers[SAMPLE_ID_HEADER]]
        assert sample.episode_id == wide[0].episode_id
        assert m.headers[ORIGINAL_SHA256_HEADER] == hashlib.sha256(encode(sample)).hexdigest()
    ids = {m.headers[SAMPLE_ID_HEADER] for m in dead}
    assert len(ids) == len(dead), "a sample dead-lettered twice"
    await assert_samples_match_offline(js, run_id, tokenizer, minus=frozenset(ids))


@pytest.mark.slow
async def test_a_5_6_mb_observation_admitted_by_a_raised_event_limit_gives_dead_lettered_samples(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """With the event limit raised to the server's (the stream's and the replayer's), the 5.6 MB
    episode is folded; its samples (over 8 MiB) are dead-lettered, the replayer goes on, later
    episodes get theirs."""
    valid = make_log(run_id, tokenizer, episodes=3, groups=0)
    huge = branch_chain(
        run_id, f"{run_id}-huge", depth=1, tau=0, observation="lorem ipsum " * 470_000
    )
    await publish(js, valid[:4])
    async with events_limit_lifted(js):
        await publish_each(js, huge)
    await publish(js, valid[4:])
    async with Running(
        nats_url, run_id, "leafe", tokenizer, max_event_bytes=MAX_PAYLOAD - 65_536
    ) as r:
        await wait_for(r.settled(js, unfinished(valid)), limit_s=180, what="all events acked")
    dead = await dead_samples(js, run_id)
    assert dead and all(int(m.headers[ORIGINAL_BYTES_HEADER]) > MAX_PAYLOAD for m in dead)
    assert all(wire_size(m.data, dict(m.headers)) <= MAX_PAYLOAD for m in dead)
    online = by_id(await published_samples(js, run_id))
    assert online and all(s.episode_id != huge[0].episode_id for s in online.values())


async def _flood_case(
    js: Any, nats_url: str, run_id: str, tok: Any, n: int, per_actor: int, **config: Any
) -> None:
    valid = make_log(run_id, tok, episodes=4, groups=0)
    bad = flood_starts(run_id, n, actor_id="flood")
    silent = flood_starts(run_id, n, actor_id="evals", mode="eval")
    await publish(js, bad + silent)
    await publish(js, valid)
    async with Running(nats_url, run_id, "leafe", tok, **config) as r:
        await wait_for(
            r.settled(js, per_actor + unfinished(valid)), limit_s=180, what="all events acked"
        )
        assert r.replayer.fold.open_episodes == per_actor + unfinished(valid)
    reasons = await dead_reasons(js, run_id)
    assert len(reasons) == n - per_actor
    assert all("max_open_per_actor" in why and "'flood'" in why for why in reasons.values())
    await assert_samples_match_offline(js, run_id, tok)


async def test_a_flood_of_unfinished_episodes_neither_holds_the_consumer_nor_stalls_valid_ones(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """300 EpisodeStarted of one actor that never finish, and 300 eval ones (which give no samples),
    ahead of valid episodes, with max_ack_pending 64: the actor's episodes past its cap are
    dead-lettered with the reason, eval episodes hold nothing, valid episodes get their samples at
    once."""
    caps = dict(max_ack_pending=64, max_open_episodes=40, max_open_per_actor=8)
    await _flood_case(js, nats_url, run_id, tokenizer, 300, 8, **caps)


@pytest.mark.slow
async def test_a_flood_of_20100_unfinished_episodes_with_the_default_limits(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """The flood of unfinished episodes at full size (20,100 explore and 20,100 eval starts) with
    the default limits."""
    await _flood_case(
        js, nats_url, run_id, tokenizer, 20_100, ReplayerConfig().max_open_per_actor, batch=256
    )


def test_open_episode_caps_that_could_fill_max_ack_pending_are_refused_up_front() -> None:
    """A replayer config whose held anchors plus a batch could exceed max_ack_pending (the stall of
    a flood) is an error naming the fields, before anything starts."""
    with pytest.raises(
        ConfigError, match=r"max_open_episodes \(990\) \+ batch \(256\) exceeds max_ack_pending"
    ):
        load_config(ReplayerConfig, overrides={"max_ack_pending": 1000, "max_open_episodes": 990})
    assert load_config(
        ReplayerConfig, overrides={"max_ack_pending": 1246, "max_open_episodes": 990}
    )


async def test_conflicts_forged_ids_wrong_subjects_and_missing_codec_headers_are_dead_lettered(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """Each of these is dead-lettered with its reason and changes no valid sample: a second,
    different copy of an applied event id; an event id that is not ``<episode>.<seq>``; a Step on
    the outcome subject; a message without ``Leafe-Codec``; an event of another run; an event of
    actor ``mallory`` on another actor's subject token."""
    valid = make_log(run_id, tokenizer, episodes=4, groups=0)
    at = next(i for i, e in enumerate(valid) if isinstance(e, Step) and e.t == 1)
    step = valid[at]
    copy = msgspec.structs.replace(step, raw_text="<action>left</action>", token_ids=[9, 9])
    w = EventWriter(run_id, f"{run_id}-side", actor_id="mallory")
    side = [
        w.emit(EpisodeStarted, **started_fields(w.episode_id)),
        w.emit(Step, **step_fields("b0", 0)),
    ]
    later = w.emit(Step, **step_fields("b0", 1))
    forged = msgspec.structs.replace(later, event_id=f"{run_id}-forged")
    other_run = msgspec.structs.replace(later, run_id=f"{run_id}x")
    step_subject = event_subject(run_id, "step", "mallory")
    own = event_subject(run_id, "step", copy.actor_id)
    cases = {
        "conflict": (own, encode(copy), headers_of(copy, **{MSG_ID_HEADER: f"{run_id}-x1"})),
        "event id": (step_subject, encode(forged), headers_of(forged)),
        "subject": (event_subject(run_id, "outcome", "mallory"), encode(later), headers_of(later)),
        "Leafe-Codec": (step_subject, encode(later), {MSG_ID_HEADER: f"{run_id}-x2"}),
        "run": (
            step_subject,
            encode(other_run),
            headers_of(other_run, **{MSG_ID_HEADER: f"{run_id}-x3"}),
        ),
        "actor": (own, encode(later), headers_of(later, **{MSG_ID_HEADER: f"{run_id}-x4"})),
    }
    await publish(js, valid[: at + 1])
    seqs = {"conflict": await publish_raw(js, *cases.pop("conflict"))}  # while its episode is open
    await publish(js, valid[at + 1 :])
    await publish_each(js, side)
    seqs |= {what: await publish_raw(js, *msg) for what, msg in cases.items()}
    async with Running(nats_url, run_id, "leafe", tokenizer) as r:
        await wait_for(r.settled(js, unfinished(valid) + 1), what="all events acked")
    reasons = await dead_reasons(js, run_id)
    assert reasons.keys() == set(seqs.values())
    for what, seq in seqs.items():
        assert what in reasons[seq], (what, reasons[seq])
    await assert_samples_match_offline(js, run_id, tokenizer)


async def test_an_exception_while_folding_an_episode_dead_letters_it_online_and_in_recovery(
    js: Any, nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """Any exception while folding one episode (here its prompt makes the tokenizer raise)
    dead-letters that episode's anchor, the event that raised and every later event, with the
    reason; recovery meets the same exception and decides the same; other episodes are untouched."""
    poison_tok = PoisonTokenizer(tokenizer)
    valid = make_log(run_id, tokenizer, episodes=6, groups=0)
    bad = branch_chain(run_id, f"{run_id}-poison", depth=1, tau=0, observation="POISON")
    half = len(valid) // 2
    await publish(js, valid[:half])
    seqs = await publish_each(js, bad[:-1])
    async with Running(nats_url, run_id, "leafe", poison_tok) as r1:
        await wait_for(r1.settled(js, unfinished(valid[:half])), what="first half settled")
        await r1.crash()
    seqs += await publish_each(js, bad[-1:])
    await publish(js, valid[half:])
    async with Running(nats_url, run_id, "leafe", poison_tok) as r2:
        await wait_for(r2.settled(js, unfinished(valid)), what="all events acked")
        assert r2.replayer.stats.recovered_events > 0
    reasons = await dead_reasons(js, run_id)
    outcome, finished = seqs[-2], seqs[-1]
    assert reasons.keys() == {seqs[0], outcome, finished}
    assert all("choked on POISON" in reasons[s] for s in (seqs[0], outcome, finished))
    online = by_id(await published_samples(js, run_id))
    assert online == await offline_samples(js, run_id, "leafe", poison_tok)


async def test_the_publisher_refuses_an_event_over_the_limit_with_a_clear_error(
    js: Any, run_id: str
) -> None:
    """An event over the events stream's limit is refused before it is sent, naming its id, size and
    the limit; the connection stays usable and nothing was stored."""
    w = EventWriter(run_id, f"{run_id}-big")
    big = w.emit(EpisodeStarted, **started_fields(w.episode_id, observation="x" * 2_000_000))
    small = w.emit(Step, **step_fields("b0", 0))
    async with Publisher(js) as pub:
        with pytest.raises(MessageTooLargeError, match=rf"{big.event_id}.*2,000,\d+ bytes.*limit"):
            await pub.publish_event(big)
        await pub.publish_event(small)
    info = await js.stream_info("LEAFE_EVENTS", subjects_filter=f"leafe.{run_id}.events.>")
    assert sum((info.state.subjects or {}).values()) == 1


def test_leafe_nats_stops_its_server_on_sigterm(tmp_path: Path) -> None:
    """`leafe nats` stops its nats-server child on SIGTERM, as on Ctrl-C, and exits 0."""
    cmd = [
        sys.executable,
        "-m",
        "leafe.services.cli",
        "nats",
        "--store",
        str(tmp_path),
        "--port",
        str(free_port()),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )
    children: list[int] = []
    try:
        assert proc.stdout is not None and "nats-server with JetStream" in proc.stdout.readline()
        children = child_pids(proc.pid)
        assert len(children) == 1 and is_running(children[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while is_running(children[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(children[0]), (
            "nats-server still running after `leafe nats` got SIGTERM"
        )
    finally:
        for pid in children:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
