"""Cost estimates of a paper-table plan from the unit costs a finished (smaller) run measured.

Unit costs (:func:`unit_costs`), from the finished phases of one run:

- evaluation: seconds per episode (the SR row separately: it reasons before it answers);
- collection: seconds per episode and policy actions per episode, per kind (``demo``, ``early`` =
  demo with alternatives, ``rollout``, ``explore``);
- training: ``wall = overhead + tokens / rate``, fitted by least squares over every finished
  training (``tokens`` = real tokens over all steps), plus per materializer the samples per
  collected episode and tokens per sample-epoch.

:func:`estimate_plan` applies them to another config's plan (e.g.
``experiments/configs/paper_full.toml``): an estimate, not a measurement; it assumes the same
machine load and that episodes cost what they cost in the smaller run (a policy that solves more
tasks ends its episodes sooner).
"""

from __future__ import annotations

from typing import Any

from experiments.paper.config import PaperConfig
from experiments.paper.phases import CollectSpec, EvalSpec, Phase, ProbeSpec, TrainSpec
from experiments.paper.plans import plan

__all__ = ["estimate_lines", "estimate_plan", "estimate_table", "unit_costs"]


def _collect_kind(spec: CollectSpec) -> str:
    return "early" if spec.mode == "demo" and spec.demo else spec.mode


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``wall = a + tokens * b`` (a, b >= 0); one point: a = 0."""
    if not points:
        return 0.0, 0.0
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        x, y = max(points)
        return 0.0, y / max(1.0, x)
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    return max(0.0, my - b * mx), b


def unit_costs(state: Any) -> dict[str, Any]:
    """Unit costs from ``state``'s finished phases (see the module docstring)."""
    ev: dict[str, list[float]] = {"eval": [0.0, 0.0], "sr": [0.0, 0.0]}
    col: dict[str, list[float]] = {}
    points: list[tuple[float, float]] = []
    per_mat: dict[str, list[float]] = {}
    for p in state.plan:
        r = state.phases.get(p.name)
        if r is None:
            continue
        spec = p.spec
        if isinstance(spec, EvalSpec):
            acc = ev["sr" if spec.rollout.get("response_prefix") else "eval"]
            acc[0] += float(r["wall_s"])
            acc[1] += int(r["episodes"])
        elif isinstance(spec, CollectSpec):
            acc = col.setdefault(_collect_kind(spec), [0.0, 0.0, 0.0])
            acc[0] += float(r["wall_s"])
            acc[1] += int(r["episodes"])
            acc[2] += int(r["actions"])
        elif isinstance(spec, TrainSpec) and r.get("final"):
            points.append((float(r["tokens"]), float(r["wall_s"])))
            data = state.phases.get(spec.data, {})
            m = per_mat.setdefault(spec.materializer, [0.0, 0.0, 0.0, 0.0])
            m[0] += int(r["samples"])
            m[1] += max(1, int(data.get("episodes", 1)))
            m[2] += float(r["tokens"])
            m[3] += int(r.get("trained_samples") or int(r["samples"]) * int(r["epochs"]))
    overhead, per_token = _fit(points)
    return {
        "eval_s_per_episode": {k: v[0] / v[1] for k, v in ev.items() if v[1]},
        "collect": {
            k: {"s_per_episode": v[0] / max(1, v[1]), "actions_per_episode": v[2] / max(1, v[1])}
            for k, v in col.items()
        },
        "train": {"overhead_s": overhead, "s_per_token": per_token},
        "materializers": {
            k: {"samples_per_episode": v[0] / v[1], "tokens_per_sample_epoch": v[2] / max(1, v[3])}
            for k, v in per_mat.items()
        },
    }


def _episodes(cfg: PaperConfig, spec: CollectSpec, units: dict[str, Any]) -> float:
    if spec.tasks == "rl":
        tasks = cfg.train_tasks
    else:
        tasks = (
            cfg.max_demos
            if spec.tasks == "demos"
            else sorted(cfg.warm.demo_counts)[len(cfg.warm.demo_counts) // 2]
        )
    samples = spec.samples
    if spec.match_actions_of:  # independent sampling at the tree's budget
        c = units["collect"]
        tree = (
            c.get("explore", {}).get("actions_per_episode", cfg.horizon) * cfg.leafe.explore_samples
        )
        samples = max(
            1, round(tree / max(1.0, c.get("rollout", {}).get("actions_per_episode", cfg.horizon)))
        )
    return float(tasks * samples)


def _data_episodes(
    cfg: PaperConfig, phases: dict[str, Phase], spec: TrainSpec, units: dict[str, Any]
) -> float:
    data = phases[spec.data].spec
    assert isinstance(data, CollectSpec)
    n = _episodes(cfg, data, units)
    if spec.demos:  # SFT on the first n of the demonstrations
        n = min(n, float(spec.demos) if isinstance(spec.demos, int) else n)
    return n


def estimate_plan(cfg: PaperConfig, units: dict[str, Any]) -> list[tuple[Phase, float | None]]:
    """Estimated seconds of every phase of ``cfg``'s plan (``None``: no unit cost measured for
    it)."""
    phases = {p.name: p for p in plan(cfg)}
    out: list[tuple[Phase, float | None]] = []
    ev = units["eval_s_per_episode"]
    for p in phases.values():
        spec, sec = p.spec, None
        if isinstance(spec, EvalSpec):
            per = ev.get("sr" if spec.rollout.get("response_prefix") else "eval", ev.get("eval"))
            tasks, samples = (
                (cfg.val_tasks, cfg.val_samples)
                if spec.split == "val"
                else (cfg.test_tasks, cfg.eval_samples)
            )
            sec = None if per is None else per * tasks * samples
        elif isinstance(spec, CollectSpec):
            c = units["collect"].get(_collect_kind(spec))
            sec = None if c is None else c["s_per_episode"] * _episodes(cfg, spec, units)
        elif isinstance(spec, TrainSpec):
            m = units["materializers"].get(spec.materializer)
            if m is not None:
                epochs = cfg.warm.epochs if isinstance(spec.epochs, str) else spec.epochs
                samples = m["samples_per_episode"] * _data_episodes(cfg, phases, spec, units)
                trained = samples * epochs
                if cfg.training.max_steps and not spec.export_epochs:
                    trained = min(
                        trained, cfg.training.max_steps * (cfg.training.global_batch or 16)
                    )
                tokens = trained * m["tokens_per_sample_epoch"]
                sec = units["train"]["overhead_s"] + tokens * units["train"]["s_per_token"]
        elif isinstance(spec, ProbeSpec):
            sec = ev.get("eval", 0.0) * cfg.probe.tasks * cfg.probe.samples
        else:
            sec = 0.0
        out.append((p, sec))
    return out


def estimate_table(cfg: PaperConfig, units: dict[str, Any]) -> list[str]:
    """A markdown table of :func:`estimate_plan` with stage totals."""
    rows = estimate_plan(cfg, units)
    lines = [
        f"Estimated wall time of `{cfg.name}` from these unit costs:",
        "",
        "| phase | stage | est. min |",
        "|---|---|---|",
    ]
    stages: dict[str, float] = {}
    for p, sec in rows:
        lines.append(f"| {p.name} | {p.stage} | {'?' if sec is None else f'{sec / 60:.0f}'} |")
        stages[p.stage] = stages.get(p.stage, 0.0) + (sec or 0.0)
    total = sum(stages.values())
    unknown = [p.name for p, sec in rows if sec is None]
    lines += [
        "",
        "By stage: "
        + ", ".join(f"{k} {v / 3600:.1f} h" for k, v in stages.items())
        + f"; total {total / 3600:.1f} h.",
    ]
    if unknown:
        lines.append(f"No unit cost measured for: {', '.join(unknown)} (not in the total).")
    return lines


def estimate_lines(cfg: PaperConfig, state: Any) -> list[str]:
    """The report's section: the unit costs this run measured."""
    if not state.phases:
        return ["(no phase finished yet)"]
    u = unit_costs(state)
    ev = ", ".join(f"{k} {v:.1f} s/episode" for k, v in u["eval_s_per_episode"].items())
    col = ", ".join(
        f"{k} {v['s_per_episode']:.1f} s/episode ({v['actions_per_episode']:.1f} actions)"
        for k, v in u["collect"].items()
    )
    tr = u["train"]
    mats = ", ".join(
        f"{k} {v['samples_per_episode']:.2f} samples/episode, {v['tokens_per_sample_epoch']:.0f} "
        "tokens/sample"
        for k, v in u["materializers"].items()
    )
    return [
        f"- Evaluation: {ev or '-'}.",
        f"- Collection: {col or '-'}.",
        f"- Training: {tr['overhead_s']:.0f} s per training + "
        f"{1 / tr['s_per_token'] if tr['s_per_token'] else 0:.0f} "
        f"tokens/s (least squares over the finished trainings); {mats or '-'}.",
        "- `python -m experiments.paper_table --scale <this> --estimate "
        "experiments/configs/paper_full.toml` applies these to another "
        "config (`experiments/paper/estimate.py`).",
    ]
