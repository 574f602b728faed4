"""Audit of an explore log's reflections: do the model's tau and e agree with the oracle, and do the
branches they open succeed? (Among others: the reflection warm start's tau agreement.)

For every Reflection of an ``explore`` episode: who wrote it (``model`` or ``oracle``), whether the
model's answer parsed, whether its e is non-empty, the oracle's label beside it where the explorer
asked for one (``ExplorerConfig.oracle_labels``), and the branch opened from it (Reflection ->
Branch by ``reflection_event_id`` -> that branch's Outcome). Figures per source:

- ``reflections``, ``parsed`` (``parse_ok``), ``e_nonempty``, and their shares;
- ``labelled`` (an oracle verdict beside a model reflection), ``labelled_mistake`` (the oracle named
  a mistake: non-empty e), ``tau_agree`` (tau == oracle_tau among those) and ``tau_agree_share``,
  beside ``tau_chance_share``, the agreement of a tau drawn uniformly from ``0..at_t-1`` (the mean
  of ``1/at_t``);
- ``branches`` (rolled-back branches opened) and ``branches_succeeded`` (today's model row: 22 of
  295), and among labelled ones the successes of branches whose tau agreed or disagreed with the
  oracle;
- the fix: where the oracle names a move (``oracle_action``), whether the model's e names the same
  one ("move X", X among the actions the log shows: taken, or named by the oracle): ``fix_agree``,
  ``fix_disagree``, ``fix_unnamed`` (e names none), ``both_agree`` (tau and move), and the successes
  of the branches each opened.

    .venv/bin/python -m experiments.paper.reflect_audit \
        experiments/results/paper_logs/full/explore-grpo.leafelog.gz
    # also one JSON line per reflection:
    .venv/bin/python -m experiments.paper.reflect_audit LOG --rows
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from experiments.paper.follow_audit import _named_move
from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Outcome, Reflection, Step
from leafe.services.eventlog.fileformat import read_events

__all__ = ["audit_events", "audit_log", "main", "reflection_rows"]


def reflection_rows(events: Iterable[EpisodeEvent]) -> list[dict[str, Any]]:
    """One row per Reflection of an explore episode, with the branch it opened and that branch's
    end."""
    explore: set[str] = set()
    reflections: list[Reflection] = []
    opened: dict[tuple[str, str], str] = {}
    success: dict[tuple[str, str], bool] = {}
    actions: set[str] = set()
    for e in events:
        match e:
            case EpisodeStarted(mode="explore"):
                explore.add(e.episode_id)
            case Step(action=str(action)):
                actions.add(action)
            case Reflection():
                reflections.append(e)
            case Branch():
                opened[(e.episode_id, e.reflection_event_id)] = e.branch_id
            case Outcome():
                success[(e.episode_id, e.branch_id)] = e.success
    actions |= {r.oracle_action for r in reflections if r.oracle_action}  # the moves an e may name
    rows: list[dict[str, Any]] = []
    for r in reflections:
        if r.episode_id not in explore:
            continue
        branch = opened.get((r.episode_id, r.event_id))
        rows.append(
            {
                "episode_id": r.episode_id,
                "event_id": r.event_id,
                "reflected_branch": r.branch_id,
                "at_t": r.at_t,
                "trigger": r.trigger,
                "source": r.source,
                "parse_ok": r.parse_ok,
                "tau": r.tau,
                "e_nonempty": bool(r.experience),
                "oracle_tau": r.oracle_tau,
                "oracle_mistake": bool(r.oracle_experience),
                "oracle_action": r.oracle_action,
                "named_action": _named_move(r.experience, sorted(actions))
                if r.source == "model"
                else "",
                "opened_branch": branch,
                "branch_success": None if branch is None else success.get((r.episode_id, branch)),
            }
        )
    return rows


def _share(n: int, d: int) -> float | None:
    return round(n / d, 3) if d else None


def audit_events(events: Iterable[EpisodeEvent]) -> dict[str, Any]:
    """The figures per reflection source (see the module docstring)."""
    counts: dict[str, Counter[str]] = {}
    chance: Counter[str] = Counter()
    for row in reflection_rows(events):
        c = counts.setdefault(row["source"], Counter())
        c["reflections"] += 1
        c["parsed"] += row["parse_ok"]
        c["e_nonempty"] += row["e_nonempty"]
        ok = bool(row["branch_success"])
        c["branches"] += row["opened_branch"] is not None
        c["branches_succeeded"] += ok
        if row["oracle_tau"] is None:
            continue
        c["labelled"] += 1
        if not row["oracle_mistake"]:
            continue
        c["labelled_mistake"] += 1
        chance[row["source"]] += 1 / max(1, row["at_t"])
        agree = "agree" if row["tau"] == row["oracle_tau"] else "disagree"
        c[f"tau_{agree}"] += 1
        c[f"branches_tau_{agree}"] += row["opened_branch"] is not None
        c[f"branches_succeeded_tau_{agree}"] += ok
        if not row["oracle_action"]:
            continue
        named = row["named_action"]
        fix = "unnamed" if not named else "agree" if named == row["oracle_action"] else "disagree"
        for key in (f"fix_{fix}", *(["both_agree"] if fix == agree == "agree" else [])):
            c[key] += 1
            c[f"branches_{key}"] += row["opened_branch"] is not None
            c[f"branches_succeeded_{key}"] += ok
    out: dict[str, Any] = {}
    for source, c in sorted(counts.items()):
        figures: dict[str, Any] = dict(c)
        figures["parsed_share"] = _share(c["parsed"], c["reflections"])
        figures["e_nonempty_share"] = _share(c["e_nonempty"], c["reflections"])
        figures["branch_success_share"] = _share(c["branches_succeeded"], c["branches"])
        if c["labelled"]:
            figures["tau_agree_share"] = _share(c["tau_agree"], c["labelled_mistake"])
            if c["labelled_mistake"]:
                figures["tau_chance_share"] = round(chance[source] / c["labelled_mistake"], 3)
            named = c["fix_agree"] + c["fix_disagree"] + c["fix_unnamed"]
            figures["fix_agree_share"] = _share(c["fix_agree"], named)
            for key in ("tau_agree", "tau_disagree", "fix_agree", "fix_disagree", "both_agree"):
                figures[f"branch_success_share_{key}"] = _share(
                    c[f"branches_succeeded_{key}"], c[f"branches_{key}"]
                )
        out[source] = figures
    return out


def audit_log(path: Path) -> dict[str, Any]:
    """:func:`audit_events` of one log file."""
    return {"log": str(path), **audit_events(read_events(path))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--rows", action="store_true", help="also print one JSON line per reflection")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    results = []
    for path in args.logs:
        results.append(audit_log(path))
        print(json.dumps(results[-1]))
        if args.rows:
            for row in reflection_rows(read_events(path)):
                print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
