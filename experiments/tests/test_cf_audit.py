"""experiments/paper/cf_audit.py on the shipped oracle-reflection log (read only, about a
second)."""

from __future__ import annotations

from pathlib import Path

from experiments.paper.cf_audit import audit_log

LOG = (
    Path(__file__).resolve().parents[2]
    / "experiments/results/paper_logs/full/explore-grpo-oracle.leafelog.gz"
)


def test_the_audit_counts_branches_follows_and_the_base_rate_of_the_shipped_oracle_log() -> None:
    """The figures quoted from this log: 192 oracle branches, all naming a move; 41 first actions
    follow it, as many as the policy's base rate predicts (40.3); 53 branches succeed, 11 of them
    repeating the blamed action."""
    r = audit_log(LOG)
    assert (r["branches"], r["names_a_move"], r["follows_named_move"]) == (192, 192, 41)
    assert (r["successful"], r["successful_repeats_blamed_action"]) == (53, 11)
    assert abs(r["expected_by_base_rate"] - 40.3) < 0.05 and r["follow_rate"] == 0.214
