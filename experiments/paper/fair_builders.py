"""What the fair rows' builders (``learner/materializers/fair.py``) give on the shipped Stage 1 logs
(issue #61): one fold per (builder, options, log), through the very materializers ``leafe replay``
runs, and the counts each yields.

Beside the counts: the distinct states (prompts) of the LEAFE rows' cf samples (the DAgger row is
registered with as many labelled states), and, joined with the reflector audit's records
(``reflector_audit.py``), the audit shares of the reflections the self-taught builder keeps.

    .venv/bin/python -m experiments.paper.fair_builders \\
        --logs experiments/results/paper_logs/effect-hard \\
        --audit experiments/results/reflector_audit_r0_records.jsonl.gz \\
        --out experiments/results/fair_builders_r0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from experiments.paper.reflector_audit import read_records
from leafe.learner.materializers import fold_events, make_materializer
from leafe.protocol.prompt import ChatTokenizer
from leafe.services.eventlog.fileformat import read_events

__all__ = ["FOLDS", "count_folds", "main"]

REH = {"rehearsal_fraction": 0.2, "rehearsal_seed": 0, "rehearsal_unit": "path"}
"""The effect rows' rehearsal selection (``experiments/paper/effect.py``)."""
FOLDS: list[tuple[str, str, dict[str, Any], str]] = [
    # (label, materializer, options, log stem)
    ("leafe (the shipped rows)", "leafe", REH, "explore-oracle"),
    ("leafe (the shipped rows)", "leafe", REH, "explore-model"),
    ("reh-own", "reh-own", REH, "explore-oracle"),
    ("reh-own", "reh-own", REH, "explore-model"),
    ("dagger first", "dagger", {}, "explore-oracle"),
    ("dagger first", "dagger", {}, "explore-model"),
    ("dagger all", "dagger", {"per_rollout": "all"}, "explore-oracle"),
    ("dagger all", "dagger", {"per_rollout": "all"}, "explore-model"),
    ("self-taught parent", "self-taught", {}, "explore-model"),
    ("self-taught root", "self-taught", {"baseline": "root"}, "explore-model"),
    ("self-taught parent + ties", "self-taught", {"keep_ties": True}, "explore-model"),
]
"""Every fold counted (the registered options: ``experiments/configs/paper_effect-fair.toml``)."""
AUDITED = ("named", "legal", "fix", "optimal", "mistake")


def count_folds(
    logs: Path, tok: ChatTokenizer, audit: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One row per fold of :data:`FOLDS`: samples by kind, the builder's counters, distinct
    prompts of cf samples, and (self-taught, with ``audit``) the audit shares of what it kept."""
    rows = []
    for label, name, options, stem in FOLDS:
        fold = make_materializer(name, tok, **options)
        result = fold_events(read_events(logs / f"{stem}.leafelog.gz"), fold)
        row: dict[str, Any] = {
            "label": label,
            "materializer": name,
            "options": options,
            "log": stem,
            "samples": dict(sorted(fold.stats.samples.items())),
            "builders": dict(sorted(fold.stats.builders.items())),
            "prompt_mismatches": fold.stats.prompt_mismatches,
        }
        cf = [s for s in result.samples if s.kind == "cf"]
        if cf:
            row["cf_distinct_states"] = len({tuple(s.prompt_ids) for s in cf})
        if name == "self-taught" and audit is not None:
            kept = [audit[i] for s in result.samples for i in s.source_event_ids if i in audit]
            row["kept_audit"] = {
                k: round(sum(bool(r.get(k)) for r in kept) / len(kept), 4) if kept else None
                for k in AUDITED
            }
            row["kept_audited"] = len(kept)
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# The fair rows' builders on the shipped effect-hard Stage 1 logs",
        "",
        "Made by `experiments/paper/fair_builders.py`; each row is one fold of "
        "`learner/materializers/fair.py` (or `leafe`) over one log, as `leafe replay` runs it.",
        "",
        "| fold | log | options | samples | cf distinct states | builder counts |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        counts = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in r["builders"].items())
        lines.append(
            f"| {r['label']} | {r['log']} | `{json.dumps(r['options'])}` | "
            f"{json.dumps(r['samples'])} | {r.get('cf_distinct_states', '')} | {counts} |"
        )
    kept = [r for r in rows if "kept_audit" in r]
    if kept:
        lines += [
            "",
            "The self-taught targets, judged by the reflector audit (shares of the kept "
            "reflections; `reflector_audit_r0.md` has every branch's):",
            "",
            "| fold | kept | " + " | ".join(AUDITED) + " |",
            "|---|---|" + "---|" * len(AUDITED),
        ]
        for r in kept:
            shares = " | ".join(
                "-" if r["kept_audit"][k] is None else f"{100 * r['kept_audit'][k]:.1f}"
                for k in AUDITED
            )
            lines.append(f"| {r['label']} | {r['kept_audited']} | {shares} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from leafe.learner.model_io import HFChatTokenizer, resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logs", type=Path, required=True)
    p.add_argument("--audit", type=Path, default=None, help="the reflector audit's records")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", type=Path, required=True, help="output stem (.json, .md)")
    args = p.parse_args(argv)
    tok = HFChatTokenizer.from_dir(resolve_model(args.model))
    audit = None
    if args.audit is not None:
        audit = {r["reflection"]: r for r in read_records(args.audit) if r["log"] == "model"}
    rows = count_folds(args.logs, tok, audit)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(render(rows), encoding="utf-8")
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
