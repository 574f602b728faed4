"""The paper's comparison at our scale: Base vs GRPO vs RFT vs LEAFE (from GRPO and from Base) vs L_reh
alone, Pass@k on held-out Sokoban tasks, plus Stage 1 alone at equal budget (independent sampling vs the
LEAFE tree). Writes ``bench/results/paper_table.{md,json,png}``.

```
 embedded nats-server (<work>/nats) ◄── events ── in-process actor service ──► CPU inference server
   runs <prefix>-explore-base, -rollout-base, -explore-grpo, -eval        (weights reloaded per method)
        └─► leafe replay --materializer grpo|rft|leafe ─► leafe train --preset cpu ─► <work>/<phase>/final
```

Every phase goes through the real services and leaves ``<work>/<phase>/done.json``; rerunning skips
finished phases, and each collection phase is its own run in the log (``leafe replay --from <nats url>
--run <prefix>-explore-base ...`` rebuilds its dataset). Budgets: LEAFE's Stage 1 spends its policy
actions (``EpisodeFinished.actions``, summed); GRPO and RFT get plain rollout groups sized to the same
count (``rollout_samples = 0``: g = round(actions / (train tasks x horizon))). The Table-3 comparison runs
Base without training three ways at about that budget: independent sampling (the GRPO rollouts), iterative
refinement (``explore-ir``: every branch restarts from step 0 with the experience) and the LEAFE tree.
Phases run in priority order (Base, GRPO, LEAFE from GRPO, RFT, LEAFE from Base, L_reh, a second Base
evaluation with other sampling seeds as a noise check, IR), so a time box (``--max-minutes``) cuts the
least important ones. The report gives two-level bootstrap intervals (test tasks, then samples within a
task) for the paired Pass@k differences.

    .venv/bin/python bench/paper_table.py --scale small            # ~1 h on 2 shared cores
    .venv/bin/python bench/paper_table.py --scale full             # 16 test tasks x 16 samples, k <= 16
    .venv/bin/python bench/paper_table.py --scale gpu --engine http://sglang-0:30000,http://sglang-1:30000
    .venv/bin/python bench/paper_table.py --scale small --max-minutes 50   # start no phase after 50 min
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import paper_lib as lib
from bench.paper_report import write_report
from services.config import load_config

__all__ = ["PHASES", "SCALES", "PaperConfig", "main", "scale_config"]

log = structlog.get_logger(__name__)


class PaperConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One experiment (``--scale`` picks a preset, ``--config`` TOML overrides fields)."""

    name: str = "small"
    """Scale name; also the run-id prefix ``pt-<name>`` and work dir ``runs/paper_table/<name>``."""
    model: str = "smollm2-135m-instruct"
    """Base model (``learner.model_io.resolve_model``)."""
    env: str = "sokoban"
    """Environment registry name."""
    env_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Environment options (difficulty)."""
    train_tasks: int = 12
    """Train-split tasks explored / rolled out (the first N)."""
    test_tasks: int = 8
    """Held-out test tasks evaluated (the first N of the test split)."""
    eval_samples: int = 8
    """n of the Pass@k estimator."""
    ks: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8])
    """k values reported."""
    explorer: dict[str, Any] = msgspec.field(default_factory=dict)
    """``ExplorerConfig`` overrides for Stage 1."""
    horizon: int = 6
    """Plain rollout horizon (training rollouts and evaluation)."""
    min_train_samples: int = 8
    """A method trained on fewer samples than this is not evaluated (its weights barely moved from the
    start; the report says so) — saves an evaluation's time when Stage 1 yields almost no data."""
    history_window: int = 2
    """Past steps shown in an action prompt (rollouts, eval and Stage 1; 0 = all). Reflection prompts
    keep the whole history so tau is nameable. Short prompts are what makes CPU prefill affordable."""
    explore_samples: int = 1
    """Stage-1 trees per train task (each a separate episode with its own sampling seed)."""
    rollout_samples: int = 0
    """GRPO group size / RFT samples per train task; 0 = match Stage 1's measured action budget."""
    train_preset: str = "cpu"
    """``leafe train`` preset."""
    lr: float = 1e-5
    """Learning rate of every training phase."""
    epochs: int = 2
    """Epochs of every training phase."""
    beta: float = 1.0
    """Weight of L_reh in LEAFE's Stage 2."""
    rehearsal_fraction: float = 0.2
    """Share of successful-path steps kept for D_reh (paper: 20%)."""
    concurrency: int = 16
    """Episodes in flight (the server batches them)."""
    servers: int = 1
    """CPU inference servers started side by side (the client sends each request to the least loaded);
    one per core with ``threads = 1`` uses a small machine fully during collection and evaluation."""
    dtype: str = "float32"
    """Serving dtype of the CPU inference servers (``float32`` | ``bfloat16``); training stays float32."""
    threads: int = 1
    """Torch threads of each CPU inference server. 1: on this shared, oversubscribed machine (load 5 on 2
    cores) 2 OpenMP threads prefilled ~10 tokens/s; 1 thread ~140-230 (load 2-4; the load changed too)."""
    train_threads: int = 2
    """Torch threads of the ``leafe train`` / ``leafe replay`` children."""
    engines: list[str] = msgspec.field(default_factory=list)
    """External SGLang URLs (``--scale gpu``); empty = in-process CPU inference server."""
    collect_timeout_s: float = 1800.0
    """Longest a collection phase may run."""
    phases: list[str] = msgspec.field(default_factory=list)
    """Phase names to run (empty = all). A second environment needs only Base, GRPO and LEAFE from GRPO:
    ``eval-base, explore-base, rollout-base, train-grpo, eval-grpo, explore-grpo, train-leafe-grpo,
    eval-leafe-from-grpo``; the report lists the phases left out."""
    report_name: str = "paper_table"
    """File stem of the report under ``--results`` (``<report_name>.md/.json/.png``)."""
    notes: str = ""
    """Free text printed in the report (e.g. what changed between resumed invocations)."""
    seed: int = 0
    """Sampling seed of training-time episodes."""
    eval_seed: int = 12345
    """Sampling seed of evaluation (same for every method: paired comparison)."""


PHASES = (
    "eval-base",
    "explore-base",
    "rollout-base",
    "train-grpo",
    "eval-grpo",
    "explore-grpo",
    "train-leafe-grpo",
    "eval-leafe-from-grpo",
    "train-rft",
    "eval-rft",
    "train-leafe-base",
    "eval-leafe-from-base",
    "train-reh-grpo",
    "eval-reh-only-from-grpo",
    "eval-base-reseed",
    "explore-ir",
)
"""Every phase, in the order ``Runner.run`` reaches them (the names ``phases`` may list)."""

_SMALL_ROOMS = {"height": 5, "width": 5, "num_boxes": 1, "max_solution_len": 2, "max_steps": 6}
SCALES: dict[str, dict[str, Any]] = {
    "small": {
        "name": "small",
        "env_options": _SMALL_ROOMS,
        "train_tasks": 10,
        "test_tasks": 8,
        "eval_samples": 8,
        "ks": [1, 2, 4, 8],
        "horizon": 6,
        "explorer": {"horizon": 6, "k": 3, "max_depth": 2, "max_branches": 4, "max_actions": 18},
    },
    "full": {
        "name": "full",
        "env_options": {**_SMALL_ROOMS, "max_solution_len": 3, "max_steps": 8},
        "servers": 2,
        "dtype": "bfloat16",
        "concurrency": 32,
        "train_tasks": 24,
        "explore_samples": 3,
        "test_tasks": 16,
        "eval_samples": 16,
        "ks": [1, 2, 4, 8, 16],
        "horizon": 8,
        "explorer": {"horizon": 8, "k": 4, "max_depth": 3, "max_branches": 6, "max_actions": 40},
        "collect_timeout_s": 7200.0,
    },
    "gpu": {
        "name": "gpu",
        "env_options": {"height": 7, "width": 7, "num_boxes": 1, "max_steps": 15},
        "train_tasks": 512,
        "test_tasks": 64,
        "eval_samples": 128,
        "ks": [1, 2, 4, 8, 16, 32, 64, 128],
        "horizon": 15,
        "explorer": {"horizon": 15, "k": 5, "max_depth": 3, "max_branches": 8, "max_actions": 60},
        "train_preset": "paper",
        "lr": 1e-6,
        "epochs": 2,
        "concurrency": 256,
        "collect_timeout_s": 36000.0,
    },
}
"""Presets: ``small`` (8 test tasks x 8 samples, k <= 8) fits ~1 h on 2 shared cores; ``full`` is the
issue's minimum (16 x 16, k <= 16);
``gpu`` is the paper-size setting for a cluster with SGLang engines (``--engine``)."""


def scale_config(scale: str, override: dict[str, Any] | None = None) -> PaperConfig:
    """The preset ``scale`` with ``override`` fields on top (validated; errors name the field)."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {', '.join(SCALES)}")
    cfg = load_config(PaperConfig, preset=SCALES[scale], overrides=override)
    unknown = sorted(set(cfg.phases) - set(PHASES))
    if unknown:
        raise ValueError(f"unknown phase(s) {', '.join(unknown)} in phases; known: {', '.join(PHASES)}")
    return cfg


def _train_args(cfg: PaperConfig, *, beta: float | None = None) -> list[str]:
    out = ["--lr", str(cfg.lr), "--epochs", str(cfg.epochs)]
    return out + (["--beta", str(beta)] if beta is not None else [])


class Runner:
    """Runs the phases in order, skipping finished ones, and rewrites the report after each."""

    def __init__(self, cfg: PaperConfig, ctx: lib.Ctx, results: Path, deadline: float) -> None:
        self.cfg, self.ctx, self.results, self.deadline = cfg, ctx, results, deadline
        self.prefix = f"pt-{cfg.name}"
        self.state: dict[str, Any] = {
            "phases": {},
            "skipped": [],
            "excluded": [],
            "failed": {},
            "not_evaluated": {},
        }

    async def phase(self, name: str, make: Any) -> dict[str, Any] | None:
        if name not in PHASES:  # keeps the names ``phases`` may list in step with what runs
            raise ValueError(f"phase {name!r} is missing from PHASES")
        done = lib.phase_done(self.ctx, name)
        if done is None:
            if self.cfg.phases and name not in self.cfg.phases:
                self.state["excluded"].append(name)
                return None
            if time.monotonic() > self.deadline:
                self.state["skipped"].append(name)
                return None
            print(f"[paper_table] phase {name} ...", flush=True)
            try:
                done = lib.save_phase(self.ctx, name, await make())
            except Exception as e:  # recorded in the report; later phases that don't need it still run
                log.exception("paper.phase.failed", phase=name)
                self.state["failed"][name] = f"{type(e).__name__}: {str(e)[-1500:]}"
                write_report(self.cfg, self.state, self.results)
                return None
        self.state["phases"][name] = done
        write_report(self.cfg, self.state, self.results)
        return done

    def _tasks(self, split: str, n: int) -> list[str]:
        from envs.registry import make_env

        env = make_env(self.cfg.env, **self.cfg.env_options)
        try:
            return list(env.tasks(split)[:n])
        finally:
            env.close()

    def _rollout(self) -> dict[str, Any]:
        return {"horizon": self.cfg.horizon, "history_window": self.cfg.history_window}

    async def evaluate(self, label: str, model: Path, seed_offset: int = 0) -> dict[str, Any] | None:
        cfg = self.cfg
        return await self.phase(
            f"eval-{label}",
            lambda: lib.evaluate_model(
                self.ctx,
                label=label,
                model=model,
                version=label,
                run_id=f"{self.prefix}-eval-{label}-{_weights_tag(model)}",
                task_ids=self._tasks("test", cfg.test_tasks),
                samples=cfg.eval_samples,
                ks=cfg.ks,
                seed=cfg.eval_seed + seed_offset,
                rollout_overrides=self._rollout(),
            ),
        )

    async def collect(
        self, name: str, model: Path, version: str, mode: str, samples: int, run: str = "", **explorer_kw: Any
    ) -> Any:
        """Collection phase ``name`` in run ``run`` (default ``<prefix>-<name>``)."""
        cfg = self.cfg

        async def make() -> dict[str, Any]:
            await lib.load_weights(self.ctx, model, version)
            explorer = {"history_window": cfg.history_window, **cfg.explorer, **explorer_kw}
            actor = {"explorer": {cfg.env: explorer}, "rollout": {cfg.env: self._rollout()}}
            return await lib.collect(
                self.ctx,
                run_id=run or f"{self.prefix}-{name}",
                mode=mode,
                task_ids=self._tasks("train", cfg.train_tasks),
                samples=samples,
                seed=cfg.seed,
                actor_overrides=actor,
                timeout_s=cfg.collect_timeout_s,
            )

        return await self.phase(name, make)

    async def train(self, name: str, run: str, materializer: str, model: Path, **kw: Any) -> Path | None:
        """Replay ``run`` with ``materializer`` and train ``model`` on it; ``kinds`` filters samples."""
        cfg, work = self.cfg, self.ctx.work / name

        async def make() -> dict[str, Any]:
            options: dict[str, Any] = {}
            if materializer == "leafe":
                options = {"rehearsal_fraction": cfg.rehearsal_fraction, "rehearsal_seed": cfg.seed}
            data = work / "dataset"
            run_id = (lib.phase_done(self.ctx, run) or {}).get("run_id", f"{self.prefix}-{run}")
            n = await lib.replay(
                self.ctx, run_id=run_id, materializer=materializer, out=data, options=options
            )
            kinds = kw.get("kinds")
            if kinds:
                n = lib.filter_kind(data, work / "dataset-filtered", kinds)
                data = work / "dataset-filtered"
            if n == 0:
                return {
                    "samples": 0,
                    "final": None,
                    "note": f"{materializer} replay of {run} gave no samples",
                }
            args = _train_args(cfg, beta=kw.get("beta"))
            out = await lib.train(
                self.ctx, data=data, model=model, out=work / "train", train_args=args, preset=cfg.train_preset
            )
            return {"samples": n, "kinds": _kind_counts(data), **out}

        done = await self.phase(name, make)
        if done and done.get("final") and done.get("samples", 0) < cfg.min_train_samples:
            self.state["not_evaluated"][name] = (
                f"trained on {done['samples']} samples {done.get('kinds', {})} in {done.get('steps')} optimizer "
                f"step(s) (< min_train_samples = {cfg.min_train_samples}): weights ~= the start, not evaluated"
            )
            write_report(self.cfg, self.state, self.results)
            return None
        return Path(done["final"]) if done and done.get("final") else None

    async def run(self) -> None:
        cfg, base = self.cfg, self.ctx.base_model
        self.state["trees"] = {}
        for name in ("explore-base", "explore-grpo", "explore-ir"):
            if lib.phase_done(self.ctx, name):
                self.state["trees"][name] = await lib.tree_stats(self.ctx, f"{self.prefix}-{name}")
        await self.evaluate("base", base)
        explore = await self.collect("explore-base", base, "base", "explore", cfg.explore_samples)
        if explore is None:
            return
        g = cfg.rollout_samples or max(2, round(explore["actions"] / (cfg.train_tasks * cfg.horizon)))
        # the group size is part of the run id: groups of another size (an earlier invocation with another
        # budget) must not mix with these, since a GRPO group is fixed by its first members' group_size
        if (
            await self.collect(
                "rollout-base", base, "base", "rollout", g, run=f"{self.prefix}-rollout-base-g{g}"
            )
            is None
        ):
            return
        grpo = await self.train("train-grpo", "rollout-base", "grpo", base)
        if grpo:
            await self.evaluate("grpo", grpo)
        # the paper's main LEAFE starts from the GRPO checkpoint and adds a second exploration on top
        if (
            grpo
            and await self.collect("explore-grpo", grpo, "grpo", "explore", cfg.explore_samples) is not None
        ):
            leafe = await self.train("train-leafe-grpo", "explore-grpo", "leafe", grpo, beta=cfg.beta)
            if leafe:
                await self.evaluate("leafe-from-grpo", leafe)
        rft = await self.train("train-rft", "rollout-base", "rft", base)
        if rft:
            await self.evaluate("rft", rft)
        # LEAFE from Base spends the same interactions as GRPO (the equal-budget ablation)
        leafe_base = await self.train("train-leafe-base", "explore-base", "leafe", base, beta=cfg.beta)
        if leafe_base:
            await self.evaluate("leafe-from-base", leafe_base)
        if grpo and lib.phase_done(self.ctx, "explore-grpo"):
            reh = await self.train("train-reh-grpo", "explore-grpo", "leafe", grpo, kinds=["reh"])
            if reh:
                await self.evaluate("reh-only-from-grpo", reh)
        # noise check: the same Base weights under other sampling seeds; any gap to eval-base is pure noise
        await self.evaluate("base-reseed", base, seed_offset=1)
        await self.collect("explore-ir", base, "base", "explore", cfg.explore_samples, restart_from="start")


def _weights_tag(model: Path) -> str:
    """8 hex digits of the export's manifest (``base`` for the shipped model): an evaluation's run id names
    the weights it ran, so re-training a method never mixes two checkpoints' episodes in one run."""
    manifest = model / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest()[:8] if manifest.is_file() else "base"


def _kind_counts(data: Path) -> dict[str, int]:
    from learner.offline import iter_shard_samples

    out: dict[str, int] = {}
    for s in iter_shard_samples(data):
        out[s.kind] = out.get(s.kind, 0) + 1
    return out


async def _run(cfg: PaperConfig, work: Path, results: Path, max_minutes: float) -> None:
    from contextlib import AsyncExitStack

    from actors.client import SGLangClient
    from learner.model_io import HFChatTokenizer, resolve_model
    from services.bus import connect, ensure_streams
    from services.bus.nats_server import EmbeddedNats
    from services.inference.server import InferenceConfig, InferenceServer

    deadline = time.monotonic() + 60 * max_minutes
    work.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (once, before anything runs)
    (work / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg), indent=1))
    async with AsyncExitStack() as stack:
        nats = EmbeddedNats(work / "nats", log_file=work / "nats.log").start()
        stack.callback(nats.stop)
        base = await asyncio.to_thread(resolve_model, cfg.model)
        urls = list(cfg.engines)
        for _ in range(0 if urls else cfg.servers):
            server_cfg = InferenceConfig(
                model=str(base),
                port=0,
                max_batch=cfg.concurrency,
                threads=cfg.threads,
                dtype=cfg.dtype,
                served_model_name="paper-table",  # type: ignore[arg-type]
                weight_version="base",
                weights_root=str(work),
            )
            server = await stack.enter_async_context(InferenceServer(server_cfg))
            urls.append(server.url)
        engine = await stack.enter_async_context(SGLangClient(urls))
        nc = await connect(nats.url, name="paper-table")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        ctx = lib.Ctx(
            work=work,
            nats_url=nats.url,
            js=js,
            engine=engine,
            tokenizer=HFChatTokenizer.from_dir(base),
            base_model=base,
            env=cfg.env,
            env_options=dict(cfg.env_options),
            concurrency=cfg.concurrency,
            threads=cfg.threads,
        )
        runner = Runner(cfg, ctx, results, deadline)
        t0 = time.monotonic()
        try:
            await runner.run()
        finally:
            runner.state["invocation_wall_s"] = time.monotonic() - t0
            runner.state["inference_stats"] = await lib.server_stats(urls[0])
            write_report(cfg, runner.state, results)


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse flags, run the phases, write the report."""
    from services.config import read_toml
    from services.logsetup import configure_logging

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", default="small", help="small | full | gpu")
    p.add_argument("--config", type=Path, default=None, help="TOML with PaperConfig fields over the scale")
    p.add_argument("--engine", default="", help="SGLang URL(s), comma-separated (gpu scale)")
    p.add_argument("--work", type=Path, default=None, help="work dir (default runs/paper_table/<scale>)")
    p.add_argument("--results", type=Path, default=Path("bench/results"), help="where paper_table.* go")
    p.add_argument("--max-minutes", type=float, default=1e9, help="start no new phase after this")
    args = p.parse_args(argv)
    override = read_toml(args.config) if args.config else {}
    if args.engine:
        override["engines"] = [u for u in args.engine.split(",") if u]
    cfg = scale_config(args.scale, override)
    lib.set_threads(cfg.train_threads)
    work = args.work or Path("runs/paper_table") / cfg.name
    configure_logging(json=True, level="info", file=work / "paper_table.jsonl")
    asyncio.run(_run(cfg, work, args.results, args.max_minutes))
    print(json.dumps({"report": str(args.results / f"{cfg.report_name}.md")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
