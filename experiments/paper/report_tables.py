"""Markdown tables of the paper table's report, each a pure function of the config and the state.

``state`` is :class:`experiments.paper.runner.State` (``phases``: finished results by name,
``failed``, ``blocked``, ``skipped``, ``running``, ``plan``); a table renders whatever has finished
and says what has not, so a skeleton (nothing finished) and a partial run render too.
"""

from __future__ import annotations

from typing import Any

from experiments.paper.config import ROWS, PaperConfig
from experiments.paper.phases import closure, row_phase

__all__ = [
    "budget_table",
    "early_table",
    "grpo_table",
    "observations",
    "pct",
    "phase_status",
    "row_costs",
    "rows_table",
    "status_lines",
    "table3",
    "training_table",
    "tree_table",
    "wall_table",
    "warm_table",
]


def pct(x: float | None) -> str:
    """A fraction in points with one decimal, ``-`` for none."""
    return "-" if x is None else f"{100 * x:.1f}"


def phase_status(state: Any, name: str) -> str:
    """``done``, ``running``, ``FAILED: ...``, ``blocked: ...``, ``skipped (time box)`` or
    ``pending``."""
    if name in state.phases:
        return "done"
    if state.running == name:
        return "running"
    if name in state.failed:
        return f"FAILED: {state.failed[name][:200]}"
    if name in state.blocked:
        return f"blocked: {state.blocked[name]}"
    if name in state.skipped:
        return "skipped (time box)"
    return "pending"


def _minutes(x: float) -> str:
    return f"{x / 60:.1f}"


def row_costs(cfg: PaperConfig, state: Any) -> dict[str, float]:
    """Row -> seconds of every finished phase its weights needed (collections, trainings, validation
    evaluations and choices; shared phases counted in each row), without its own test evaluation."""
    out = {}
    for row in cfg.row_names:
        phase = row_phase(row)
        if phase not in {p.name for p in state.plan}:
            continue
        need = closure(state.plan, [phase]) - {phase}
        out[row] = sum(float(state.phases[n].get("wall_s", 0)) for n in need if n in state.phases)
    return out


def rows_table(cfg: PaperConfig, state: Any) -> list[str]:
    """The main table: Pass@k per row on the test tasks, with format, steps and costs."""
    ks = list(cfg.ks)
    head = "| row | " + " | ".join(f"Pass@{k}" for k in ks)
    lines = [
        head + " | parse fail | steps/episode | weights cost min | eval min | status |",
        "|---|" + "---|" * (len(ks) + 5),
    ]
    costs = row_costs(cfg, state)
    for row in cfg.rows:
        phase = row_phase(row)
        r = state.phases.get(phase)
        if r is None:
            cells = " | ".join("" for _ in ks)
            lines.append(
                f"| {cfg.row_names[row]} | {cells} | | | | | {phase_status(state, phase)} |"
            )
            continue
        passk = r["passk"]
        cells = " | ".join(pct(passk.get(str(k))) for k in ks)
        lines.append(
            f"| {cfg.row_names[row]} | {cells} | {pct(r['parse_failure_rate'])} | "
            f"{r['mean_steps']:.2f} "
            f"| {_minutes(costs.get(row, 0.0))} | {_minutes(float(r['wall_s']))} | done |"
        )
    return lines


def warm_table(cfg: PaperConfig, state: Any) -> list[str]:
    """Every SFT candidate's validation result, Base on validation per variant, and the choice."""
    lines = [
        "| candidate (validation phase) | room variant | demonstrations | epochs | val Pass@1 | "
        "val parse fail "
        "| status |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in state.plan:
        if not p.name.startswith(("val-sft-", "val-base-")):
            continue
        r = state.phases.get(p.name)
        variant = p.spec.variant
        demos, epochs = "-", "-"
        if p.name.startswith("val-sft-"):
            train, _, epoch = p.spec.model.removeprefix("train:").partition("@")
            demos, epochs = str(next(q.spec.demos for q in state.plan if q.name == train)), epoch
        label = p.name + (" (Base, untrained)" if p.name.startswith("val-base-") else "")
        if r is None:
            lines.append(
                f"| {label} | {variant} | {demos} | {epochs} | | | {phase_status(state, p.name)} |"
            )
        else:
            lines.append(
                f"| {label} | {variant} | {demos} | {epochs} | {pct(r['passk']['1'])} "
                f"| {pct(r['parse_failure_rate'])} | done |"
            )
    choice = state.phases.get("select-sft")
    if choice:
        met = "rule met" if choice["rule_met"] else "**RULE NOT MET**"
        lines += [
            "",
            f"Chosen: **{choice['chosen']}** (variant `{choice['variant']}` = "
            f"{choice['env_options']}, "
            f"{choice['demos']} demonstrations, {choice['epochs']} epoch(s)); {met}: "
            f"{choice['why']}.",
        ]
    return lines


def grpo_table(
    cfg: PaperConfig, state: Any, origin: str = "select-sft", start: str = "Base + SFT"
) -> list[str]:
    """The GRPO curve: per round the train-split success of its rollouts and the validation Pass@1;
    round 0 is GRPO's start on the same validation slice (``origin``: the choice whose ``val_phase``
    it is, as ``select-grpo`` compares)."""
    ph = state.phases
    lines = [
        "| round | weights | lr | train-split success of the round's rollouts | GRPO samples | val "
        "Pass@1 "
        "| val parse fail |",
        "|---|---|---|---|---|---|---|",
    ]
    chosen = ph.get(origin)
    if chosen and chosen["val_phase"] in ph:
        v = ph[chosen["val_phase"]]
        lines.append(
            f"| 0 | {start} ({chosen['val_phase']}) | - | - | - | {pct(v['passk']['1'])} "
            f"| {pct(v['parse_failure_rate'])} |"
        )
    lr_choice = ph.get("grpo-r1-select", {}).get("lr")
    for r in range(1, cfg.grpo.rounds + 1):
        col = ph.get(f"grpo-r{r}-collect")
        rate = (
            f"{col['successful_episodes']}/{col['episodes']}"
            if col
            else phase_status(state, f"grpo-r{r}-collect")
        )
        trains = (
            [f"grpo-r1-train-lr{i}" for i in range(len(cfg.grpo.lrs))]
            if r == 1
            else [f"grpo-r{r}-train"]
        )
        vals = (
            [f"grpo-r1-val-lr{i}" for i in range(len(cfg.grpo.lrs))]
            if r == 1
            else [f"grpo-r{r}-val"]
        )
        for i, (t, v) in enumerate(zip(trains, vals, strict=True)):
            lr = cfg.grpo.lrs[i] if r == 1 else lr_choice
            tr, va = ph.get(t), ph.get(v)
            samples = tr["samples"] if tr else phase_status(state, t)
            val = (
                f"{pct(va['passk']['1'])} | {pct(va['parse_failure_rate'])}"
                if va
                else f"{phase_status(state, v)} |"
            )
            lines.append(
                f"| {r} | {t} | {lr if lr is not None else '-'} | {rate} | {samples} | {val} |"
            )
    sel = ph.get("select-grpo")
    if sel:
        lines += [
            "",
            f"GRPO row = round {sel['round']} (lr {ph['grpo-r1-select']['lr']}): {sel['why']}.",
        ]
        if not sel["beats_start"]:
            lines.append("**GRPO could not beat its start on the validation slice** (curve above).")
    return lines


def early_table(state: Any) -> list[str]:
    """What the Early Experience collection did and the datasets it gave."""
    col = state.phases.get("early-collect")
    if not col:
        return [f"(early-collect: {phase_status(state, 'early-collect')})"]
    t = col["tree"]
    lines = [
        f"- {col['episodes']} demonstrations with alternatives from Base: {t['branches']} "
        "alternative branches "
        f"executed, {t['reflections']} reflections, {t['branch_successes']} alternatives solved "
        "the task.",
    ]
    for name in ("train-iwm", "train-sr"):
        r = state.phases.get(name)
        if r:
            lines.append(f"- {name}: {r['samples']} samples {r['kinds']}.")
    lines += [
        f'- self-reflection example: "{" ".join(e["experience"].split())}"'
        for e in t["experiences"][:2]
    ]
    return lines


def tree_table(
    state: Any, runs: tuple[str, ...] = ("explore-grpo", "explore-grpo-oracle", "t3-tree", "t3-ir")
) -> list[str]:
    """What the Stage-1 trees did, and a few experiences they wrote."""
    names = [n for n in runs if n in state.phases]
    if not names:
        return ["(no exploration finished yet)"]
    lines = [
        "| run | trees | tasks solved | branches | reflections | rolled-back branches finished | "
        "of them solved "
        "| parse failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        r = state.phases[n]
        t = r["tree"]
        lines.append(
            f"| {n} | {r['episodes']} | {r['tasks_solved']}/{r['tasks']} | {t['branches']} | "
            f"{t['reflections']} "
            f"| {t['branch_outcomes']} | {t['branch_successes']} | {t['parse_failures']} |"
        )
    for n in names:
        for e in state.phases[n]["tree"]["experiences"][:2]:
            lines.append(
                f'- {n} ({e["source"]}, tau={e["tau"]}): "{" ".join(e["experience"].split())}"'
            )
    return lines


def _solved(r: dict[str, Any]) -> str:
    return f"{r['tasks_solved']}/{r['tasks']} ({100 * r['tasks_solved'] / max(1, r['tasks']):.0f}%)"


def table3(state: Any) -> list[str]:
    """Stage 1 alone from Base + SFT at about equal action budget on the RL (train) tasks."""
    ph = state.phases
    rows = [
        ("independent sampling (IS)", "t3-is"),
        ("iterative refinement (IR: restart from step 0 with e)", "t3-ir"),
        ("LEAFE tree (rollback to tau, branch with e)", "t3-tree"),
    ]
    lines = [
        "| Base + SFT, train tasks | episodes/task | policy actions | tasks solved at least once |",
        "|---|---|---|---|",
    ]
    for label, name in rows:
        r = ph.get(name)
        if r:
            lines.append(f"| {label} | {r['samples_per_task']} | {r['actions']} | {_solved(r)} |")
        else:
            lines.append(f"| {label} | | | {phase_status(state, name)} |")
    return lines


def budget_table(state: Any) -> list[str]:
    """Every collection: episodes, policy actions, successes, log file."""
    lines = [
        "| collection | mode | weights | episodes | policy actions | replay steps | successful "
        "episodes "
        "| tasks solved | log (events, KiB) | min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in state.plan:
        r = state.phases.get(p.name)
        if r is None or "log_file" not in r:
            continue
        lines.append(
            f"| {p.name} | {r['mode']} x{r['samples_per_task']} | {p.spec.model} "
            f"({r['weights_tag']}) "
            f"| {r['episodes']}/{r['episodes_expected']} | {r['actions']} | {r['replay_steps']} "
            f"| {r['successful_episodes']} | {r['tasks_solved']}/{r['tasks']} "
            f"| `{r['log_file'].split('/')[-1]}` ({r['log_events']}, {r['log_bytes'] / 1024:.0f}) "
            f"| {_minutes(r['wall_s'])} |"
        )
    return lines


def training_table(state: Any) -> list[str]:
    """Every training: samples by kind, steps, losses, tokens, wall."""
    lines = [
        "| training | from | lr | epochs | samples (by kind) | optimizer steps | first loss | last "
        "loss "
        "| tokens | min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in state.plan:
        r = state.phases.get(p.name)
        if r is None or "replayed" not in r:
            continue
        losses = r.get("losses") or []
        first = f"{losses[0]:.4f}" if losses else "-"
        last = f"{losses[-1]:.4f}" if losses else "-"
        note = f" {r['note']}" if r.get("note") else ""
        lines.append(
            f"| {p.name} | {r['start']} | {r['lr']} | {r['epochs']} | {r['samples']} {r['kinds']} "
            f"| {r.get('steps', 0)} | {first} | {last} | {r.get('tokens', 0)} | "
            f"{_minutes(r['wall_s'])} |{note}"
        )
    return lines


def wall_table(state: Any) -> list[str]:
    """Every phase of the plan with its stage, dependencies, status and wall time."""
    lines = ["| # | phase | stage | needs | status | min |", "|---|---|---|---|---|---|"]
    for i, p in enumerate(state.plan, start=1):
        r = state.phases.get(p.name)
        wall = _minutes(float(r["wall_s"])) if r else ""
        needs = ", ".join(p.deps) or "-"
        lines.append(
            f"| {i} | {p.name} | {p.stage} | {needs} | {phase_status(state, p.name)} | {wall} |"
        )
    total = sum(float(r.get("wall_s", 0)) for r in state.phases.values())
    return [*lines, "", f"Sum of finished phases: {total / 3600:.2f} h."]


STARTS = {
    "sft": "base",
    "iwm": "base",
    "sr": "base",
    "grpo": "sft",
    "rft": "sft",
    "leafe": "grpo",
    "leafe-oracle": "grpo",
    "reh": "grpo",
}
"""Row -> the row its weights were trained from (Early Experience from Base, like SFT)."""


def observations(cfg: PaperConfig, state: Any) -> list[str]:
    """Automatic checks worth a reader's attention: trained rows that sample exactly like their
    start, unparseable answers above the warm start's bound, choices whose rule was not met, thin
    Stage-2 data."""
    ph, out = state.phases, []
    for row, start in STARTS.items():
        a, b = ph.get(row_phase(row)), ph.get(row_phase(start))
        keys = ("successes", "mean_steps", "parse_failure_rate", "mean_prompt_tokens")
        if (
            a and b and all(a.get(k) == b.get(k) for k in keys)
        ):  # same outcomes, lengths, formats, prompts
            same = f"- {ROWS[row]} sampled exactly like {ROWS[start]} on every test episode"
            out.append(same + ": its training did not change the policy's choices.")
        if a and row != "sr" and a["parse_failure_rate"] >= cfg.warm.max_parse_failure:
            out.append(
                f"- {ROWS[row]} answers unparseably in {pct(a['parse_failure_rate'])}% of its "
                "steps."
            )
    sr = ph.get(row_phase("sr"))
    if sr and sr["parse_failure_rate"] >= cfg.warm.max_parse_failure:
        rate = pct(sr["parse_failure_rate"])
        out.append(
            f"- EarlyExp (SR) answers unparseably in {rate}% of its steps (`</think>` must precede "
            "`<action>`)."
        )
    if "select-sft" in ph and not ph["select-sft"]["rule_met"]:
        out.append("- The warm-start rule was not met by any candidate (see the warm-start table).")
    if "select-grpo" in ph and not ph["select-grpo"]["beats_start"]:
        out.append("- GRPO did not beat Base + SFT on the validation slice (see the GRPO curve).")
    for name in ("train-leafe", "train-leafe-oracle"):
        r = ph.get(name)
        if r is not None and int(r["kinds"].get("cf", 0)) < cfg.train_tasks:
            cf = r["kinds"].get("cf", 0)
            out.append(
                f"- {name} had {cf} counterfactual samples for {cfg.train_tasks} RL tasks (the "
                "paper: ~3 per task)."
            )
    return out or ["- (nothing flagged)"]


def status_lines(state: Any) -> list[str]:
    """What finished, runs, failed, was blocked or cut by the time box."""
    out = [f"Phases finished: {len(state.phases)} of {len(state.plan)}."]
    if state.running:
        out.append(f"Running now: {state.running}.")
    out += [f"- **{k} FAILED**: `{v[:400]}`" for k, v in state.failed.items()]
    out += [f"- {k} blocked: {v}" for k, v in state.blocked.items()]
    if state.skipped:
        out.append(
            f"- Not started (time box; rerun the command to continue): {', '.join(state.skipped)}."
        )
    return out + rebuild_flags(state)


def rebuild_flags(state: Any) -> list[str]:
    """Trainings rebuilt from the logs (a later working period) whose latest rebuild trained to
    another loss curve than the record's: the phases finished after it (named, where the records say
    when) used the rebuild, the earlier ones the weights the record measured."""
    out = []
    for name, r in state.phases.items():
        last = (r.get("rebuilds") or [{}])[-1]
        if last and not last.get("agrees", True):
            host = last.get("host", {})
            on = (
                f", on {host.get('cpu_model')} ({', '.join(host.get('flags', []))})" if host else ""
            )
            at = last.get("ended")
            after = sorted(
                n for n, p in state.phases.items() if at and n != name and p.get("ended", "") > at
            )
            when = (
                f" at {at[:19]}; finished after it: {', '.join(after) or 'none yet'}" if at else ""
            )
            out.append(
                f"- **{name} was rebuilt with another loss curve (largest difference "
                f"{last.get('max_loss_diff', float('nan')):.2e}{on}{when})**: phases after the "
                "rebuild that "
                "read its weights started from it, earlier ones from the weights its record "
                "measured (another "
                "CPU kind's kernels round differently)."
            )
    return out
