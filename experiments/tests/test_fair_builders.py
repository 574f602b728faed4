"""experiments/paper/fair_builders.py: counts of each builder's fold over a log file, and the audit
shares of the reflections the self-taught builder keeps (a hand-built tree, byte tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.paper import fair_builders
from leafe.protocol.events import Reflection
from leafe.services.eventlog.fileformat import write_events
from tests.support.materializers import TOK
from tests.unit.learner.test_fair_materializers import _outcome_tree


def test_counts_and_the_kept_reflections_audit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _outcome_tree(False, True).events
    write_events(tmp_path / "explore-model.leafelog.gz", events, run_id="r1")
    monkeypatch.setattr(
        fair_builders,
        "FOLDS",
        [
            ("st", "self-taught", {}, "explore-model"),
            ("own", "reh-own", {"rehearsal_fraction": 1.0}, "explore-model"),
            ("leafe", "leafe", {"rehearsal_fraction": 1.0}, "explore-model"),
        ],
    )
    (refl,) = [e for e in events if isinstance(e, Reflection)]
    audit = {refl.event_id: {"named": True, "legal": True, "fix": False, "optimal": True}}
    st, own, leafe = fair_builders.count_folds(tmp_path, TOK, audit)
    assert st["samples"] == {"sft": 1} and st["builders"]["self-taught.reward_+1"] == 1
    assert st["kept_audited"] == 1
    assert st["kept_audit"] == {
        "named": 1.0,
        "legal": 1.0,
        "fix": 0.0,
        "optimal": 1.0,
        "mistake": 0.0,
    }
    assert own["samples"] == {"reh": 1} and leafe["samples"] == {"cf": 1, "reh": 2}
    assert leafe["cf_distinct_states"] == 1
    assert "| st | explore-model |" in fair_builders.render([st, own, leafe])
