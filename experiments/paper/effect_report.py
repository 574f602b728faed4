"""The report of the ``effect`` protocol: ``<report_name>.md`` from the runner's state.

The same machinery as the paper table's report (``experiments/paper/report.py``: rows, paired
verdicts, costs), with this protocol's sections: the shared warm start and its choice, the follow
audit and its gate, the Stage-1 trees with their counterfactual counts, and the rows trained from
the warm start with equal steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from experiments.paper import report_tables as t
from experiments.paper.choices import grpo_origin
from experiments.paper.config import PaperConfig

__all__ = ["render_effect"]

ROOT = Path(__file__).resolve().parents[2]

GPU_NEXT = (
    "What I would run on a GPU next: this protocol with SGLang "
    "engines and a 1.5B-7B instruct model (Qwen2.5 as in\n"
    "the paper), gym-sokoban-size rooms (7x7 to 10x10, 2-3 boxes), "
    "512 label rooms for the warm start, Stage 1 on\n"
    "512 RL tasks until ~3 corrections per task (the paper's ~10k "
    "distilled samples), GRPO for 10-20 rounds with\n"
    "the dual clip on (`loss.dual_clip = 3`: round 1 rebuilt "
    "here from other weights had one step at loss 56\n"
    "against a usual ~0.1, from a single token), and 128 test "
    "tasks x 128 samples, where the paper sees LEAFE's\n"
    "gain at large k. Before the model-e rows, the corrections' "
    "audit below as a gate on a first Stage 1 run: LEAFE\n"
    "with the model's own e can only help where its corrections are "
    "better moves than the ones they replace (with\n"
    "the oracle's e every one is; with SmolLM2-135M's own e on 7x7 rooms they tie)."
)


def _shown(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (a restored record names it
    absolute)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def _audit_lines(state: Any) -> list[str]:
    r = state.phases.get("audit-follow")
    if r is None:
        return [f"Follow audit: {t.phase_status(state, 'audit-follow')}."]
    s, g = r["summary"], r["gate"]
    rows = [
        ("the oracle's move X, e in context", "named_with_oracle_e"),
        ("X, no e (the cf input)", "named_without_e"),
        ("X, placebo e naming Y", "named_with_placebo_e"),
        ("Y, placebo e naming Y", "placebo_move_with_placebo_e"),
        ("the blamed move, e in context / no e", "blamed_with_oracle_e"),
        ("the move the model's own e names, own e in context", "own_named_with_own_e"),
    ]
    out = [
        f"{s['verdicts']} verdicts on audit rooms never trained on (`{_shown(r['report'])}`).",
        "",
        "| chosen move, condition | verdicts | share | 95% interval |",
        "|---|---|---|---|",
    ]
    for label, key in rows:
        x = s.get(key, {})
        if x.get("items"):
            lo, hi = x["interval"]
            out.append(
                f"| {label} | {x['items']} | {t.pct(x['share'])} | [{t.pct(lo)}, {t.pct(hi)}] |"
            )
    verdict = "PASSED" if g["passed"] else "NOT MET: the rows are not run"
    out += [
        "",
        f"**Gate** (>= {t.pct(g['threshold'])}% with e, above its share without): "
        f"{t.pct(g['follow_rate'])}% vs {t.pct(g['without_e'])}%: **{verdict}**.",
    ]
    return out


def _warm_start_lines(state: Any) -> list[str]:
    ph = state.phases
    out = []
    tr = ph.get("warm-train")
    if tr:
        out.append(
            f"Shared warm start trained from Base on {tr['samples']} samples ({tr['kinds']}; "
            f"mix {[m['materializer'] for m in tr.get('mix', [])]}), {tr['epochs']} epochs, lr "
            f"{tr['lr']}."
        )
    lab = ph.get("labels")
    if lab:
        out.append(
            f"Label trees: {lab['episodes']} from W0 on {lab['tasks']} label rooms "
            f"({lab['tree']['reflections']} reflections)."
        )
    sel = ph.get("select-warm")
    if sel:
        out.append(f"Choice: {sel['why']} (epoch {sel['epochs']}).")
    for p in state.plan:
        if p.name.startswith("val-warm-") and p.name in ph:
            v = ph[p.name]
            out.append(
                f"- {p.name}: val Pass@1 {t.pct(v['passk']['1'])}, "
                f"Pass@{max(map(int, v['passk']))} "
                f"{t.pct(v['passk'][str(max(map(int, v['passk'])))])}, parse fail "
                f"{t.pct(v['parse_failure_rate'])}"
            )
    return out or ["(not trained yet)"]


def _rooms_lines(cfg: PaperConfig, state: Any) -> list[str]:
    """The rows' rooms (``effect.rooms``): the warm start on each candidate's validation slice, the
    choice."""
    if not cfg.effect.rooms:
        return []
    out = [
        "## The rows' rooms (the warm start on each candidate's validation slice)",
        "",
        *(
            [f"Warm start taken from `{cfg.effect.inherit}` (its records and logs)."]
            if cfg.effect.inherit
            else []
        ),
        "",
        "| candidate | room variant | val Pass@1 | val Pass@k (largest k) | parse fail | status |",
        "|---|---|---|---|---|---|",
    ]
    for name, options in cfg.effect.rooms.items():
        phase = f"val-rooms-{name}"
        v = state.phases.get(phase)
        if v is None:
            out.append(
                f"| {phase} | {name} {dict(options)} | | | | {t.phase_status(state, phase)} |"
            )
            continue
        top = str(max(map(int, v["passk"])))
        out.append(
            f"| {phase} | {name} {dict(options)} | {t.pct(v['passk']['1'])} | "
            f"{t.pct(v['passk'][top])} (k={top}) "
            f"| {t.pct(v['parse_failure_rate'])} | done |"
        )
    sel = state.phases.get("select-rooms")
    out += [
        "",
        f"Choice: **{sel['variant']}**: {sel['why']}." if sel else "Choice: not made yet.",
        "",
    ]
    return out


_AUDITS: dict[tuple[str, float], dict[str, Any]] = {}
"""Reflection audits by (log, mtime): the report is rendered after every phase."""


def _reflect_lines(state: Any, runs: tuple[str, ...]) -> list[str]:
    """The model's own tau and e against the oracle's verdict beside it, per labelled collection
    (``experiments/paper/reflect_audit.py``), from the exported logs."""
    from experiments.paper.reflect_audit import audit_log

    out = [
        "| run | model reflections | tau = oracle's (chance) | fix move = oracle's | both | branch "
        "success: both "
        "agree / move agrees / move differs / all |",
        "|---|---|---|---|---|---|",
    ]
    for name in runs:
        log = Path(str(state.phases.get(name, {}).get("log_file", "")))
        if not log.is_file():
            continue
        key = (str(log), log.stat().st_mtime)
        if key not in _AUDITS:
            _AUDITS[key] = audit_log(log)
        m = _AUDITS[key].get("model", {})
        if not m.get("labelled"):
            continue
        both = m.get("both_agree", 0) / max(1, m["labelled_mistake"])
        success = " / ".join(
            t.pct(m[k]) if m.get(k) is not None else "-"
            for k in (
                "branch_success_share_both_agree",
                "branch_success_share_fix_agree",
                "branch_success_share_fix_disagree",
                "branch_success_share",
            )
        )
        out.append(
            f"| {name} | {m['reflections']} | {t.pct(m['tau_agree_share'])} "
            f"({t.pct(m.get('tau_chance_share'))}) "
            f"| {t.pct(m['fix_agree_share'])} "
            f"| {t.pct(both)} | {success} |"
        )
    if len(out) == 2:
        return []
    return [
        "## The model's own e against the oracle's verdict (same history)",
        "",
        *out,
        "",
        "Chance: tau drawn uniformly from the steps before the reflection; the fix move, one of "
        "the 3 moves "
        "other than the blamed one (33.3). A cf sample comes from every successful branch, whether "
        "its e named "
        "the oracle's move or not.",
        "",
    ]


def _cf_lines(state: Any) -> list[str]:
    lines = ["| training | start | samples | kinds | steps | epochs |", "|---|---|---|---|---|---|"]
    for p in state.plan:
        r = state.phases.get(p.name)
        if p.name.startswith("train-") and r:
            lines.append(
                f"| {p.name} | {r['start']} | {r['samples']} | {r['kinds']} | "
                f"{r.get('steps', '-')} "
                f"| {r['epochs']} |"
            )
    return lines


def _correction_lines(
    state: Any, runs: tuple[str, ...] = ("explore-model", "explore-oracle")
) -> list[str]:
    """Corrections (solved rolled-back branches, one cf sample each) per tree and per core-minute
    of collection (wall minutes x this host's cores, every core busy while trees run)."""
    cores = os.cpu_count() or 1
    lines = [
        f"| run | trees | corrections | per tree | collection min | per core-minute ({cores} "
        "cores) |",
        "|---|---|---|---|---|---|",
    ]
    for n in runs:
        r = state.phases.get(n)
        if not r:
            continue
        fixed, minutes = r["tree"]["branch_successes"], r["collect_wall_s"] / 60
        lines.append(
            f"| {n} | {r['episodes']} | {fixed} | {fixed / max(1, r['episodes']):.2f} | "
            f"{minutes:.1f} "
            f"| {fixed / max(1e-9, minutes * cores):.2f} |"
        )
    return lines if len(lines) > 2 else ["(no Stage 1 collection finished yet)"]


def _quality_lines(cfg: PaperConfig, state: Any) -> list[str]:
    from experiments.paper.cf_quality import quality_lines

    return quality_lines(cfg, state)


def _reflector_lines(cfg: PaperConfig, state: Any) -> list[str]:
    from experiments.paper.reflector_audit import reflector_lines

    return reflector_lines(cfg, state)


def render_effect(
    cfg: PaperConfig, state: Any, comparison_lines: list[str], protocol: list[str]
) -> str:
    """The markdown report of the ``effect`` protocol."""
    md = [
        f"# LEAFE's own effect, `{cfg.name}` ({cfg.env}, {cfg.model})",
        "",
        'Produced by `experiments/paper_table.py` with `protocol = "effect"` '
        "(`experiments/paper/effect.py`; "
        "`docs/experiments.md`).",
        f"Phases finished: {len(state.phases)} of {len(state.plan)}."
        + (f" Running: {state.running}." if state.running else ""),
        *[f"- **{k} FAILED**: `{v[:400]}`" for k, v in state.failed.items()],
        *[f"- {k} blocked: {v}" for k, v in state.blocked.items()],
        *([f"- Not started (time box): {', '.join(state.skipped)}."] if state.skipped else []),
        *t.rebuild_flags(state),
        *([f"Run notes: {cfg.notes}"] if cfg.notes else []),
        "",
        "## Protocol (fixed before any evaluation)",
        "",
        *protocol,
        f"- Effect: {json.dumps(state.protocol['protocol'].get('effect', {}))}",
        "",
        f"## Pass@k on held-out test tasks ({cfg.test_tasks} tasks x {cfg.eval_samples} "
        "samples, %)",
        "",
        *t.rows_table(cfg, state),
        "",
        "### Paired comparisons and verdicts",
        "",
        *comparison_lines,
        "",
        *_rooms_lines(cfg, state),
        "## The follow audit (the gate)",
        "",
        *_audit_lines(state),
        "",
        "## The shared warm start",
        "",
        *t.warm_table(cfg, state),
        "",
        *_warm_start_lines(state),
        "",
        "## Stage 1 trees (from the warm start)",
        "",
        *t.tree_table(state, ("labels", "audit-collect", "explore-model", "explore-oracle")),
        "",
        *_reflect_lines(state, ("labels", "audit-collect", "explore-model")),
        "## Corrections per tree and per core-minute",
        "",
        *_correction_lines(state),
        "",
        *_quality_lines(cfg, state),
        *_reflector_lines(cfg, state),
        "## Trainings (counterfactual counts per row)",
        "",
        *_cf_lines(state),
        "",
        "## GRPO rounds (from the warm start)",
        "",
        *t.grpo_table(cfg, state, grpo_origin("warm", bool(cfg.effect.rooms)), "warm start W"),
        "",
        "## Collections",
        "",
        *t.budget_table(state),
        "",
        "## Every phase, wall times",
        "",
        *t.wall_table(state),
        "",
        "## What I would run on a GPU next",
        "",
        GPU_NEXT,
        "",
        "## Exact configuration",
        "",
        "```json",
        json.dumps(msgspec.to_builtins(cfg), indent=1),
        "```",
        "",
    ]
    return "\n".join(md)
