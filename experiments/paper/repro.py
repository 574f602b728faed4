"""The reproduction script of a paper-table run: every training set rebuilt from the committed logs,
every row retrained and evaluated, with the exact settings the run used.

``<report_name>_repro.sh`` (written next to the report) has, for each finished training phase in
plan order, ``leafe replay --from
experiments/results/paper_logs/<experiment>/<collection>.leafelog.gz`` with the phase's materializer
options (the experiment an inherited phase ran in), the phase's filter (sample kinds, first n
demonstrations), the datasets mixed into it (each replayed, then all combined in the run's order),
and ``leafe train`` with its recorded trainer table and flags and the run's thread count (the
learner's arithmetic depends on it), starting from the weights the run started it from (paths under
the run's work dir are rewritten to ``$OUT``, the base model's export to ``$MODEL``, so choices made
on validation are replayed, not re-made); then ``leafe eval`` of every evaluated row with the
protocol's tasks, seeds and rollout settings. Collections themselves are not re-run (the logs are
the source of truth; ``experiments/paper_table.py`` re-collects).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from experiments.paper.config import PaperConfig
from experiments.paper.phases import EvalSpec, TrainSpec

__all__ = ["repro_script"]


def _toml(table: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(table)


def pinned_trainer(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded training's config with ``[trainer.loss] dual_clip`` pinned: a record without it
    was trained before the learner's default became 3, with the dual clip off (0)."""
    trainer = dict(config.get("trainer", {}))
    loss = dict(trainer.get("loss", {}))
    loss.setdefault("dual_clip", 0.0)
    return {**config, "trainer": {**trainer, "loss": loss}}


BASE_EXPORT = "base-weights"
"""The base model exported under the work dir (``runner._base_export``): the same weights as
``$MODEL``."""


def _path(value: str, work: str, base: str) -> str:
    """``value`` as the script names it: the base model (or its export under the work dir) is
    ``$MODEL``, anything else under the work dir (given relative or absolute) is under ``$OUT``."""
    root, path = Path(work).resolve(), Path(value).resolve()
    if value == base or path == Path(base).resolve() or path == root / BASE_EXPORT:
        return "$MODEL"
    return "$OUT/" + str(path.relative_to(root)) if path.is_relative_to(root) else value


def _log(path: str) -> str:
    """A collection's exported log as the script names it: ``$LOGS/<experiment>/<file>`` (an
    inherited phase's log is the other experiment's)."""
    log = Path(path)
    return f"$LOGS/{log.parent.name}/{log.name}"


def _replay(
    name: str, log: str, materializer: str, options: dict[str, Any], out: str, conf: str
) -> list[str]:
    return [
        f"cat > $OUT/{name}/{conf}.toml <<'EOF'\n{_toml({'options': dict(options)})}EOF",
        f"leafe replay --from {_log(log)} --materializer {materializer} --model $MODEL --out {out} "
        f"--config $OUT/{name}/{conf}.toml --no-progress",
    ]


def _train_lines(
    cfg: PaperConfig,
    state: Any,
    name: str,
    spec: TrainSpec,
    r: dict[str, Any],
    work: str,
    base: str,
) -> list[str]:
    data = f"$OUT/{name}/dataset"
    lines = [
        f"# {name}: {spec.materializer} over {spec.data}, from {spec.start}; {r['samples']} "
        f"samples {r['kinds']}",
        f"mkdir -p $OUT/{name}/train",
        *_replay(name, r["source_log"], spec.materializer, dict(spec.options), data, "replay"),
    ]
    if spec.kinds or r.get("demos"):
        first = cfg.demo_offset
        ids = (
            f"[f'{cfg.env}/train/{{i}}' for i in range({first}, {first + int(r.get('demos', 0))})]"
        )
        tasks = ids if r.get("demos") else "[]"
        lines.append(
            'python -c "from pathlib import Path; from experiments.paper.children import '
            "filter_samples; "
            f"print(filter_samples(Path('{data}'), Path('{data}-filtered'), "
            f"kinds={list(spec.kinds)!r}, "
            f'task_ids={tasks}))"'
        )
        data += "-filtered"
    if spec.mix:  # more datasets trained together with the first, combined in the run's order
        parts = [data]
        for i, part in enumerate(spec.mix):
            parts.append(f"$OUT/{name}/dataset-mix{i}")
            log = state.phases[part.data]["log_file"]
            lines += _replay(
                name, log, part.materializer, dict(part.options), parts[-1], f"replay-mix{i}"
            )
        data = f"$OUT/{name}/dataset-mixed"
        lines.append(
            'python -c "from pathlib import Path; from experiments.paper.children import combine; '
            f"print(combine([Path(p) for p in {parts!r}], Path('{data}')))\""
        )
    if not r.get("final"):
        return [*lines, f"# (not trained: {r.get('note', '')})", ""]
    start = _path(r.get("start_weights", spec.start), work, base)
    beta = f" --beta {spec.beta}" if spec.beta is not None else ""
    lines += [
        f"cat > $OUT/{name}/train/train.toml <<'EOF'\n{_toml(pinned_trainer(r['config']))}EOF",
        f"leafe train --data {data} --model {start} --out $OUT/{name}/train --preset "
        f"{cfg.training.preset} "
        f"--config $OUT/{name}/train/train.toml --lr {r['lr']} --epochs {r['epochs']}{beta} "
        f"--threads {cfg.training.threads}",
        "",
    ]
    return lines


def _eval_line(
    cfg: PaperConfig, name: str, spec: EvalSpec, r: dict[str, Any], work: str, base: str
) -> str:
    env_opts = " ".join(
        f"--env-option {shlex.quote(f'{k}={json.dumps(v)}')}" for k, v in r["env_options"].items()
    )
    roll = " ".join(
        f"--rollout-option {shlex.quote(f'{k}={json.dumps(v)}')}"
        for k, v in r["rollout_overrides"].items()
    )
    ks = ",".join(str(k) for k in cfg.ks if k <= r["samples"])
    return (
        f"leafe eval --model {_path(r['model'], work, base)} --label {name} --env {cfg.env} "
        f"{env_opts} {roll} "
        f"--split {r['split']} --tasks {len(r['task_ids'])} --task-offset "
        f"{cfg.val_offset if spec.split == 'val' else cfg.test_offset} --samples {r['samples']} "
        f"--k {ks} "
        f"--seed {r['seed']} --out $OUT/{name}"
    )


def repro_script(cfg: PaperConfig, state: Any, work: Path, base_model: str) -> str:
    """The shell script (see the module docstring)."""
    w = str(work)
    out = [
        "#!/usr/bin/env bash",
        f"# Rebuild every training set of the paper table `{cfg.name}` from its committed logs, "
        "retrain every row",
        "# with the settings the run used, and evaluate it (docs/experiments.md). Run from the "
        "repository root.",
        "set -euo pipefail",
        "LOGS=${LOGS:-experiments/results/paper_logs}",
        f"OUT=${{OUT:-runs/paper-repro/{cfg.name}}}",
        f"MODEL=${{MODEL:-{cfg.model}}}",
        'leafe() { python -m leafe.services.cli "$@"; }',
        "",
    ]
    for p in state.plan:
        r = state.phases.get(p.name)
        if r is not None and isinstance(p.spec, TrainSpec):
            out += _train_lines(cfg, state, p.name, p.spec, r, w, base_model)
    out.append("# evaluations (validation slice and test rows)")
    for p in state.plan:
        r = state.phases.get(p.name)
        if r is not None and isinstance(p.spec, EvalSpec):
            out.append(_eval_line(cfg, p.name, p.spec, r, w, base_model))
    return "\n".join(out) + "\n"
