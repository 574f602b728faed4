"""The report of ``bench/paper_table.py``: ``paper_table.md`` (tables, budgets, wall times, the paper's
numbers beside ours), ``paper_table.json`` (config + every phase result) and ``paper_table.png`` (Pass@k
curves per method). Pure function of the config and the phase results; rewritten after every phase, so
an interrupted experiment still leaves an honest partial report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from actors.passk import paired_difference

__all__ = ["METHODS", "write_report"]

METHODS = {
    "base": ("Base", []),
    "grpo": ("GRPO", ["rollout-base", "train-grpo"]),
    "rft": ("RFT", ["rollout-base", "train-rft"]),
    "leafe-from-base": ("LEAFE (from Base)", ["explore-base", "train-leafe-base"]),
    "leafe-from-grpo": (
        "LEAFE (from GRPO)",
        ["rollout-base", "train-grpo", "explore-grpo", "train-leafe-grpo"],
    ),
    "reh-only-from-grpo": (
        "L_reh only (from GRPO)",
        ["rollout-base", "train-grpo", "explore-grpo", "train-reh-grpo"],
    ),
    "base-reseed": ("Base, other sampling seeds (noise check)", []),
}
"""Eval label -> (name, phases its weights depend on: their wall time is the method's training cost)."""

PAPER = """\
Paper (Qwen2.5-7B, Sokoban, Pass@1 / Pass@128, %): Base 6.90 / 43.80, GRPO 58.15 / 68.00, LEAFE 64.60 / 78.40
(EarlyExp 60.15 / 71.60, ACE 61.30 / 70.80). Stage 1 alone at equal budget (CodeContests Pass@128,
Qwen2.5-72B): IS 48.65, IR 49.52, LEAFE tree 54.30. CodeContests (Qwen2.5-72B, Pass@1 / Pass@128): Base
10.00 / 33.94, GRPO 20.45 / 36.97, LEAFE 17.12 / 47.88. Ablation (ScienceWorld Pass@128): L_reh alone 59.33,
L_cf + L_reh 62.00. The shape: GRPO may win Pass@1, LEAFE wins Pass@k at large k."""


MACHINE = """\
- Compute: 2 CPU cores (AMD EPYC, Zen 4) shared with other engineers' jobs, no GPU. Every process of the
  experiment runs niced. SmolLM2-135M on our CPU inference server(s) (dynamic batching, prefix cache).
  One core prefills ~280 tokens/s in float32 and ~600 in bfloat16 (measured with the served model); a
  decode step of 16 sequences takes ~0.14 s. Training (`leafe train`, float32, 2 threads) runs ~150-300
  tokens/s forward+backward. So one evaluation costs minutes per 100 episodes, and the paper's sizes
  (Qwen2.5-7B, k up to 128, ~10k distilled samples) are out of reach here: `--scale gpu` is that protocol."""


def _limits(cfg: Any, state: dict[str, Any]) -> list[str]:
    """Measured costs of this run's phases and what the time box left out."""
    ph = state["phases"]
    out = [MACHINE]
    evals = [(k, v) for k, v in ph.items() if k.startswith("eval-")]
    if evals:
        walls = [float(v["wall_s"]) for _, v in evals]
        eps = [int(v.get("episodes", 0)) for _, v in evals]
        out.append(
            f"- Measured here: an evaluation ({cfg.test_tasks} tasks x {cfg.eval_samples} samples, <= {cfg.horizon} "
            f"moves) took {min(walls) / 60:.1f}-{max(walls) / 60:.1f} min for {max(eps)} episodes "
            f"({cfg.servers} server(s), {cfg.dtype}, {cfg.concurrency} episodes in flight)."
        )
    for kind, names in (
        ("collection", ("explore-base", "rollout-base", "explore-grpo", "explore-ir")),
        ("training", ("train-grpo", "train-rft", "train-leafe-base", "train-leafe-grpo", "train-reh-grpo")),
    ):
        done = [f"{n} {float(ph[n].get('wall_s', 0)) / 60:.1f} min" for n in names if n in ph]
        if done:
            out.append(f"- {kind.capitalize()} phases: {', '.join(done)}.")
    missing = [n for n in state.get("skipped", [])]
    if missing:
        out.append(
            f"- Not reached in the time box (rerun the same command to continue): {', '.join(missing)}."
        )
    out.append(
        "- Not done by this script: GRPO beyond one round, a second environment (TextWorld / ScienceWorld / "
        "HumanEval: `--config` with `env`), any tuning (every setting is the first choice)."
    )
    return [*out, ""]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _evals(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {lab: state["phases"][f"eval-{lab}"] for lab in METHODS if f"eval-{lab}" in state["phases"]}


def _main_table(cfg: Any, state: dict[str, Any]) -> list[str]:
    evals, ph = _evals(state), state["phases"]
    ks = list(cfg.ks)
    head = "| method | " + " | ".join(f"Pass@{k}" for k in ks) + " | success | parse fail | prompt tok/step"
    lines = [head + " | train wall s | eval wall s |", "|---|" + "---|" * (len(ks) + 5)]
    for lab, (name, deps) in METHODS.items():
        if lab not in evals:
            skipped = deps and deps[-1] in state.get("not_evaluated", {})
            empty = deps and deps[-1] in ph and not ph[deps[-1]].get("final")
            why = "not evaluated (too few samples, see above)" if skipped else "not run"
            why = "no training samples (see Training phases)" if empty else why
            lines.append(f"| {name} | " + " | ".join("-" for _ in ks) + f" | {why} | | | | |")
            continue
        r = evals[lab]
        passk = {int(k): v for k, v in r["passk"].items()}
        train = sum(float(ph[d].get("wall_s", 0)) for d in deps if d in ph)
        lines.append(
            f"| {name} | "
            + " | ".join(_pct(passk.get(k)) for k in ks)
            + f" | {_pct(r['success_rate'])} | {_pct(r['parse_failure_rate'])} | {r['mean_prompt_tokens']:.0f}"
            + f" | {train:.0f} | {r['wall_s']:.0f} |"
        )
    return lines


def _budget_table(state: dict[str, Any]) -> list[str]:
    ph = state["phases"]
    lines = [
        "| phase (train split) | mode | episodes | policy actions | replay steps | successful episodes "
        "| tasks solved | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("explore-base", "rollout-base", "explore-grpo", "explore-ir"):
        if name in ph:
            r = ph[name]
            lines.append(
                f"| {name} | {r['mode']} x{r['samples_per_task']} | {r['episodes']}/{r['episodes_expected']} "
                f"| {r['actions']} | {r['replay_steps']} | {r['successful_episodes']} "
                f"| {r['tasks_solved']}/{r['tasks']} | {r['wall_s']:.0f} |"
            )
    return lines


def _tree_lines(state: dict[str, Any]) -> list[str]:
    trees = state.get("trees") or {}
    if not trees:
        return ["(filled in when the report is regenerated after the explore phases)"]
    lines = [
        "| run | trees | branches | reflections | rolled-back branches finished | of them solved "
        "| parse failures |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in trees.items():
        lines.append(
            f"| {name} | {t['episodes']} | {t['branches']} | {t['reflections']} | {t['branch_outcomes']} "
            f"| {t['branch_successes']} | {t['parse_failures']} |"
        )
    for name, t in trees.items():
        for e in t["experiences"]:
            text = " ".join(e["experience"].split())
            lines.append(f'- {name}, experience (tau={e["tau"]}, depth {e["depth"]}): "{text}"')
    return lines


def _train_table(state: dict[str, Any]) -> list[str]:
    ph = state["phases"]
    lines = [
        "| phase | samples (by kind) | optimizer steps | first loss | last loss | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("train-grpo", "train-rft", "train-leafe-base", "train-leafe-grpo", "train-reh-grpo"):
        if name in ph:
            r = ph[name]
            losses = r.get("losses") or []
            first = f"{losses[0]:.4f}" if losses else "-"
            last = f"{losses[-1]:.4f}" if losses else "-"
            lines.append(
                f"| {name} | {r.get('samples', 0)} {r.get('kinds', {})} | {r.get('steps', 0)} | {first} "
                f"| {last} | {float(r.get('wall_s', 0)):.0f} |" + (f" {r['note']}" if r.get("note") else "")
            )
    return lines


def _solved(r: dict[str, Any]) -> str:
    return f"{r['tasks_solved']}/{r['tasks']} ({100 * r['tasks_solved'] / max(1, r['tasks']):.1f}%)"


def _table3(state: dict[str, Any]) -> list[str]:
    ph = state["phases"]
    if "explore-base" not in ph or "rollout-base" not in ph:
        return ["(not run yet)"]
    tree, ind, ir = ph["explore-base"], ph["rollout-base"], ph.get("explore-ir")
    ir_row = (
        f"| iterative refinement (IR, {ir['samples_per_task']} chain(s)/task, restarts from step 0 with e) "
        f"| {ir['actions']} | {_solved(ir)} |"
        if ir
        else "| iterative refinement (IR) | - | not run (phase `explore-ir` not reached) |"
    )
    return [
        "| Base, train tasks, no training | policy actions | tasks solved at least once |",
        "|---|---|---|",
        f"| independent sampling (IS, {ind['samples_per_task']} rollouts/task) | {ind['actions']} | {_solved(ind)} |",
        ir_row,
        f"| LEAFE tree ({tree['samples_per_task']} tree(s)/task) | {tree['actions']} | {_solved(tree)} |",
    ]


def _boot_diff(
    a: dict[str, list[bool]], b: dict[str, list[bool]], k: int, iters: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """Pass@k(a) - Pass@k(b) on the same tasks with its 95% two-level bootstrap interval
    (``actors.passk.paired_difference``)."""
    d = paired_difference(a, b, k, draws=iters, seed=seed)
    return d.diff, d.lo, d.hi


_PAIRS = [(lab, "grpo") for lab in ("leafe-from-grpo", "leafe-from-base", "rft", "reh-only-from-grpo")] + [
    ("grpo", "base"),
    ("leafe-from-grpo", "base"),
    ("base-reseed", "base"),
]
"""Paired comparisons the report gives intervals for (the first four also carry the verdicts)."""

CIs = dict[tuple[str, str, int], tuple[float, float, float]]


def _intervals(cfg: Any, state: dict[str, Any]) -> CIs:
    """``(a, b, k) -> (diff, lo, hi)`` for every evaluated pair of :data:`_PAIRS` at k = 1 and max k;
    computed once per report (each is 4,000 bootstrap draws)."""
    evals, out = _evals(state), {}
    for a, b in _PAIRS:
        if a in evals and b in evals:
            for k in sorted({1, max(cfg.ks)}):
                out[a, b, k] = _boot_diff(evals[a]["successes"], evals[b]["successes"], k)
    return out


def _significance(cfg: Any, cis: CIs) -> list[str]:
    kmax = max(cfg.ks)
    lines = [
        f"| comparison | Pass@1 diff [95% CI] | Pass@{kmax} diff [95% CI] |",
        "|---|---|---|",
    ]
    for a, b in _PAIRS:
        if (a, b, 1) in cis:
            cells = []
            for k in (1, kmax):
                d, lo, hi = cis[a, b, k]
                mark = " *" if lo > 0 or hi < 0 else ""
                cells.append(f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}")
            lines.append(f"| {METHODS[a][0]} - {METHODS[b][0]} | {cells[0]} | {cells[1]} |")
    if len(lines) == 2:
        return ["(needs two evaluations)"]
    return [
        *lines,
        "",
        "Points of Pass@k; `*` marks an interval that excludes 0. Two-level bootstrap (4,000 draws): test tasks",
        "with replacement, then each method's n samples within a task with replacement. The Base-vs-Base row",
        "(same weights, other sampling seeds) shows how large a gap pure sampling noise makes here.",
    ]


def _analysis(cfg: Any, state: dict[str, Any], cis: CIs) -> list[str]:
    evals, kmax = _evals(state), max(cfg.ks)

    def at(lab: str, k: int) -> float | None:
        r = evals.get(lab)
        return None if r is None else {int(a): b for a, b in r["passk"].items()}.get(k)

    out = []
    for k in (1, kmax):
        a, b = at("grpo", k), at("base", k)
        if a is not None and b is not None:
            out.append(f"- GRPO vs Base at Pass@{k}: {_pct(a)} vs {_pct(b)}.")
    for lab in ("leafe-from-grpo", "leafe-from-base", "rft", "reh-only-from-grpo"):
        for k in (1, kmax):
            a, b = at(lab, k), at("grpo", k)
            if a is not None and b is not None:
                verdict = "beats" if a > b else ("ties" if a == b else "does NOT beat")
                _, lo, hi = cis[lab, "grpo", k]
                sig = "significant" if lo > 0 or hi < 0 else "within noise"
                out.append(
                    f"- {METHODS[lab][0]} {verdict} GRPO at Pass@{k}: {_pct(a)} vs {_pct(b)} "
                    f"(diff 95% CI [{100 * lo:+.1f}, {100 * hi:+.1f}]: {sig})."
                )
    ph = state["phases"]
    for name, t in (state.get("trees") or {}).items():
        train = {"explore-base": "train-leafe-base", "explore-grpo": "train-leafe-grpo"}.get(name)
        if train is None:
            continue
        if train not in ph:
            out.append(
                f"- Stage 1 ({name}): {t['branch_successes']} of {t['branch_outcomes']} rolled-back branches solved "
                f"their task after {t['reflections']} reflections (its Stage 2, {train}, was not run)."
            )
            continue
        kinds = ph[train].get("kinds", {})
        n_cf = int(kinds.get("cf", 0))
        out.append(
            f"- Stage 1 ({name}): {t['branch_successes']} of {t['branch_outcomes']} rolled-back branches solved "
            f"their task after {t['reflections']} reflections, so Stage 2 got {kinds or 'no'} samples"
            + (
                f" ({n_cf} counterfactual: fewer than one per train task, too little to move the weights)."
                if n_cf < cfg.train_tasks
                else "."
            )
        )
    if "explore-base" in ph and "rollout-base" in ph:
        tree, ind = ph["explore-base"], ph["rollout-base"]
        t, i = tree["tasks_solved"], ind["tasks_solved"]
        verdict = "reproduced" if t > i else "NOT reproduced"
        out.append(
            f"- Table 3 shape: at about equal budget ({tree['actions']} vs {ind['actions']} actions) the tree "
            f"solved {t}/{tree['tasks']} train tasks and independent sampling {i}/{ind['tasks']}: the paper's "
            f"tree > IS is {verdict} here ({tree['tasks']} tasks; one task is {100 / max(1, tree['tasks']):.0f} "
            "points)."
        )
    ir = ph.get("explore-ir")
    if ir and "explore-base" in ph:
        tree = ph["explore-base"]
        out.append(
            f"- Iterative refinement solved {ir['tasks_solved']}/{ir['tasks']} train tasks with {ir['actions']} "
            f"actions vs the tree's {tree['tasks_solved']}/{tree['tasks']} with {tree['actions']}: IR spent "
            f"{ir['actions'] / max(1, tree['actions']):.2f}x the tree's actions under the same max_actions cap "
            "(restarting re-samples the whole prefix), so this row is not at equal budget."
        )
    base = at("base", kmax)
    if base is not None:
        out.append(f"- Base Pass@{kmax} = {_pct(base)} (difficulty check: should be neither 0 nor ~100).")
    n = cfg.test_tasks * cfg.eval_samples
    out.append(
        f"- Noise: {cfg.test_tasks} test tasks x {cfg.eval_samples} samples = {n} rollouts per method; one task "
        f"moves Pass@{kmax} by {100 / cfg.test_tasks:.1f} points, so differences of that size are not significant "
        "(every method uses the same tasks and sampling seeds, so the comparison is paired, but still tiny)."
    )
    return out


def write_report(cfg: Any, state: dict[str, Any], results: Path) -> None:
    """Write ``<cfg.report_name>.md/.json/.png`` under ``results`` from ``cfg`` and the phase results so far."""
    from services.figures import plot_passk

    results.mkdir(parents=True, exist_ok=True)
    config = msgspec.to_builtins(cfg)
    evals = _evals(state)
    curves = {METHODS[lab][0]: {int(k): v for k, v in r["passk"].items()} for lab, r in evals.items()}
    if curves:
        plot_passk(
            curves, results / f"{cfg.report_name}.png", title=f"Pass@k, {cfg.env} test ({cfg.name} scale)"
        )
    ph, cis = state["phases"], _intervals(cfg, state)
    md = [
        f"# Paper table at `{cfg.name}` scale: Base vs GRPO vs RFT vs LEAFE ({cfg.env})",
        "",
        "Produced by `bench/paper_table.py` (every phase through the real services: embedded nats-server log,",
        "in-process actor service, CPU inference server with weight reloads, `leafe replay`, `leafe train`).",
        f"Phases finished: {', '.join(ph) or 'none'}.",
        f"Phases not started (time box `--max-minutes` reached): {', '.join(state['skipped']) or 'none'}.",
        *(
            [f"Phases left out by the config (`phases`): {', '.join(state['excluded'])}."]
            if state.get("excluded")
            else []
        ),
        *[f"Phase **{k} failed**: `{v}`" for k, v in state.get("failed", {}).items()],
        *[f"Not evaluated: {k}: {v}." for k, v in state.get("not_evaluated", {}).items()],
        *([f"Run notes: {cfg.notes}"] if cfg.notes else []),
        "",
        f"## Pass@k on held-out test tasks ({cfg.test_tasks} tasks x {cfg.eval_samples} samples, %)",
        "",
        *_main_table(cfg, state),
        "",
        "Train wall = collection + training phases the weights depend on (shared phases counted in each).",
        "",
        "### Paired differences with bootstrap intervals",
        "",
        *_significance(cfg, cis),
        "",
        "## Interaction budgets (policy actions from `EpisodeFinished.actions`)",
        "",
        *_budget_table(state),
        "",
        "## Stage 1 alone at equal execution budget (paper Table 3 shape)",
        "",
        *_table3(state),
        "",
        "### What the exploration trees did",
        "",
        *_tree_lines(state),
        "",
        "## Training phases",
        "",
        *_train_table(state),
        "",
        "## Analysis",
        "",
        *_analysis(cfg, state, cis),
        "",
        "## What limited the scale",
        "",
        *_limits(cfg, state),
        "## The paper's numbers (for the shape)",
        "",
        PAPER,
        "",
        "## Exact configuration",
        "",
        "```json",
        json.dumps(config, indent=1),
        "```",
        "",
    ]
    (results / f"{cfg.report_name}.md").write_text("\n".join(md), encoding="utf-8")
    blob = {"config": config, "paper": PAPER, **state}
    (results / f"{cfg.report_name}.json").write_text(
        json.dumps(blob, indent=1, default=str) + "\n", encoding="utf-8"
    )
