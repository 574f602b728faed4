"""Audit of the counterfactual samples an explore log gives: do the corrections correct anything?

For every branch of every explore tree: the parent's action at tau (the step the reflection blamed),
the branch's first action a'_tau (the cf target when the branch succeeds) and, where the experience
names a move ("... move X instead", the oracle's form), whether a'_tau is that move. The base rate
to compare the follow rate with is how often the policy picks that same move without e: the share of
X among all actions the policy took without an experience in its prompt. A follow rate near the base
rate says e does not steer the policy, so a cf sample is a resampled action that happened to work
out, not a correction.

    .venv/bin/python -m experiments.paper.cf_audit \
        experiments/results/paper_logs/full/explore-grpo*.leafelog.gz
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from leafe.protocol.events import Branch, Outcome, Step
from leafe.services.eventlog.fileformat import read_events

__all__ = ["audit_log", "main"]

_NAMED = re.compile(r"\bmove (up|down|left|right) instead\b", re.IGNORECASE)


def audit_log(path: Path) -> dict[str, Any]:
    """The figures of one log (see the module docstring)."""
    steps: dict[tuple[str, str, int], Step] = {}
    branches: list[Branch] = []
    success: dict[tuple[str, str], bool] = {}
    free: Counter[str] = Counter()
    for e in read_events(path):
        if isinstance(e, Step):
            steps[(e.episode_id, e.branch_id, e.t)] = e
            if not e.experience_in_context and e.action:
                free[e.action] += 1
        elif isinstance(e, Branch):
            branches.append(e)
        elif isinstance(e, Outcome):
            success[(e.episode_id, e.branch_id)] = e.success
    c: Counter[str] = Counter()
    for b in branches:
        first = steps.get((b.episode_id, b.branch_id, b.tau))
        blamed = steps.get((b.episode_id, b.parent_branch_id, b.tau))
        if first is None:
            continue
        ok = success.get((b.episode_id, b.branch_id), False)
        c["branches"] += 1
        c["successful"] += ok
        if blamed is not None and blamed.action == first.action:
            c["repeats_blamed_action"] += 1
            c["successful_repeats_blamed_action"] += ok
        named = _NAMED.findall(b.experience)
        if named:
            c["names_a_move"] += 1
            follows = first.action == named[-1].lower()
            c["follows_named_move"] += follows
            c["successful_follows_named_move"] += follows and ok
            c["expected_by_base_rate"] += free[named[-1].lower()] / max(1, sum(free.values()))
    out: dict[str, Any] = {"log": str(path), **c}
    if c["names_a_move"]:
        out["follow_rate"] = round(c["follows_named_move"] / c["names_a_move"], 3)
        out["base_rate"] = round(c["expected_by_base_rate"] / c["names_a_move"], 3)
    out["expected_by_base_rate"] = round(c["expected_by_base_rate"], 1)
    out["free_action_counts"] = dict(free)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    results = [audit_log(path) for path in args.logs]
    for r in results:
        print(json.dumps(r))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
