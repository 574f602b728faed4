"""The reflector's audit, judged at each branch's own state (issue #61 item 3).

Every rolled-back branch of a Sokoban explore log starts from the state its parent's path reached
before step tau (the rollback point), and its first step carries the reflection's e. This audit
rebuilds that state (replaying the parent's path, ancestors included, as
:mod:`experiments.paper.cf_quality` does) and asks the solver, per reflection that opened a branch:

- ``legal``: the move e names ("move X", the last one; :func:`_named_move`) changes the state there
  (a walk or a push; not a bump into a wall or a box that cannot move). Chance: the share of the
  four moves that are legal at that state (``chance_legal``).
- ``fix``: the named move is solver-optimal there (one move closer to solved). Chance: the share of
  the four moves that are (``chance_fix``), and of the legal moves that are (``chance_fix_legal``).
- ``mistake``: the blamed step (the parent's action at tau, from that state) was not optimal (it
  did not bring the room one move closer: a real mistake); ``worse``: it made the optimal solution
  longer (or the room unsolvable). Chance: the share of non-optimal steps on the reflected path
  ``0..at_t-1`` (a tau drawn uniformly there, ``chance_mistake``).
- ``label_fix``: the shipped comparison, e's move against the oracle label's move at the *oracle's*
  tau (only model reflections with an oracle label), and ``same_state``: the oracle's tau is the
  branch's tau, so both are judged at one state.

Shares are over branches whose e names a move (``legal``, ``fix``; ``named`` is the share that name
one at all) or whose blamed step exists (``mistake``), split by the branch's outcome, each with a
95% bootstrap interval over trees (a tree's branches share its room and the policy's habits).
A state from which the room can no longer be solved (``dead``) has no optimal move: its branches
count as not fixed, and are counted apart.

One record per reflection (JSONL) holds every field a share is counted from, so the shares can be
recounted without this code (``--records``).

    .venv/bin/python -m experiments.paper.reflector_audit \\
        --model experiments/results/paper_logs/effect-hard/explore-model.leafelog.gz \\
        --oracle experiments/results/paper_logs/effect-hard/explore-oracle.leafelog.gz \\
        --options '{"height": 7, "width": 7, "num_boxes": 1, "min_solution_len": 5, \\
                    "max_solution_len": 12, "max_steps": 30}' \\
        --out experiments/results/reflector_audit_r0
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.paper.cf_quality import UNSOLVABLE, _Episode, _Judge
from experiments.paper.follow_audit import _named_move
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv, SokobanSnapshot
from leafe.envs.sokoban.solver import ACTIONS, apply_move, solve
from leafe.protocol.events import (
    Branch,
    EpisodeEvent,
    EpisodeStarted,
    Outcome,
    Reflection,
    Step,
)
from leafe.services.eventlog.fileformat import read_events

__all__ = [
    "SHARES",
    "audit_records",
    "judge_records",
    "main",
    "read_records",
    "reflector_lines",
    "render_markdown",
    "summarize",
    "write_outputs",
]

DRAWS = 2000
_STATE_CAP = 200_000
"""The oracle's solver budget (:mod:`leafe.envs.sokoban.expert`)."""
LEGAL = ("moved", "pushed")
"""What :func:`apply_move` reports for a move that changes the state."""
SHARES: dict[str, tuple[str, str, str]] = {
    # share: (numerator field, the records it is counted over, its chance field)
    "named": ("named", "branch", ""),
    "legal": ("legal", "named", "chance_legal"),
    "fix": ("fix", "branch", "chance_fix"),
    "optimal": ("optimal", "branch", "chance_optimal"),
    "mistake": ("mistake", "blamed", "chance_mistake"),
    "worse": ("worse", "blamed", ""),
    "label_fix": ("label_fix", "labelled", ""),
}
"""Each share: the record field counted, the records it is counted over (``branch``: every branch
opened; ``named``: those whose e names a move; ``blamed``: those whose blamed step exists;
``labelled``: model reflections whose oracle label names a move) and its chance level's field."""


class _Tree(_Episode):
    reflections: list[Reflection]

    def __init__(self, task_id: str, observation: str) -> None:
        super().__init__(task_id=task_id, observation=observation)
        self.reflections = []


def _trees(events: Iterable[EpisodeEvent]) -> dict[str, _Tree]:
    trees: dict[str, _Tree] = {}
    for e in events:
        if isinstance(e, EpisodeStarted):
            if e.mode == "explore":
                trees[e.episode_id] = _Tree(e.task_id, e.observation)
            continue
        tree = trees.get(e.episode_id)
        if tree is None:
            continue
        if isinstance(e, Step):
            tree.steps[(e.branch_id, e.t)] = e
        elif isinstance(e, Branch):
            tree.branches[e.branch_id] = e
        elif isinstance(e, Outcome):
            tree.success[e.branch_id] = e.success
        elif isinstance(e, Reflection):
            tree.reflections.append(e)
    return trees


class _Solver:
    """Solver distances and move verdicts at snapshots (cached by state)."""

    def __init__(self, judge: _Judge) -> None:
        self.judge = judge
        self._moves: dict[tuple[str, int, frozenset[int]], dict[str, tuple[bool, bool]]] = {}
        self._plan: dict[tuple[str, int, frozenset[int]], str] = {}

    def distance(self, s: SokobanSnapshot) -> int:
        return self.judge._distance(s)

    def plan_move(self, s: SokobanSnapshot) -> str:
        """The first move of the solver's one optimal plan from ``s`` ("" when none): the move the
        oracle's e would name there."""
        key = (s.task_id, s.player, s.boxes)
        if key not in self._plan:
            plan = solve(s.room.with_state(s.player, s.boxes), max_states=_STATE_CAP)
            self._plan[key] = plan[0] if plan else ""
        return self._plan[key]

    def moves(self, s: SokobanSnapshot) -> dict[str, tuple[bool, bool]]:
        """Per move of the four: (legal, optimal) at ``s``."""
        key = (s.task_id, s.player, s.boxes)
        if key not in self._moves:
            before = self.distance(s)
            out = {}
            for m in ACTIONS:
                player, boxes, what = apply_move(s.room, s.player, s.boxes, m)
                after = self.distance(
                    SokobanSnapshot(task_id=s.task_id, room=s.room, player=player, boxes=boxes)
                )
                out[m] = (what in LEGAL, before < UNSOLVABLE and after == before - 1)
            self._moves[key] = out
        return self._moves[key]


def judge_records(
    events: Iterable[EpisodeEvent], env: SokobanEnv, *, log: str = ""
) -> list[dict[str, Any]]:
    """One record per Reflection of an explore episode (see the module docstring)."""
    judge = _Judge(env)
    solver = _Solver(judge)
    records: list[dict[str, Any]] = []
    for episode_id, tree in _trees(events).items():
        opened = {b.reflection_event_id: b for b in tree.branches.values()}
        for r in tree.reflections:
            b = opened.get(r.event_id)
            # the e the branch's prompt carried (a reflection that did not parse cleanly may
            # still open a branch with its e)
            named = _named_move(r.experience if b is None else b.experience, ACTIONS)
            rec: dict[str, Any] = {
                "log": log,
                "episode": episode_id,
                "task": tree.task_id,
                "reflection": r.event_id,
                "source": r.source,
                "parse_ok": r.parse_ok,
                "at_t": r.at_t,
                "tau": r.tau,
                "e": r.experience,
                "named_move": named,
                "oracle_tau": r.oracle_tau,
                "oracle_move": r.oracle_action,
                "branch_id": None if b is None else b.branch_id,
                "success": None if b is None else tree.success.get(b.branch_id),
            }
            if r.source == "oracle":
                rec["named_move"] = named = r.oracle_action or named
            if b is None:
                records.append(rec)
                continue
            path = judge.states(tree, b.parent_branch_id)
            if len(path) <= b.tau:
                raise ValueError(f"{episode_id}: branch {b.branch_id} leaves after the path's end")
            state = path[b.tau]
            moves = solver.moves(state)
            dead = solver.distance(state) >= UNSOLVABLE
            blamed = tree.steps.get(_owner(tree, b.parent_branch_id, b.tau))
            rec.update(
                dead=dead,
                legal_moves=sorted(m for m, (ok, _) in moves.items() if ok),
                optimal_moves=sorted(m for m, (_, opt) in moves.items() if opt),
                first_move=_first_action(tree, b),
                plan_move=solver.plan_move(state),
            )
            rec["named"] = bool(named)
            rec["legal"] = moves[named][0] if named else None
            rec["fix"] = bool(named) and named == rec["plan_move"]
            rec["optimal"] = bool(named) and moves[named][1]
            rec["chance_legal"] = len(rec["legal_moves"]) / len(ACTIONS)
            rec["chance_fix"] = 1 / len(ACTIONS) if rec["plan_move"] else 0.0
            rec["chance_optimal"] = len(rec["optimal_moves"]) / len(ACTIONS)
            rec["chance_fix_legal"] = len(rec["optimal_moves"]) / max(1, len(rec["legal_moves"]))
            if blamed is not None and len(path) > b.tau + 1:
                before, after = solver.distance(state), solver.distance(path[b.tau + 1])
                rec["blamed_move"] = blamed.action
                rec["mistake"] = not (before < UNSOLVABLE and after == before - 1)
                rec["worse"] = after > before
            else:
                rec["blamed_move"] = rec["mistake"] = rec["worse"] = None
            reflected = judge.states(tree, r.branch_id)
            steps = [
                solver.distance(reflected[t + 1]) != solver.distance(reflected[t]) - 1
                or solver.distance(reflected[t]) >= UNSOLVABLE
                for t in range(min(r.at_t, len(reflected) - 1))
            ]
            rec["chance_mistake"] = sum(steps) / len(steps) if steps else None
            if r.source == "model" and r.oracle_action:
                rec["label_fix"] = named == r.oracle_action
                rec["same_state"] = r.oracle_tau == b.tau
            records.append(rec)
    return records


def _owner(tree: _Tree, branch: str, t: int) -> tuple[str, int]:
    """The (branch, t) key of step ``t`` on ``branch``'s path: its own, or the ancestor's that
    took it."""
    while (branch, t) not in tree.steps and branch in tree.branches:
        b = tree.branches[branch]
        if t >= b.tau:
            break
        branch = b.parent_branch_id
    return branch, t


def _first_action(tree: _Tree, b: Branch) -> str | None:
    step = tree.steps.get((b.branch_id, b.tau))
    return None if step is None else step.action


def _over(rec: dict[str, Any], over: str) -> bool:
    if rec.get("branch_id") is None:
        return False
    return {
        "branch": True,
        "named": bool(rec.get("named")),
        "blamed": rec.get("mistake") is not None,
        "labelled": rec.get("label_fix") is not None,
    }[over]


def _share(
    groups: list[list[dict[str, Any]]], field: str, over: str, chance: str, rng: np.random.Generator
) -> dict[str, Any]:
    """Share of ``field`` among the records ``over`` selects, per tree groups, bootstrapped over
    trees; with the mean chance level beside it."""
    k = np.array([sum(bool(r[field]) for r in g if _over(r, over)) for g in groups], dtype=float)
    n = np.array([sum(_over(r, over) for r in g) for g in groups], dtype=float)
    out: dict[str, Any] = {"n": int(n.sum()), "k": int(k.sum()), "share": None, "interval": None}
    if n.sum() == 0:
        return out
    idx = rng.integers(0, len(n), size=(DRAWS, len(n)))
    tot = n[idx].sum(1)
    draws = np.divide(k[idx].sum(1), tot, out=np.full(DRAWS, np.nan), where=tot > 0)
    lo, hi = np.nanpercentile(draws, [2.5, 97.5])
    out["share"] = round(float(k.sum() / n.sum()), 4)
    out["interval"] = [round(float(lo), 4), round(float(hi), 4)]
    if chance:
        levels = [r[chance] for g in groups for r in g if _over(r, over) and r[chance] is not None]
        out["chance"] = round(float(np.mean(levels)), 4) if levels else None
    return out


def summarize(records: Sequence[dict[str, Any]], *, seed: int = 0) -> dict[str, Any]:
    """The shares of one set of records (one log), overall and split by branch outcome."""
    rng = np.random.default_rng(seed)
    trees: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        trees.setdefault(r["episode"], []).append(r)
    branches = [r for r in records if r.get("branch_id") is not None]
    out: dict[str, Any] = {
        "trees": len(trees),
        "reflections": len(records),
        "parsed": sum(bool(r["parse_ok"]) for r in records),
        "branches": len(branches),
        "branches_succeeded": sum(bool(r["success"]) for r in branches),
        "dead_start": sum(bool(r.get("dead")) for r in branches),
        "same_state_as_label": sum(bool(r.get("same_state")) for r in branches),
        "labelled": sum(r.get("label_fix") is not None for r in branches),
    }
    for split, keep in (
        ("all", lambda r: True),
        ("succeeded", lambda r: bool(r.get("success"))),
        ("failed", lambda r: not r.get("success")),
    ):
        groups = [[r for r in g if keep(r)] for g in trees.values()]
        out[split] = {
            name: _share(groups, field, over, chance, rng)
            for name, (field, over, chance) in SHARES.items()
        }
        fix_legal = [r["chance_fix_legal"] for g in groups for r in g if _over(r, "named")]
        out[split]["optimal"]["chance_among_legal"] = (
            round(float(np.mean(fix_legal)), 4) if fix_legal else None
        )
    return out


def audit_records(
    logs: Mapping[str, Path], options: Mapping[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Records and figures of each named log (``{"model": path, "oracle": path}``)."""
    env = SokobanEnv(SokobanConfig(**dict(options)))
    figures: dict[str, Any] = {"options": dict(options)}
    records: list[dict[str, Any]] = []
    for name, path in logs.items():
        recs = judge_records(read_events(path), env, log=name)
        figures[name] = {"log": str(path), **summarize(recs)}
        records += recs
    return figures, records


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def render_markdown(figures: Mapping[str, Any]) -> str:
    """The audit as a markdown table: each share by source and branch outcome, with chance."""
    lines = [
        "# The reflector's audit, judged at each branch's own state",
        "",
        "Made by `experiments/paper/reflector_audit.py` from the logs named below; every share is "
        "recounted from the per-reflection records beside this file. Shares in %, 95% bootstrap "
        "intervals over trees, chance: the same share for a move drawn uniformly among the four "
        "(mistake: a tau drawn uniformly on the reflected path).",
        "",
    ]
    for name in (k for k in figures if k != "options"):
        f = figures[name]
        lines += [
            f"## {name} e (`{f['log']}`)",
            "",
            f"{f['trees']} trees, {f['reflections']} reflections ({f['parsed']} parsed), "
            f"{f['branches']} branches ({f['branches_succeeded']} succeeded), "
            f"{f['dead_start']} branches from a dead state; "
            f"{f['labelled']} with an oracle label naming a move, "
            f"{f['same_state_as_label']} of them at the label's own tau.",
            "",
            "| share | branches | n | % | 95% interval | chance % |",
            "|---|---|---|---|---|---|",
        ]
        for share in SHARES:
            for split in ("all", "succeeded", "failed"):
                s = f[split][share]
                if not s["n"]:
                    continue
                lo, hi = s["interval"]
                chance = _pct(s.get("chance")) if "chance" in s else ""
                lines.append(
                    f"| {share} | {split} | {s['n']} | {_pct(s['share'])} | "
                    f"[{_pct(lo)}, {_pct(hi)}] | {chance} |"
                )
        lines += [
            "",
            "An optimal move among the legal ones by chance: "
            f"{_pct(f['all']['optimal'].get('chance_among_legal'))}%.",
            "",
        ]
    return "\n".join(lines)


def write_outputs(out: Path, figures: dict[str, Any], records: list[dict[str, Any]]) -> list[Path]:
    """``out``.json, ``out``.md and the records (``out``_records.jsonl, gzip above 2 MB)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    written = [out.with_suffix(".json"), out.with_suffix(".md")]
    written[0].write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    written[1].write_text(render_markdown(figures) + "\n", encoding="utf-8")
    body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    rec = out.parent / f"{out.name}_records.jsonl"
    if len(body) > 2_000_000:
        rec = rec.with_name(rec.name + ".gz")
        rec.write_bytes(gzip.compress(body, mtime=0))
    else:
        rec.write_bytes(body)
    return [*written, rec]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records ``write_outputs`` wrote (plain or gzip)."""
    raw = path.read_bytes()
    text = gzip.decompress(raw) if path.suffix == ".gz" else raw
    return [json.loads(line) for line in text.decode().splitlines() if line]


_CACHE: dict[tuple[str, float, str], dict[str, Any]] = {}
"""Summaries by (log, mtime, options): the report is rendered after every phase."""


def reflector_lines(cfg: Any, state: Any) -> list[str]:
    """The report's section (the fair table, ``effect.own_rehearsal``): the reflector's audit of
    each round's trees, on the held-out audit rooms (``audit-collect`` = round 0, W;
    ``audit-self-rN``) and on the RL rooms (``explore-model``, ``explore-self-rN``)."""
    from experiments.paper.config import ROLLOUT_KEYS

    chosen = state.phases.get("select-rooms" if cfg.effect.rooms else "select-sft")
    if cfg.env != "sokoban" or not cfg.effect.own_rehearsal or not chosen:
        return []
    variant = cfg.room_variant(str(chosen["variant"]))
    options = {k: v for k, v in variant.items() if k not in ROLLOUT_KEYS}
    rounds = range(1, cfg.effect.reflector_rounds + 1)
    runs = [
        ("audit-collect", 0, "audit"),
        ("explore-model", 0, "RL"),
        *((f"audit-self-r{r}", r, "audit") for r in rounds),
        *((f"explore-self-r{r}", r, "RL") for r in rounds),
    ]
    lines = [
        "| round | rooms | branches | fix %, all [95%] | succeeded | failed | chance | "
        "legal % (chance) | tau a real mistake % (chance) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r, rooms in sorted(runs, key=lambda x: (x[1], x[2])):
        log = Path(str(state.phases.get(run, {}).get("log_file", "")))
        if not log.is_file():
            continue
        key = (str(log), log.stat().st_mtime, json.dumps(options, sort_keys=True))
        if key not in _CACHE:
            env = SokobanEnv(SokobanConfig(**options))
            _CACHE[key] = summarize(judge_records(read_events(log), env, log=run))
        f = _CACHE[key]
        a, ok, bad = f["all"], f["succeeded"], f["failed"]
        lo, hi = a["fix"]["interval"] or (None, None)
        lines.append(
            f"| {r} | {rooms} ({run}) | {f['branches']} | {_pct(a['fix']['share'])} "
            f"[{_pct(lo)}, {_pct(hi)}] | {_pct(ok['fix']['share'])} | "
            f"{_pct(bad['fix']['share'])} | {_pct(a['fix'].get('chance'))} | "
            f"{_pct(a['legal']['share'])} ({_pct(a['legal'].get('chance'))}) | "
            f"{_pct(a['mistake']['share'])} ({_pct(a['mistake'].get('chance'))}) |"
        )
    if len(lines) == 2:
        return []
    return [
        "## The reflector's audit, round by round (`experiments/paper/reflector_audit.py`)",
        "",
        "Each branch judged at the state it starts from: fix = e names the solver's move there; "
        "intervals bootstrapped over trees; the records: `python -m "
        "experiments.paper.reflector_audit --model LOG ...`. Target: fix >= 60%, tau a real "
        "mistake >= 80%.",
        "",
        *lines,
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="the model-e Stage 1 log")
    p.add_argument("--oracle", type=Path, help="the oracle-e Stage 1 log")
    p.add_argument("--options", required=True, help="the Sokoban options (JSON) of the logs")
    p.add_argument("--out", type=Path, required=True, help="output stem (.json, .md, records)")
    p.add_argument(
        "--recount", type=Path, default=None, help="summarize these records instead of logs"
    )
    args = p.parse_args(argv)
    options = json.loads(args.options)
    if args.recount is not None:
        records = read_records(args.recount)
        figures: dict[str, Any] = {"options": options}
        for name in dict.fromkeys(r["log"] for r in records):
            figures[name] = {
                "log": name,
                **summarize([r for r in records if r["log"] == name]),
            }
    else:
        logs = {k: v for k, v in (("model", args.model), ("oracle", args.oracle)) if v}
        if not logs:
            p.error("give --model and/or --oracle, or --recount")
        figures, records = audit_records(logs, options)
    for path in write_outputs(args.out, figures, records):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
