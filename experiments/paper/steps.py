"""What each kind of phase does (``experiments/paper/phases.py`` says which, and in what order).

:class:`Steps` resolves a phase's references (weights, room variant, chosen counts and lrs) from the
results of finished phases and runs it: a collection through the actor service, a training through
``leafe replay`` + ``leafe train``, an evaluation through the inference servers, a choice through
``experiments/paper/select.py``. Every result is a plain dict; the runner saves it as ``done.json``.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import msgspec

from experiments.paper import children, lib
from experiments.paper.choices import Choices
from experiments.paper.phases import (
    AuditSpec,
    CollectSpec,
    EvalSpec,
    Phase,
    ProbeSpec,
    SelectSpec,
    TrainSpec,
)

__all__ = ["Steps", "weights_tag"]


def weights_tag(model: Path) -> str:
    """8 hex digits of the export's manifest (``base`` for the shipped model): an evaluation's run
    id names the weights it ran, so re-training never mixes two checkpoints' episodes in one run."""
    manifest = model / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest()[:8] if manifest.is_file() else "base"


class Steps(Choices):
    """Runs phases (collections, trainings, evaluations, the audit, choices); results are plain
    dicts."""

    # --- phases -----------------------------------------------------------------------------------
    async def run(self, phase: Phase) -> dict[str, Any]:
        """Run ``phase``; its result."""
        spec = phase.spec
        if isinstance(spec, CollectSpec):
            return await self.collect(phase.name, spec)
        if isinstance(spec, TrainSpec):
            return await self.train(phase.name, spec)
        if isinstance(spec, EvalSpec):
            return await self.evaluate(phase.name, spec)
        if isinstance(spec, SelectSpec):
            return self.select(spec)
        if isinstance(spec, ProbeSpec):
            return await self.probe(phase.name)
        if isinstance(spec, AuditSpec):
            return await self.audit(phase.name, spec)
        raise TypeError(f"unknown phase spec {spec!r}")

    def _samples(self, spec: CollectSpec, tasks: int) -> int:
        if not spec.match_actions_of:
            return spec.samples
        budget = int(self._need(spec.match_actions_of)["actions"])
        rollouts = self.done(
            "grpo-r1-collect"
        )  # the same weights' rollouts on the same tasks, if run
        per_episode = (
            rollouts["actions"] / max(1, rollouts["episodes"]) if rollouts else self.cfg.horizon
        )
        return max(1, round(budget / (tasks * per_episode)))

    async def collect(self, name: str, spec: CollectSpec) -> dict[str, Any]:
        """Episodes on train tasks with the referenced weights; the log is exported."""
        cfg, env = self.cfg, self.ctx.env
        options = self.env_options(spec.variant)
        ids = self.task_ids("train", *self._task_range(spec.tasks), options)
        samples = self._samples(spec, len(ids))
        model = self.weights(spec.model)
        tag = weights_tag(model)
        await lib.load_weights(self.ctx, model, tag)
        rollout = self._rollout(spec.variant)
        explorer = {**rollout, **spec.explorer}
        actor = {"explorer": {env: explorer}, "rollout": {env: rollout}, "demo": {env: spec.demo}}
        run_id = f"{cfg.prefix}-{name}-{tag}" + (f"-g{samples}" if spec.match_actions_of else "")
        run_id += f"-s{spec.seed_offset}" if spec.seed_offset else ""  # new seeds: new task keys
        out = await lib.collect(
            self.ctx,
            name=name,
            run_id=run_id,
            mode=spec.mode,
            task_ids=ids,
            samples=samples,
            seed=cfg.seed + spec.seed_offset,
            env_options=options,
            actor_overrides=actor,
            timeout_s=cfg.serving.collect_timeout_s,
        )
        return {
            **out,
            "model": str(model),
            "weights_tag": tag,
            "variant": self.variant(spec.variant),
        }

    async def train(self, name: str, spec: TrainSpec) -> dict[str, Any]:
        """Rebuild the dataset from the data phase's exported log (and the mix's), filter it,
        train."""
        cfg, tr, work = self.cfg, self.cfg.training, self.ctx.work / name
        data_phase = f"demos-{self.variant('')}" if spec.data == "demos:chosen" else spec.data
        source = Path(self._need(data_phase)["log_file"])
        data = work / "dataset"
        total = await children.replay(
            source=source,
            materializer=spec.materializer,
            model=self.ctx.base_model,
            out=data,
            options=spec.options,
            threads=tr.threads,
        )
        tasks: list[str] = []
        if spec.demos:
            options = dict(self._need(data_phase)["env_options"])
            tasks = self.task_ids("train", cfg.demo_offset, self._demo_count(spec.demos), options)
        n = total
        if spec.kinds or tasks:
            n = children.filter_samples(
                data, work / "dataset-filtered", kinds=spec.kinds, task_ids=tasks
            )
            data = work / "dataset-filtered"
        parts = [data]
        for i, part in enumerate(spec.mix):
            parts.append(work / f"dataset-mix{i}")
            log_file = Path(self._need(part.data)["log_file"])
            await children.replay(
                source=log_file,
                materializer=part.materializer,
                model=self.ctx.base_model,
                out=parts[-1],
                options=part.options,
                threads=tr.threads,
            )
        if spec.mix:
            data = work / "dataset-mixed"
            n = children.combine(parts, data)
        epochs = (
            int(self._need("select-sft")["epochs"]) if spec.epochs == "sft" else int(spec.epochs)
        )
        batch = children.global_batch(tr.preset, self.trainer_table())
        if spec.steps:  # equal optimizer steps across rows trained on different sample counts
            epochs = max(1, math.ceil(spec.steps * batch / max(1, n)))
        start = self.weights(spec.start)
        head: dict[str, Any] = {
            "source_log": str(source),
            "replayed": total,
            "samples": n,
            "kinds": children.kind_counts(data),
            "mix": [{"data": m.data, "materializer": m.materializer} for m in spec.mix],
        }
        head.update(lr=self._lr(spec.lr), epochs=epochs, start=spec.start, demos=len(tasks))
        head["start_weights"] = str(start)
        if n < max(1, tr.min_samples):
            return {
                **head,
                "final": None,
                "note": f"{spec.materializer} replay gave {n} sample(s) < {tr.min_samples}",
            }
        max_steps = spec.steps or (
            0 if spec.export_epochs else tr.max_steps
        )  # SFT candidates: every epoch
        out = await children.train(
            data=data,
            model=start,
            out=work / "train",
            preset=tr.preset,
            lr=self._lr(spec.lr),
            epochs=epochs,
            beta=spec.beta,
            samples=n,
            trainer=self.trainer_table(share_prefix=spec.share_prefix, dual_clip=spec.dual_clip),
            export_epochs=spec.export_epochs,
            threads=tr.threads,
            keep_checkpoints=tr.keep_checkpoints,
            max_steps=max_steps,
            checkpoint_every=tr.checkpoint_every,
        )
        return {**head, **out}

    def trainer_table(
        self, *, share_prefix: bool = False, dual_clip: float = 0.0
    ) -> dict[str, Any]:
        """``[trainer]`` overrides of every training (precision, layout, batch, and the GRPO dual
        clip, pinned so that a change of the learner's default never changes a recorded phase)."""
        tr = self.cfg.training
        batch: dict[str, Any] = {"bucketing": tr.bucketing}
        batch.update({"share_prefix": True} if share_prefix else {})
        batch.update({"global_batch": tr.global_batch} if tr.global_batch else {})
        return {
            "precision": tr.precision,
            "batch": batch,
            "export_dtype": tr.export_dtype,
            "loss": {"dual_clip": dual_clip},
        }

    def check_token_budget(self, spec: EvalSpec) -> None:
        """Refuse, before any episode runs, an evaluation whose generation cap is shorter than the
        longest completion its weights were trained on: an SR model writes its reflection before the
        action, so a cap below the trained length cuts the action off and scores the row as
        unparseable (the full run's first SR evaluation: 64 tokens for targets of up to 104, 62%
        unparseable)."""
        budget = spec.rollout.get("max_new_tokens")
        if budget is None or not spec.model.startswith("train:"):
            return
        phase = spec.model.removeprefix("train:").partition("@")[0]
        work = self.ctx.work / phase
        data = (
            work / "dataset-filtered" if (work / "dataset-filtered").is_dir() else work / "dataset"
        )
        longest = max(
            (
                len(msgspec.json.decode(line)["completion_ids"])
                for path in sorted(data.glob("samples-*.jsonl"))
                for line in path.read_bytes().splitlines()
                if line.strip()
            ),
            default=0,
        )
        if longest > budget:
            raise RuntimeError(
                f"{phase}'s weights were trained on completions of up to {longest} tokens "
                f"({data}), but "
                f"this evaluation generates at most max_new_tokens={budget}: raise the config's "
                "cap "
                f"(early.sr_max_new_tokens for SR) to at least {longest}"
            )

    async def evaluate(self, name: str, spec: EvalSpec) -> dict[str, Any]:
        """Pass@k on the validation slice or the test tasks."""
        self.check_token_budget(spec)
        cfg = self.cfg
        options = self.env_options(spec.variant)
        if spec.split == "val":
            ids = self.task_ids("train", cfg.val_offset, cfg.val_tasks, options)
            samples, seed = cfg.val_samples, cfg.val_seed
        else:
            ids = self.task_ids("test", cfg.test_offset, cfg.test_tasks, options)
            samples, seed = cfg.eval_samples, cfg.eval_seed
        model = self.weights(spec.model)
        tag = weights_tag(model)
        out = await lib.evaluate_model(
            self.ctx,
            label=name,
            model=model,
            version=tag,
            run_id=f"{cfg.prefix}-{name}-{tag}",
            task_ids=ids,
            split="train" if spec.split == "val" else "test",
            samples=samples,
            ks=cfg.ks,
            seed=seed + spec.seed_offset,
            env_options=options,
            rollout_overrides={**self._rollout(spec.variant), **spec.rollout},
        )
        return {
            **out,
            "model": str(model),
            "weights_tag": tag,
            "variant": self.variant(spec.variant),
        }

    async def audit(self, name: str, spec: AuditSpec) -> dict[str, Any]:
        """The follow audit of the referenced weights at the verdicts of ``spec.data``'s log; the
        gate."""
        from experiments.paper.follow_audit import audit_phase

        model = self.weights(spec.model)
        tag = weights_tag(model)
        await lib.load_weights(self.ctx, model, tag)
        data = self._need(spec.data)
        variant = str(data.get("variant", ""))  # the rooms the audited trees ran on
        out = await audit_phase(
            self.ctx,
            log=Path(data["log_file"]),
            env_options=self.env_options(variant),
            rollout=self._rollout(variant),
            samples=self.cfg.effect.audit_samples,
            gate=self.cfg.effect.follow_gate,
            seed=self.cfg.seed,
            out=self.ctx.logs.parent.parent / f"{self.cfg.report_name}_follow_audit",
        )
        return {**out, "model": str(model), "weights_tag": tag}

    async def probe(self, name: str) -> dict[str, Any]:
        """Base on a few test tasks of the probe environment: seconds per episode."""
        p, cfg = self.cfg.probe, self.cfg
        from leafe.envs.registry import make_env

        env = make_env(p.env, **p.env_options)
        try:
            ids = list(env.tasks("test"))[: p.tasks]
        finally:
            env.close()
        out = await lib.evaluate_model(
            self.ctx,
            label=name,
            model=self.ctx.base_model,
            version="base",
            run_id=f"{cfg.prefix}-{name}",
            task_ids=ids,
            split="test",
            samples=p.samples,
            ks=[1],
            seed=cfg.eval_seed,
            env_options=p.env_options,
            rollout_overrides={"horizon": p.horizon},
            env=p.env,
        )
        return {**out, "env": p.env, "s_per_episode": out["wall_s"] / max(1, out["episodes"])}
