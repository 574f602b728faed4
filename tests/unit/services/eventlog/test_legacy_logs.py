"""Logs written before event subjects named their actor (``leafe.<run>.events.<kind>``, e.g. the
older files of experiments/results/paper_logs/) still replay: each record is admitted, as actor
``legacy``, and their episodes share that one identity's open-episode cap, which a real run's log
never comes near. Logs written since (the effect experiment's) replay as the actor their subjects
name."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pytest

from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import OpenLimits, make_materializer
from leafe.learner.materializers.tree import ReplayError
from leafe.protocol.codec import admit_event, decode_event, encode, headers_for
from leafe.protocol.events import EpisodeFinished, EpisodeStarted
from leafe.protocol.subjects import LEGACY_ACTOR, event_subject, event_subject_parts
from leafe.services.eventlog.fileformat import iter_log_file, read_log_header, write_events
from leafe.services.replayer.replay import ReplayConfig, file_events
from tests.support.hostile import flood_starts

PAPER_LOGS = sorted(
    (Path(__file__).resolve().parents[4] / "experiments/results/paper_logs").rglob("*.leafelog.gz")
)


@pytest.mark.parametrize("path", PAPER_LOGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_paper_log_replays_with_each_event_as_actor_legacy(path: Path) -> None:
    """Every record of the committed paper logs is admitted (``leafe replay`` reads them so), as the
    event its bytes hold with the ``actor_id`` its subject names: ``legacy`` for a subject without
    an actor token; the most episodes any of them holds open at once stays far below the default
    ``max_open_per_actor``, so one shared legacy identity caps nothing."""
    records = list(iter_log_file(path))
    raw = [decode_event(data, headers.get("Leafe-Codec")) for _, headers, data in records]
    actors = [event_subject_parts(subject)[2] for subject, _, _ in records]
    admitted = list(file_events(path))
    assert admitted == [
        msgspec.structs.replace(e, actor_id=a) for e, a in zip(raw, actors, strict=True)
    ]
    assert len({a == LEGACY_ACTOR for a in actors}) == 1, (
        "a log is written either before actor tokens or after"
    )
    open_now, most = 0, 0
    for event in raw:
        open_now += isinstance(event, EpisodeStarted) - isinstance(event, EpisodeFinished)
        most = max(most, open_now)
    assert 0 < most < ReplayConfig().max_open_per_actor // 4, most
    assert len(PAPER_LOGS) >= 20


def test_legacy_events_share_one_cap_and_leave_other_actors_theirs() -> None:
    """Tokenless events naming three actors count as actor ``legacy`` alone: past its cap they are
    refused naming it, while an actor publishing on its own token still opens episodes."""
    fold = make_materializer("leafe", ByteChatTokenizer())
    fold.limits = OpenLimits(max_open=10, max_per_actor=2)
    starts = [
        msgspec.structs.replace(  # as written before episode ids named their actor
            e, episode_id=f"r1-{a}-0", event_id=f"r1-{a}-0.000000"
        )
        for a in ("a0", "a1", "a2")
        for e in flood_starts("r1", 1, actor_id=a)
    ]
    legacy = [
        admit_event("leafe.r1.events.episode_started", headers_for(e), encode(e)) for e in starts
    ]
    fold.apply(legacy[0])
    fold.apply(legacy[1])
    with pytest.raises(
        ReplayError, match=r"actor 'legacy' already holds 2 .*max_open_per_actor = 2"
    ):
        fold.apply(legacy[2])
    [mine] = flood_starts("r1", 1, actor_id="b0")
    fold.apply(
        admit_event(event_subject("r1", "episode_started", "b0"), headers_for(mine), encode(mine))
    )
    assert fold.held_episodes == 3


RECORDED_BEFORE_OWNED_IDS = (
    Path(__file__).resolve().parents[4]
    / "experiments/results/online_effect_hard/grpo/events.leafelog.gz"
)
"""A committed log recorded with actor tokens but before episode ids named their actor."""


def test_a_log_recorded_before_owned_ids_replays_as_it_is_and_its_ids_only_from_it(
    tmp_path: Path,
) -> None:
    """Its header predates owned ids, so every record is admitted as the event its bytes hold. The
    same events in a file written now are refused as ``unowned_episode`` (counted: the online
    replayer decides so too), unless read with ``legacy_episode_ids``."""
    assert not read_log_header(RECORDED_BEFORE_OWNED_IDS).owned_episode_ids
    raw = [
        decode_event(data, headers.get("Leafe-Codec"))
        for _, headers, data in iter_log_file(RECORDED_BEFORE_OWNED_IDS)
    ]
    assert list(file_events(RECORDED_BEFORE_OWNED_IDS)) == raw
    newer = tmp_path / "newer.leafelog"
    write_events(newer, raw[:300], run_id=raw[0].run_id)
    refusals: Counter[str] = Counter()
    assert list(file_events(newer, refusals=refusals)) == [None] * 300
    assert refusals == Counter({"unowned_episode": 300})
    admission = ReplayConfig(legacy_episode_ids=True).admission
    assert list(file_events(newer, admission)) == raw[:300]
