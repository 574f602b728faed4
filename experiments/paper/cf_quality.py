"""Are LEAFE's corrections good moves? Every rolled-back branch of a Sokoban explore log, judged by
the solver.

A counterfactual sample teaches the policy the branch's first action a'_tau at the state where the
branch left its parent (the cf target, when the branch succeeds). This audit rebuilds that state by
replaying the branch's path (its parent's steps ``0..tau-1``, recursively) in the environment, and
asks the solver which moves there shorten the optimal solution by one (``optimal`` moves; a state
from which the room can no longer be solved has none and is counted apart as ``dead``). Figures per
log:

- ``branches`` and ``cf`` (the successful ones): the share whose first action is optimal, and the
  share whose blamed action (the parent's action at tau) was;
- ``free``: every step the policy took with no experience in its prompt, at its own states: the
  share of optimal moves, the rate a resampled action would be good at anyway;
- ``cf_minus_free``: the cf targets' optimal share minus the free steps', paired by tree.

Shares carry a 95% bootstrap interval over trees (an episode's branches share its room and its
policy's habits, so the tree is the unit drawn); a difference whose interval holds 0 is a tie. A
corrections set whose targets are no better moves than the policy's own is a resampled action that
happened to work out, which distillation can only reinforce as it reinforces rehearsal.

    .venv/bin/python -m experiments.paper.cf_quality LOG... \
        --options '{"height": 7, "width": 7, ...}'
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leafe.envs.base import EnvError
from leafe.envs.sokoban.env import SokobanConfig, SokobanEnv, SokobanSnapshot
from leafe.envs.sokoban.expert import optimal_distance
from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Outcome, Step
from leafe.services.eventlog.fileformat import read_events

__all__ = ["QUALITY_KEYS", "main", "quality_events", "quality_lines", "quality_log"]

UNSOLVABLE = 10**9
DRAWS = 2000
QUALITY_KEYS = ("branch_first", "branch_blamed", "cf_first", "cf_blamed", "free")
"""The judged action sets (see the module docstring)."""


@dataclass
class _Episode:
    task_id: str
    observation: str
    steps: dict[tuple[str, int], Step] = field(default_factory=dict)
    branches: dict[str, Branch] = field(default_factory=dict)
    success: dict[str, bool] = field(default_factory=dict)


def _episodes(events: Iterable[EpisodeEvent]) -> dict[str, _Episode]:
    eps: dict[str, _Episode] = {}
    for e in events:
        if isinstance(e, EpisodeStarted):
            if e.mode == "explore":
                eps[e.episode_id] = _Episode(task_id=e.task_id, observation=e.observation)
            continue
        ep = eps.get(e.episode_id)
        if ep is None:
            continue
        if isinstance(e, Step):
            ep.steps[(e.branch_id, e.t)] = e
        elif isinstance(e, Branch):
            ep.branches[e.branch_id] = e
        elif isinstance(e, Outcome):
            ep.success[e.branch_id] = e.success
    return eps


class _Judge:
    """Replays each branch once in one environment (restoring at its tau) and judges steps by the
    solver: a step is optimal when the state it led to is one move closer to solved (so an invalid
    answer or a walk into a wall, which change nothing, never is)."""

    def __init__(self, env: SokobanEnv) -> None:
        self.env = env
        self._dist: dict[tuple[str, int, frozenset[int]], int] = {}
        self._states: dict[tuple[int, str], list[SokobanSnapshot]] = {}

    def states(self, ep: _Episode, branch: str) -> list[SokobanSnapshot]:
        """The state before each step of ``branch`` and after its last one (its ancestors' up to
        tau)."""
        key = (id(ep), branch)
        if key in self._states:
            return self._states[key]
        b = ep.branches.get(branch)
        if b is None:
            reset = self.env.reset(ep.task_id)
            if reset.observation != ep.observation:
                raise ValueError(
                    f"{ep.task_id}: the log's first observation is not this environment's room: "
                    "the options "
                    "given are not the ones the log was collected with"
                )
            out, t = [self.env.snapshot()], 0
        else:
            parent = self.states(ep, b.parent_branch_id)
            if len(parent) <= b.tau:
                raise ValueError(
                    f"branch {branch} leaves its parent at {b.tau}, after the parent's last step"
                )
            out, t = parent[: b.tau + 1], b.tau
            self.env.restore(out[-1])
        while (step := ep.steps.get((branch, t))) is not None:
            self.env.step(step.action or "")
            out.append(self.env.snapshot())
            t += 1
        self._states[key] = out
        return out

    def _distance(self, s: SokobanSnapshot) -> int:
        key = (s.task_id, s.player, s.boxes)
        if key not in self._dist:
            self._dist[key] = optimal_distance(s.room, s.player, s.boxes)
        return self._dist[key]

    def step(self, ep: _Episode, branch: str, t: int) -> tuple[bool, bool] | None:
        """``(optimal, dead_state)`` of step ``t`` on ``branch``'s path (its own or an ancestor's;
        dead: no move could solve the room), or None if the path has no step ``t``."""
        states = self.states(ep, branch)
        if len(states) <= t + 1:
            return None
        before = self._distance(states[t])
        dead = before >= UNSOLVABLE or states[t].done
        return (not dead and self._distance(states[t + 1]) == before - 1), dead


def _judged(ep: _Episode, judge: _Judge) -> dict[str, list[tuple[bool, bool]]]:
    """Per action set, ``(optimal, dead_state)`` of each judged step of one tree."""
    out: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for b in ep.branches.values():
        if (b.branch_id, b.tau) not in ep.steps:
            continue
        judged = [("branch_first", b.branch_id), ("branch_blamed", b.parent_branch_id)]
        if ep.success.get(b.branch_id, False):
            judged += [("cf_first", b.branch_id), ("cf_blamed", b.parent_branch_id)]
        for key, branch in judged:
            if (verdict := judge.step(ep, branch, b.tau)) is not None:
                out[key].append(verdict)
    for (branch, t), step in ep.steps.items():
        if not step.experience_in_context and (verdict := judge.step(ep, branch, t)) is not None:
            out["free"].append(verdict)
    return out


def _share(per_tree: list[tuple[int, int]], rng: np.random.Generator) -> dict[str, Any]:
    k = np.array([a for a, _ in per_tree], dtype=float)
    n = np.array([b for _, b in per_tree], dtype=float)
    if n.sum() == 0:
        return {"n": 0, "optimal": 0, "share": None, "interval": None}
    idx = rng.integers(0, len(n), size=(DRAWS, len(n)))
    lo, hi = (float(x) for x in np.nanpercentile(_ratio(k[idx], n[idx]), [2.5, 97.5]))
    share = round(float(k.sum() / n.sum()), 4)
    return {
        "n": int(n.sum()),
        "optimal": int(k.sum()),
        "share": share,
        "interval": [round(lo, 4), round(hi, 4)],
    }


def _ratio(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per bootstrap draw (row), optimal over judged; NaN for a draw of trees with nothing
    judged."""
    total = n.sum(1)
    return np.divide(k.sum(1), total, out=np.full(len(total), np.nan), where=total > 0)


def _difference(
    a: list[tuple[int, int]], b: list[tuple[int, int]], rng: np.random.Generator
) -> dict[str, Any]:
    """Share of ``a`` minus share of ``b``, both from the same trees (paired bootstrap over
    trees)."""
    pairs = np.array([(*p, *q) for p, q in zip(a, b, strict=True)], dtype=float).reshape(-1, 4)
    ka, na, kb, nb = pairs.T
    if na.sum() == 0 or nb.sum() == 0:
        return {"diff": None, "interval": None, "verdict": "no data"}
    idx = rng.integers(0, len(na), size=(DRAWS, len(na)))
    draws = _ratio(ka[idx], na[idx]) - _ratio(kb[idx], nb[idx])
    lo, hi = (float(x) for x in np.nanpercentile(draws, [2.5, 97.5]))
    verdict = "higher" if lo > 0 else "lower" if hi < 0 else "tie (the interval holds 0)"
    diff = float(ka.sum() / na.sum() - kb.sum() / nb.sum())
    return {"diff": round(diff, 4), "interval": [round(lo, 4), round(hi, 4)], "verdict": verdict}


def quality_events(
    events: Iterable[EpisodeEvent], env: SokobanEnv, *, seed: int = 0
) -> dict[str, Any]:
    """The figures of one explore log's events (see the module docstring)."""
    judge = _Judge(env)
    trees = [_judged(ep, judge) for ep in _episodes(events).values()]
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"trees": len(trees)}
    counts: dict[str, list[tuple[int, int]]] = {}
    for key in QUALITY_KEYS:
        counts[key] = [(sum(o for o, _ in t.get(key, [])), len(t.get(key, []))) for t in trees]
        out[key] = _share(counts[key], rng)
        out[key]["dead_state"] = sum(d for t in trees for _, d in t.get(key, []))
    out["cf_minus_free"] = _difference(counts["cf_first"], counts["free"], rng)
    out["cf_minus_blamed"] = _difference(counts["cf_first"], counts["cf_blamed"], rng)
    return out


def quality_log(path: Path, options: Mapping[str, Any], *, seed: int = 0) -> dict[str, Any]:
    """:func:`quality_events` of the log at ``path``, the rooms built with Sokoban ``options``."""
    env = SokobanEnv(SokobanConfig(**dict(options)))
    return {"log": path.name, **quality_events(read_events(path), env, seed=seed)}


_CACHE: dict[tuple[str, float, str], dict[str, Any]] = {}
"""Audits by (log, mtime, options): the report is rendered after every phase."""
ROWS = (
    ("cf_first", "cf targets (the first action of a solved branch)"),
    ("cf_blamed", "the actions those branches replaced (the parent's at tau)"),
    ("branch_first", "first action of every rolled-back branch"),
    ("free", "the policy's own steps (no e in the prompt)"),
)


def quality_lines(
    cfg: Any, state: Any, runs: tuple[str, ...] = ("explore-model", "explore-oracle")
) -> list[str]:
    """The report's section: the solver's verdict on each Stage 1 run's corrections (Sokoban
    only)."""
    from experiments.paper.config import ROLLOUT_KEYS

    chosen = state.phases.get("select-rooms" if cfg.effect.rooms else "select-sft")
    if cfg.env != "sokoban" or not chosen:
        return []
    try:
        variant = cfg.room_variant(str(chosen["variant"]))
    except KeyError as e:
        return [f"(the corrections' audit needs the chosen rooms: {e})", ""]
    options = {k: v for k, v in variant.items() if k not in ROLLOUT_KEYS}
    lines = [
        "| run | judged actions | n | optimal, % | 95% interval | in a dead state |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for run in runs:
        log = Path(str(state.phases.get(run, {}).get("log_file", "")))
        if not log.is_file():
            continue
        key = (str(log), log.stat().st_mtime, json.dumps(options, sort_keys=True))
        if key not in _CACHE:
            try:
                _CACHE[key] = quality_log(log, options)
            except (
                ValueError,
                KeyError,
                EnvError,
            ) as e:  # the report is rendered after every phase
                verdicts.append(f"- {run}: not judged: {e}")
                continue
        q = _CACHE[key]
        for k, what in ROWS:
            r = q[k]
            lo, hi = r["interval"] or (None, None)
            lines.append(
                f"| {run} | {what} | {r['n']} | {_pct(r['share'])} | [{_pct(lo)}, {_pct(hi)}] | "
                f"{r['dead_state']} |"
            )
        for k, what in (
            ("cf_minus_blamed", "the actions they replaced"),
            ("cf_minus_free", "the policy's own"),
        ):
            d = q[k]
            if d["diff"] is not None:
                lo, hi = d["interval"]
                verdicts.append(
                    f"- {run}: cf targets minus {what}: {100 * d['diff']:+.1f} points "
                    f"[{100 * lo:+.1f}, "
                    f"{100 * hi:+.1f}], {d['verdict']}."
                )
    if len(lines) == 2 and not verdicts:
        return []
    return [
        "## Are the corrections good moves? (the solver's verdict, "
        "`experiments/paper/cf_quality.py`)",
        "",
        "An action is optimal when it brings the room one move closer to solved; intervals are "
        "bootstrapped "
        "over trees.",
        "",
        *lines,
        "",
        *verdicts,
        "",
    ]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument(
        "--options", required=True, help="the Sokoban options (JSON) the logs were collected with"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    options = json.loads(args.options)
    results = [quality_log(path, options) for path in args.logs]
    for r in results:
        print(json.dumps(r))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
