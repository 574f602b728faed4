"""Logs recorded before episode ids named their actor (``<task_key>.a<attempt>`` on an actor's
subject) stay readable: a file whose header predates owned ids is read with
``legacy_episode_ids`` by itself, by ``leafe replay`` and ``leafe log import``, which imports such
events as actor ``legacy`` (which no actor may publish as), so the live replayer, which never admits
such ids from an actor, folds them. The same events in a file written now are refused, counted, and
one line says how to read them (``--legacy-ids``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from leafe.learner.dataset import iter_samples
from leafe.learner.materializers import fold_events, make_materializer
from leafe.learner.model_io import HFChatTokenizer
from leafe.protocol.codec import Admission
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.subjects import EVENTS, LEGACY_ACTOR, event_subject_parts
from leafe.services.bus import read_stream
from leafe.services.eventlog.fileformat import write_events
from leafe.services.eventlog.transfer import ImportRefusedError, import_log
from tests.integration.test_replay_cli import leafe_replay
from tests.support.replaying import OPTIONS, Running, dead_reasons, published_samples, wait_for
from tests.support.strategies import make_episode

pytestmark = pytest.mark.integration


def legacy_events(run_id: str) -> list[EpisodeEvent]:
    """Two episodes of actor-0 with the ids of before (``<run>-ep<i>``)."""
    return [e for i in range(2) for e in make_episode(run_id, f"{run_id}-ep{i}", legacy=True)]


def test_leafe_replay_folds_an_older_log_and_older_ids_only_from_one(
    tmp_path: Path, tokenizer: HFChatTokenizer
) -> None:
    """The events in a file written before owned ids: folded as they are. The same events in a file
    written now: every one refused, no sample written, stderr says to use ``--legacy-ids``; with it,
    folded."""
    events = legacy_events("r1")
    expected = sorted(
        s.sample_id for s in fold_events(events, make_materializer("leafe", tokenizer)).samples
    )
    assert expected
    old, new = tmp_path / "old.leafelog", tmp_path / "new.leafelog"
    write_events(old, events, run_id="r1", owned_episode_ids=False)
    write_events(new, events, run_id="r1")

    def replay(path: Path, out: str, *flags: str) -> tuple[list[str], str]:
        common = ("--from", str(path), "--model", "tiny", "--materializer", "leafe")
        code, err, _ = leafe_replay(tmp_path, *common, *flags, "--out", str(tmp_path / out))
        assert code == 0, err
        return sorted(s.sample_id for s in iter_samples(tmp_path / out)), err

    assert replay(old, "old")[0] == expected
    samples, err = replay(new, "strict")
    assert samples == [] and f"{len(events)} events refused" in err and "--legacy-ids" in err
    assert replay(new, "flag", "--legacy-ids")[0] == expected


@pytest.mark.anyio
async def test_an_older_log_is_imported_as_actor_legacy_and_folded_online(
    js: Any, nats_url: str, run_id: str, tmp_path: Path, tokenizer: HFChatTokenizer
) -> None:
    """Written now, the file is refused naming the rule and nothing is published; written before
    owned ids, every event is stored on the ``legacy`` token (its dedupe id kept), and the live
    replayer folds them without a dead letter into the samples of the log's own events."""
    events = legacy_events(run_id)
    old, new = tmp_path / "old.leafelog", tmp_path / "new.leafelog"
    write_events(old, events, run_id=run_id, owned_episode_ids=False)
    write_events(new, events, run_id=run_id)
    with pytest.raises(ImportRefusedError, match="names no owner") as info:
        await import_log(js, new)
    assert info.value.category == "unowned_episode"
    stats = await import_log(js, old)
    assert (stats.records, stats.stored) == (len(events), len(events))
    again = await import_log(js, new, admission=Admission(legacy_episode_ids=True))
    assert (again.stored, again.duplicates) == (0, len(events))
    stored = [
        m async for m in read_stream(js, stream=EVENTS.name, filter_subject=f"leafe.{run_id}.>")
    ]
    assert {event_subject_parts(m.subject)[2] for m in stored} == {LEGACY_ACTOR}
    assert [m.headers["Nats-Msg-Id"] for m in stored] == [e.event_id for e in events]
    async with Running(nats_url, run_id, "leafe", tokenizer) as r:
        await wait_for(r.settled(js), what="every imported event folded and acked")
    assert await dead_reasons(js, run_id) == {}
    expected = fold_events(events, make_materializer("leafe", tokenizer, **OPTIONS["leafe"]))
    online = await published_samples(js, run_id)
    assert online and sorted(s.sample_id for s in online) == sorted(
        s.sample_id for s in expected.samples
    )
