"""The replayer service against a real nats-server: crash/restart exactness, dead letters,
abandonment.

The headline test kills the replayer mid-stream (its task cancelled at an arbitrary await, or the
process SIGKILLed) while events keep arriving, restarts it, and checks that the samples stream ends
with exactly the sample ids an offline ``leafe replay`` of the same log rebuilds: none lost, none
twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leafe.actors.fake_episodes import ExploreSpec, build_explore_episode
from leafe.learner.dataset import iter_samples
from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir
from leafe.protocol.events import EpisodeEvent, EpisodeStarted, Step, event_id_for
from leafe.services.bus import ERROR_HEADER, connect, ensure_streams
from tests.support.replaying import (
    Running,
    by_id,
    consumer_settled,
    dead_letters,
    make_log,
    offline_samples,
    publish,
    published_samples,
    unfinished,
    wait_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


@pytest.mark.parametrize("name", ["leafe", "grpo"])
async def test_replayer_killed_and_restarted_matches_offline_rebuild(
    nats_url: str, run_id: str, name: str, tokenizer: HFChatTokenizer
) -> None:
    """Cancelled twice mid-stream while events keep arriving, the replayer still publishes exactly
    the offline rebuild's samples, each once, and ends with no pending or unacked events."""
    run_id = f"{run_id}-{name}"[:60]
    events = make_log(run_id, tokenizer)
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    third = len(events) // 3
    try:
        await publish(js, events[:third])
        async with Running(nats_url, run_id, name, tokenizer) as r1:
            await r1.crash_after(third // 2)
        await publish(js, events[third : 2 * third])
        async with Running(nats_url, run_id, name, tokenizer) as r2:
            await r2.crash_after(third // 3)
        await publish(js, events[2 * third :])
        async with Running(nats_url, run_id, name, tokenizer) as r3:
            await wait_for(
                r3.settled(js, unfinished(events, name)), what="all events processed and acked"
            )
            assert r3.replayer.stats.recovered_events > 0
        online = by_id(await published_samples(js, run_id))
        offline = await offline_samples(js, run_id, name, tokenizer)
        assert len(offline) > 10
        assert online == offline
    finally:
        await nc.close()


async def test_bad_events_are_dead_lettered_and_the_replayer_keeps_going(
    nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """A Step for an unknown branch and a Step after its episode's EpisodeFinished go to the
    dead-letter subject with their reasons; every other sample flows."""
    events = make_log(run_id, tokenizer, episodes=3, groups=0)
    first = events[0]
    assert isinstance(
        first, EpisodeStarted
    )  # so the first bad Step lands while its episode is open

    def bad_step(seq: int, branch_id: str) -> Step:
        return Step(
            event_id=event_id_for(first.episode_id, seq),
            run_id=run_id,
            episode_id=first.episode_id,
            actor_id=first.actor_id,  # its own actor (another's is refused at admission)
            seq=seq,
            branch_id=branch_id,
            t=0,
            action="up",
            raw_text="up",
            token_ids=[1],
            observation="o",
        )

    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        await publish(js, [first, bad_step(999998, "b42"), *events[1:], bad_step(999999, "b0")])
        async with Running(nats_url, run_id, "leafe", tokenizer) as r:
            await wait_for(r.settled(js), what="all events acked")
            assert r.replayer.stats.dead_letters == 2
        dead = await dead_letters(js, run_id)
        reasons = " | ".join((m.headers or {})[ERROR_HEADER] for m in dead)
        assert len(dead) == 2
        assert (
            "after the episode's EpisodeFinished" in reasons and "unknown branch 'b42'" in reasons
        )
        online = {s.sample_id for s in await published_samples(js, run_id)}
        assert online == set(await offline_samples(js, run_id, "leafe", tokenizer))
    finally:
        await nc.close()


async def test_abandoned_episode_is_closed_after_the_timeout(
    nats_url: str, run_id: str, tokenizer: HFChatTokenizer
) -> None:
    """An episode whose actor vanished is closed after stale_timeout_s, its anchor acked, nothing
    emitted from its unfinished branches."""
    spec = ExploreSpec(seed=3, max_depth=1, budget=10, horizon=4, p_success=0.0, truncate=0.6)
    events = build_explore_episode(spec, run_id=run_id, episode_id="lost", tokenizer=tokenizer)
    nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        await publish(js, events)
        async with Running(nats_url, run_id, "leafe", tokenizer, stale_timeout_s=1.0) as r:
            await wait_for(r.settled(js), what="the abandoned episode's anchor acked")
            assert r.replayer.stats.stale_closed == 1 and r.replayer.fold.open_episodes == 0
        assert await published_samples(js, run_id) == []
    finally:
        await nc.close()


def _spawn(
    nats_url: str, run_id: str, model: Path, cfg: Path, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "leafe.services.cli",
        "replayer",
        "--nats",
        nats_url,
        "--run",
        run_id,
        "--model",
        str(model),
        "--config",
        str(cfg),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_replayer_process_sigkilled_matches_leafe_replay(
    nats_url: str, run_id: str, tokenizer: HFChatTokenizer, cache_dir: Path, tmp_path: Path
) -> None:
    """`leafe replayer` SIGKILLed twice mid-stream and restarted ends with exactly the ids that
    `leafe replay` writes for the same log; SIGTERM then stops it cleanly (exit 0)."""
    from leafe.services.replayer import replay

    model = tiny_model_dir(cache_dir)
    cfg = tmp_path / "replayer.toml"
    cfg.write_text(
        'materializer = "leafe"\nbatch = 8\nack_wait_s = 1.5\n[options]\nrehearsal_fraction = 0.5\n'
    )
    events = make_log(run_id, tokenizer, episodes=24, groups=0)
    parts = [events[k * len(events) // 5 : (k + 1) * len(events) // 5] for k in range(5)]
    log = tmp_path / "replayer.log"

    async def publish_part(part: list[EpisodeEvent]) -> None:
        nc = await connect(nats_url)
        await ensure_streams(nc.jetstream())
        await publish(nc.jetstream(), part)
        await nc.close()

    async def settled() -> bool:
        nc = await connect(nats_url)
        try:
            return await consumer_settled(nc.jetstream(), run_id, "leafe", unfinished(events))
        finally:
            await nc.close()

    def spawn(n: int) -> subprocess.Popen[bytes]:
        """Start replayer process number ``n`` and wait until it has recovered and bound its
        consumer."""
        proc = _spawn(nats_url, run_id, model, cfg, log)
        deadline = time.monotonic() + 90
        while log.read_text().count('"replayer.started"') < n:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        return proc

    # Parts are published while a replayer runs, and it is SIGKILLed right after parts 1 and 3: the
    # log interleaves episodes, so episodes are open (their later events unpublished) at every kill.
    proc = spawn(1)
    for k, part in enumerate(parts):
        asyncio.run(publish_part(part))
        if k in (1, 3):
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = spawn(2 if k == 1 else 3)
    deadline = time.monotonic() + 90
    while not asyncio.run(settled()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    assert log.read_text().count('"replayer.recovered"') >= 1

    out = tmp_path / "dataset"
    replay_cfg = tmp_path / "replay.toml"
    replay_cfg.write_text('materializer = "leafe"\n[options]\nrehearsal_fraction = 0.5\n')
    argv = [
        "--from",
        nats_url,
        "--run",
        run_id,
        "--model",
        str(model),
        "--out",
        str(out),
        "--config",
        str(replay_cfg),
    ]
    assert replay.main([*argv, "--no-progress"]) == 0

    async def online() -> list[str]:
        nc = await connect(nats_url)
        try:
            return [s.sample_id for s in await published_samples(nc.jetstream(), run_id)]
        finally:
            await nc.close()

    ids = asyncio.run(online())
    assert len(ids) == len(set(ids))
    assert set(ids) == {s.sample_id for s in iter_samples(out)} and ids


def test_leafe_replay_from_file_equals_replay_from_stream(
    nats_url: str, run_id: str, tokenizer: HFChatTokenizer, cache_dir: Path, tmp_path: Path
) -> None:
    """`leafe replay` of an exported log file and of the stream write byte-identical datasets."""
    from leafe.learner.dataset import read_manifest
    from leafe.services.eventlog.transfer import export_run
    from leafe.services.replayer import replay

    events = make_log(run_id, tokenizer, episodes=16, groups=1)  # enough samples for two shards
    log_file = tmp_path / "run.leafelog"

    async def prepare() -> None:
        nc = await connect(nats_url)
        try:
            await ensure_streams(nc.jetstream())
            await publish(nc.jetstream(), events)
            await export_run(nc.jetstream(), run_id, log_file)
        finally:
            await nc.close()

    asyncio.run(prepare())
    model = str(tiny_model_dir(cache_dir))
    # Every successful step is rehearsed: which 20% would be kept depends on sample ids, so on the
    # run id.
    config = tmp_path / "replay.toml"
    config.write_text("[options]\nrehearsal_fraction = 1.0\n")
    common = [
        "--run",
        run_id,
        "--model",
        model,
        "--no-progress",
        "--shard-size",
        "2",
        "--config",
        str(config),
    ]
    assert replay.main(["--from", nats_url, "--out", str(tmp_path / "a"), *common]) == 0
    assert replay.main(["--from", str(log_file), "--out", str(tmp_path / "b"), *common]) == 0
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert a == b and a.samples > 0 and len(a.shards) > 1
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (
        tmp_path / "b" / "manifest.json"
    ).read_bytes()
