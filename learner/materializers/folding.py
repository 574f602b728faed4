"""Folding a whole log into samples, offline: the driver ``leafe replay`` and the tests share.

:class:`Folder` feeds decoded events (``None`` for an undecodable record) to a materializer and
counts what it saw; at the end of the log every still-open episode is closed as abandoned (no
samples from branches without an Outcome). :func:`write_folded` writes the result as a dataset
(``leafe.learner.dataset.write_dataset``): folding the same log again gives byte-identical shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from leafe.learner.dataset import DatasetManifest, write_dataset
from leafe.learner.materializers.base import Materializer
from leafe.learner.materializers.lifecycle import CAP_CODES
from leafe.learner.materializers.tree import ReplayError
from leafe.protocol.events import EpisodeEvent
from leafe.protocol.samples import Sample

__all__ = ["FoldResult", "Folder", "fold_events", "write_folded"]

log = structlog.get_logger(__name__)


@dataclass
class FoldResult:
    """What folding a log produced."""

    samples: list[Sample] = field(default_factory=list)
    events: int = 0
    undecodable: int = 0
    rejected: int = 0
    other_runs: int = 0
    capped: int = 0
    """Rejections because an open-episode cap was reached (``OpenLimits``; counted in ``rejected``
    too)."""
    first_capped: str = ""
    """The first of those reasons."""


class Folder:
    """Feeds decoded events (or ``None`` for an undecodable record) to a materializer, counting."""

    def __init__(self, fold: Materializer, *, run_id: str | None = None) -> None:
        self.fold = fold
        self.run_id = run_id
        self.result = FoldResult()

    def feed(self, event: EpisodeEvent | None) -> None:
        """Fold one event; rejections are logged and counted."""
        r = self.result
        r.events += 1
        if event is None:
            r.undecodable += 1
            return
        if self.run_id is not None and event.run_id != self.run_id:
            r.other_runs += 1
            return
        try:
            r.samples += self.fold.apply(event)
        except ReplayError as e:
            r.rejected += 1
            if e.code in CAP_CODES:  # a cap, not bad input: the summary says so and how to raise it
                r.capped += 1
                r.first_capped = r.first_capped or e.reason
            log.warning("replay.event.rejected", event_id=event.event_id[:80], reason=e.reason)

    def finish(self) -> FoldResult:
        """Close every open episode (end of the log) and return the result."""
        self.result.samples += self.fold.close_all()
        return self.result


def fold_events(
    events: Iterable[EpisodeEvent | None], fold: Materializer, *, run_id: str | None = None
) -> FoldResult:
    """Fold an in-memory log (tests, benchmarks): every event, then close what is still open."""
    folder = Folder(fold, run_id=run_id)
    for event in events:
        folder.feed(event)
    return folder.finish()


def write_folded(
    result: FoldResult, fold: Materializer, out_dir: Path, *, run_id: str | None, shard_size: int
) -> DatasetManifest:
    """Write the folded samples as a dataset; the manifest records the fold's stats and counters."""
    stats = {
        **fold.stats.as_dict(),
        "log_events": result.events,
        "undecodable": result.undecodable,
        "other_runs": result.other_runs,
        "capped": result.capped,
    }
    source = {"run_id": run_id} if run_id else {}
    return write_dataset(
        result.samples,
        out_dir,
        materializer=fold.describe(),
        shard_size=shard_size,
        source=source,
        stats=stats,
    )
