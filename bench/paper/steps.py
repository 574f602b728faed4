"""What each kind of phase does (``bench/paper/phases.py`` says which, and in what order).

:class:`Steps` resolves a phase's references (weights, room variant, chosen counts and lrs) from the
results of finished phases and runs it: a collection through the actor service, a training through
``leafe replay`` + ``leafe train``, an evaluation through the inference servers, a choice through
``bench/paper/select.py``. Every result is a plain dict; the runner saves it as ``done.json``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from bench.paper import children, lib
from bench.paper.config import PaperConfig
from bench.paper.phases import CollectSpec, EvalSpec, Phase, ProbeSpec, SelectSpec, TrainSpec
from bench.paper.select import Candidate, choose_best, choose_sft

__all__ = ["Steps", "weights_tag"]


def weights_tag(model: Path) -> str:
    """8 hex digits of the export's manifest (``base`` for the shipped model): an evaluation's run id names
    the weights it ran, so re-training never mixes two checkpoints' episodes in one run."""
    manifest = model / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest()[:8] if manifest.is_file() else "base"


class Steps:
    """Runs phases; ``done(name)`` gives a finished phase's result (``None`` if it has none)."""

    def __init__(
        self, cfg: PaperConfig, ctx: lib.Ctx, phases: list[Phase], done: Callable[[str], Any]
    ) -> None:
        self.cfg, self.ctx, self.done = cfg, ctx, done
        self.by_name = {p.name: p for p in phases}

    def _need(self, name: str) -> dict[str, Any]:
        result = self.done(name)
        if result is None:
            raise RuntimeError(f"phase {name} has no result")
        return dict(result)

    # --- references -------------------------------------------------------------------------------
    def weights(self, ref: str) -> Path:
        """The weights directory a reference names (see ``bench/paper/phases.py``)."""
        if ref == "base":
            return self.ctx.base_model
        select = {"sft": "select-sft", "grpo": "select-grpo", "grpo-r1": "grpo-r1-select"}.get(ref)
        if select:
            return Path(self._need(select)["weights"])
        if ref.startswith("grpo-r"):
            return Path(self._need(f"{ref}-train")["final"])
        phase, _, epoch = ref.removeprefix("train:").partition("@")
        result = self._need(phase)
        if not result.get("final"):
            raise RuntimeError(f"{phase} produced no weights: {result.get('note', '')}")
        return Path(result["epoch_weights"][epoch] if epoch else result["final"])

    def variant(self, name: str) -> str:
        """A room variant's name; empty = the one ``select-sft`` chose."""
        return name or str(self._need("select-sft")["variant"])

    def env_options(self, variant: str) -> dict[str, Any]:
        """Env options of a room variant (empty = the chosen one)."""
        return dict(self.cfg.warm.variants[self.variant(variant)])

    def task_ids(self, split: str, offset: int, count: int, options: Mapping[str, Any]) -> list[str]:
        """``count`` task ids of ``split`` from index ``offset`` (errors say when the split is too short)."""
        from envs.registry import make_env

        env = make_env(self.ctx.env, **options)
        try:
            all_ids = list(env.tasks(split))
        finally:
            env.close()
        out = all_ids[offset : offset + count]
        if len(out) != count:
            raise ValueError(
                f"{split} split has {len(all_ids)} tasks; indices {offset}..{offset + count - 1} asked"
            )
        return out

    def _demo_count(self, value: int | str) -> int:
        return int(self._need("select-sft")["demos"]) if value == "sft" else int(value)

    def _rollout(self) -> dict[str, Any]:
        return {"horizon": self.cfg.horizon, "history_window": self.cfg.history_window}

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
        raise TypeError(f"unknown phase spec {spec!r}")

    def _samples(self, spec: CollectSpec, tasks: int) -> int:
        if not spec.match_actions_of:
            return spec.samples
        budget = int(self._need(spec.match_actions_of)["actions"])
        rollouts = self.done("grpo-r1-collect")  # the same weights' rollouts on the same tasks, if run
        per_episode = rollouts["actions"] / max(1, rollouts["episodes"]) if rollouts else self.cfg.horizon
        return max(1, round(budget / (tasks * per_episode)))

    async def collect(self, name: str, spec: CollectSpec) -> dict[str, Any]:
        """Episodes on train tasks with the referenced weights; the log is exported."""
        cfg, env = self.cfg, self.ctx.env
        options = self.env_options(spec.variant)
        if spec.tasks == "rl":
            ids = self.task_ids("train", cfg.train_offset, cfg.train_tasks, options)
        else:
            count = cfg.max_demos if spec.tasks == "demos" else self._demo_count("sft")
            ids = self.task_ids("train", cfg.demo_offset, count, options)
        samples = self._samples(spec, len(ids))
        model = self.weights(spec.model)
        tag = weights_tag(model)
        await lib.load_weights(self.ctx, model, tag)
        explorer = {"horizon": cfg.horizon, "history_window": cfg.history_window, **spec.explorer}
        actor = {"explorer": {env: explorer}, "rollout": {env: self._rollout()}, "demo": {env: spec.demo}}
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
        return {**out, "model": str(model), "weights_tag": tag, "variant": self.variant(spec.variant)}

    def _lr(self, value: float | str) -> float:
        return float(self._need("grpo-r1-select")["lr"]) if value == "grpo" else float(value)

    async def train(self, name: str, spec: TrainSpec) -> dict[str, Any]:
        """Rebuild the dataset from the data phase's exported log, filter it, train."""
        cfg, tr, work = self.cfg, self.cfg.training, self.ctx.work / name
        source = Path(self._need(spec.data)["log_file"])
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
            options = dict(self._need(spec.data)["env_options"])
            tasks = self.task_ids("train", cfg.demo_offset, self._demo_count(spec.demos), options)
        n = total
        if spec.kinds or tasks:
            n = children.filter_samples(data, work / "dataset-filtered", kinds=spec.kinds, task_ids=tasks)
            data = work / "dataset-filtered"
        epochs = int(self._need("select-sft")["epochs"]) if spec.epochs == "sft" else int(spec.epochs)
        start = self.weights(spec.start)
        head: dict[str, Any] = {
            "source_log": str(source),
            "replayed": total,
            "samples": n,
            "kinds": children.kind_counts(data),
        }
        head.update(lr=self._lr(spec.lr), epochs=epochs, start=spec.start, demos=len(tasks))
        head["start_weights"] = str(start)
        if n < max(1, tr.min_samples):
            return {
                **head,
                "final": None,
                "note": f"{spec.materializer} replay gave {n} sample(s) < {tr.min_samples}",
            }
        out = await children.train(
            data=data,
            model=start,
            out=work / "train",
            preset=tr.preset,
            lr=self._lr(spec.lr),
            epochs=epochs,
            beta=spec.beta,
            samples=n,
            trainer=self.trainer_table(),
            export_epochs=spec.export_epochs,
            threads=tr.threads,
            keep_checkpoints=tr.keep_checkpoints,
            max_steps=0 if spec.export_epochs else tr.max_steps,  # SFT candidates: every epoch counts
        )
        return {**head, **out}

    def trainer_table(self) -> dict[str, Any]:
        """``[trainer]`` overrides of every training (precision, layout, batch)."""
        tr = self.cfg.training
        batch: dict[str, Any] = {"bucketing": tr.bucketing}
        batch.update({"global_batch": tr.global_batch} if tr.global_batch else {})
        return {"precision": tr.precision, "batch": batch, "export_dtype": tr.export_dtype}

    def check_token_budget(self, spec: EvalSpec) -> None:
        """Refuse, before any episode runs, an evaluation whose generation cap is shorter than the
        longest completion its weights were trained on: an SR model writes its reflection before the
        action, so a cap below the trained length cuts the action off and scores the row as unparseable
        (the full run's first SR evaluation: 64 tokens for targets of up to 104, 62% unparseable)."""
        budget = spec.rollout.get("max_new_tokens")
        if budget is None or not spec.model.startswith("train:"):
            return
        phase = spec.model.removeprefix("train:").partition("@")[0]
        work = self.ctx.work / phase
        data = work / "dataset-filtered" if (work / "dataset-filtered").is_dir() else work / "dataset"
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
                f"{phase}'s weights were trained on completions of up to {longest} tokens ({data}), but "
                f"this evaluation generates at most max_new_tokens={budget}: raise the config's cap "
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
            rollout_overrides={**self._rollout(), **spec.rollout},
        )
        return {**out, "model": str(model), "weights_tag": tag, "variant": self.variant(spec.variant)}

    async def probe(self, name: str) -> dict[str, Any]:
        """Base on a few test tasks of the probe environment: seconds per episode."""
        p, cfg = self.cfg.probe, self.cfg
        from envs.registry import make_env

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

    # --- choices ----------------------------------------------------------------------------------
    def candidate(self, val_phase: str, **kw: Any) -> Candidate:
        """The validation result of ``val_phase`` as a :class:`Candidate`."""
        r = self._need(val_phase)
        return Candidate(
            name=val_phase, pass1=float(r["passk"]["1"]), parse_failure=float(r["parse_failure_rate"]), **kw
        )

    def select(self, spec: SelectSpec) -> dict[str, Any]:
        """The choice ``spec`` names, from validation results only."""
        if spec.what == "sft":
            return self._select_sft(spec.candidates)
        if spec.what == "grpo-lr":
            cands = []
            for v in spec.candidates:
                train = self.by_name[v].spec.model.removeprefix("train:")  # type: ignore[union-attr]
                cands.append(self.candidate(v, lr=self._lr(self.by_name[train].spec.lr)))  # type: ignore[union-attr]
            choice = choose_best(cands)
            train = self.by_name[choice.chosen.name].spec.model  # type: ignore[union-attr]
            return self._choice(choice, cands, lr=choice.chosen.lr, weights=str(self.weights(train)), round=1)
        return self._select_grpo(spec.candidates)

    def _choice(self, choice: Any, cands: list[Candidate], **extra: Any) -> dict[str, Any]:
        return {
            "chosen": choice.chosen.name,
            "rule_met": choice.rule_met,
            "why": choice.why,
            "candidates": [msgspec.to_builtins(c) for c in cands],
            **extra,
        }

    def _select_sft(self, vals: list[str]) -> dict[str, Any]:
        cands = []
        for v in vals:
            spec = self.by_name[v].spec
            assert isinstance(spec, EvalSpec)
            train, _, epoch = spec.model.removeprefix("train:").partition("@")
            demos = self.by_name[train].spec.demos  # type: ignore[union-attr]
            if self.done(v) is not None:
                cands.append(self.candidate(v, variant=spec.variant, demos=int(demos), epochs=int(epoch)))
        w = self.cfg.warm
        choice = choose_sft(
            cands,
            max_parse_failure=w.max_parse_failure,
            pass1_range=w.pass1_range,
            pass1_target=w.pass1_target,
        )
        c = choice.chosen
        weights = self.weights(self.by_name[c.name].spec.model)  # type: ignore[union-attr]
        return self._choice(
            choice,
            cands,
            variant=c.variant,
            env_options=dict(w.variants[c.variant]),
            demos=c.demos,
            epochs=c.epochs,
            weights=str(weights),
            val_phase=c.name,
        )

    def _select_grpo(self, rounds: list[str]) -> dict[str, Any]:
        sft = self._need("select-sft")
        start = self.candidate(sft["val_phase"], round=0)
        first = self._need(rounds[0])
        cands = [self.candidate(first["chosen"], round=1, lr=float(first["lr"]))]
        for r, v in enumerate(rounds[1:], start=2):
            if self.done(v) is not None:
                cands.append(self.candidate(v, round=r))
        choice = choose_best(cands, start=start)
        k = choice.chosen.round
        weights = first["weights"] if k == 1 else self._need(f"grpo-r{k}-train")["final"]
        curve = [msgspec.to_builtins(start)] + [msgspec.to_builtins(c) for c in cands]
        return self._choice(
            choice, cands, round=k, weights=str(weights), curve=curve, beats_start=choice.rule_met
        )
