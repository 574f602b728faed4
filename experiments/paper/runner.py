"""The paper table's runner: registers the protocol, writes the report skeleton, then walks the
plan.

```
 embedded nats-server (<work>/nats) ◄── events ── in-process actor service
     ──► CPU inference server(s)
   one run per collection (exported to experiments/results/paper_logs/<name>/<phase>.leafelog.gz)
        └─► leafe replay --from <that file> ─► leafe train ─► <work>/<phase>/train/final
              ─► reload ─► eval
```

Before any phase runs, the protocol (task ranges, every seed, rows and comparisons) is written to
``<work>/protocol.json`` and into the report; a later invocation with another protocol is refused,
so no evaluation can move the goal posts. Each finished phase leaves ``<work>/<phase>/done.json``
and a rerun skips it (resumable); the records are carried to the next working period in the
repository and a restored training is rebuilt from the committed logs when a pending phase needs its
weights (``experiments/paper/carry.py``). A phase whose dependency failed, was cut or produced no
weights is ``blocked``; after ``--max-minutes`` no phase starts (``skipped``); the plan is in
priority order, so the time box cuts the least important ones. The report is rewritten after every
phase.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from experiments.paper import carry, effect, lib, refs
from experiments.paper.config import PaperConfig
from experiments.paper.phases import Phase
from experiments.paper.plans import plan
from experiments.paper.protocol import check_inherited, check_protocol, protocol_of
from experiments.paper.report import write_report
from experiments.paper.repro import repro_script
from experiments.paper.specs import TrainSpec
from experiments.paper.steps import Steps

__all__ = ["Runner", "State", "rewrite_report", "run_experiment"]

log = structlog.get_logger(__name__)


class State(msgspec.Struct, kw_only=True):
    """What the report is rendered from."""

    plan: list[Phase]
    protocol: dict[str, Any]
    phases: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    """Finished phases' results."""
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    blocked: dict[str, str] = msgspec.field(default_factory=dict)
    skipped: list[str] = msgspec.field(default_factory=list)
    """Not started: the time box was reached."""
    running: str = ""
    invocations: list[dict[str, Any]] = msgspec.field(default_factory=list)
    inference: dict[str, Any] = msgspec.field(default_factory=dict)


class Runner:
    """Walks the plan (see the module docstring)."""

    def __init__(
        self,
        cfg: PaperConfig,
        work: Path,
        results: Path,
        deadline: float,
        register: bool = True,
        carried: bool = False,
    ) -> None:
        self.cfg, self.work, self.results, self.deadline = cfg, work, results, deadline
        self.carried = carried
        """Carry the phase records in the repository (``experiments/paper/carry.py``): restore them
        before the first phase, save them after each."""
        self.inherited = effect.inherited(cfg)
        """Phases taken from ``cfg.effect.inherit``'s experiment: never run here."""
        if self.inherited:
            check_inherited(results, cfg)
        self.restored = carry.restore_state(work, results, cfg.name) if carried else []
        """Phases whose record came from an earlier working period (their weights are not on
        disk)."""
        if carried and self.inherited:
            parent = cfg.effect.inherit
            self.restored += carry.restore_state(
                work,
                results,
                parent,
                phases=self.inherited,
                files=False,
                source_work=work.parent / parent,
            )
        self.rebuilt: set[str] = set()
        protocol = (
            check_protocol(work / "protocol.json", cfg)
            if register
            else {"protocol": protocol_of(cfg)}
        )
        self.state = State(plan=plan(cfg), protocol=protocol)
        self.base_model = cfg.model
        """The base model's directory (reproduction scripts name it ``$MODEL``)."""
        for p in self.state.plan:
            done = lib.phase_done(work, p.name)
            if done is not None:
                self.state.phases[p.name] = done

    def report(self, figure: bool = False) -> None:
        """Rewrite the report from the state; with ``figure`` (at the end of every invocation: ~1 s
        of matplotlib) also the png and the reproduction script."""
        write_report(self.cfg, self.state, self.results, figure=figure)
        if figure:
            script = repro_script(self.cfg, self.state, self.work, self.base_model)
            (self.results / f"{self.cfg.report_name}_repro.sh").write_text(script, encoding="utf-8")

    def _why_blocked(self, phase: Phase) -> str:
        if phase.name in self.inherited:
            return (
                f"taken from {self.cfg.effect.inherit!r} (effect.inherit), "
                "which has no record of it"
            )
        for dep in phase.deps:
            if dep not in self.state.phases:
                return f"needs {dep} ({'failed' if dep in self.state.failed else 'not finished'})"
            result = self.state.phases[dep]
            if "final" in result and not result["final"]:
                return f"{dep} produced no weights: {result.get('note', '')}"
            gate = result.get("gate")
            if gate is not None and not gate["passed"]:
                return (
                    f"{dep}: the gate was not met (follow rate {100 * gate['follow_rate']:.1f}% "
                    "with e, "
                    f"{100 * gate['without_e']:.1f}% without; required >= "
                    f"{100 * gate['threshold']:.0f}%)"
                )
        return ""

    async def run(self, steps: Steps) -> None:
        """Every phase of the plan in order; the report after each."""
        self.report()  # the skeleton: protocol and pending rows, before any evaluation
        for phase in self.state.plan:
            if phase.name in self.state.phases:
                continue
            if time.monotonic() > self.deadline:
                self.state.skipped.append(phase.name)
                continue
            why = self._why_blocked(phase)
            if why:
                self.state.blocked[phase.name] = why
                continue
            await self._one(phase, steps)
        self.state.running = ""
        self.report(figure=True)

    async def _one(self, phase: Phase, steps: Steps) -> None:
        print(f"[paper_table] phase {phase.name} ...", flush=True)
        self.state.running = phase.name
        self.report()
        try:
            await self._rebuild_inputs(phase, steps)
            t0 = time.monotonic()
            result = await steps.run(phase)
        except Exception as e:  # recorded in the report; phases that do not need it still run
            log.exception("paper.phase.failed", phase=phase.name)
            first, _, rest = str(e).partition(
                "\n"
            )  # the cause first (reports show the start), then the log's tail
            self.state.failed[phase.name] = f"{type(e).__name__}: {first[:500]}" + (
                f"\n{rest[-1500:]}" if rest else ""
            )
        else:
            result["wall_s"] = time.monotonic() - t0
            result["host"] = where()
            result["ended"] = _now()
            self._save(phase.name, result)
        self.state.running = ""
        self.report()

    def _save(self, name: str, result: dict[str, Any]) -> None:
        self.state.phases[name] = lib.save_phase(self.work, name, result)
        if self.carried:
            carry.save_state(self.work, self.results, self.cfg.name)

    async def _rebuild_inputs(self, phase: Phase, steps: Steps) -> None:
        """Train again every finished training whose weights ``phase`` loads and that is not on
        disk: only those its spec reads (``refs.weights_read``), not every training its dependencies
        name (a dependency on ``select-sft`` for the room variant must not retrain the chosen SFT).
        Only where the records are carried (their logs are in the repository), and any carried
        record counts, not only those this invocation restored: an earlier invocation may have
        restored them into the work dir and stopped before its rebuild finished (that rebuild
        resumes from its checkpoint)."""
        by_name = {p.name: p for p in self.state.plan}
        sources = {refs.weight_source(ref) for ref in refs.weights_read(phase.spec)} - {None}
        for dep in sorted(s for s in sources if s is not None):
            for path in carry.weight_paths(self.state.phases.get(dep, {})):
                if path.exists():
                    continue
                producer = next(
                    (
                        name
                        for name in (self.state.phases if self.carried else ())
                        if isinstance(by_name[name].spec, TrainSpec)
                        and path in carry.weight_paths(self.state.phases[name])
                    ),
                    None,
                )
                if producer is not None and producer not in self.rebuilt:
                    await self._rebuild(by_name[producer], steps)

    def _link_inherited(self, name: str) -> bool:
        """An inherited training whose weights the other experiment's work dir on this machine still
        holds (``runs/paper/<inherit>/``, a machine that kept its disk): hard-linked into this work
        dir instead of trained again, when that run's record has the same loss curve. Whether it
        did."""
        parent = self.work.parent / self.cfg.effect.inherit
        local = lib.phase_done(parent, name)
        record = self.state.phases[name]
        if name not in self.inherited or local is None:
            return False
        agreement = carry.loss_agreement(record, local, tol=0.0)
        targets = carry.weight_paths(record)
        sources = [parent.resolve() / t.relative_to(self.work.resolve()) for t in targets]
        if not agreement["agrees"] or not all(src.is_dir() for src in sources):
            return False
        for src, dst in zip(sources, targets, strict=True):
            if not dst.exists():
                shutil.copytree(src, dst, copy_function=os.link)
        print(f"[paper_table] {name}: weights linked from {parent} (same loss curve)", flush=True)
        self._save(
            name,
            {
                **record,
                "rebuilds": [
                    *record.get("rebuilds", []),
                    {**agreement, "linked_from": str(parent)},
                ],
            },
        )
        return True

    async def _rebuild(self, phase: Phase, steps: Steps) -> None:
        """Train ``phase`` again (its inputs first) from the committed logs; the same weight paths,
        and the loss curve compared with the recorded one (``rebuilds`` in its result). An inherited
        training still on this machine's disk is linked instead (:meth:`_link_inherited`)."""
        self.rebuilt.add(phase.name)
        if self._link_inherited(phase.name):
            return
        await self._rebuild_inputs(phase, steps)
        print(f"[paper_table] rebuilding {phase.name} from the committed logs ...", flush=True)
        old = self.state.phases[phase.name]
        new = await steps.run(phase)
        moved = carry.moved_weights(old, new)
        if moved:
            raise RuntimeError(
                f"rebuilding {phase.name} wrote its weights elsewhere ({', '.join(moved)})"
            )
        agreement = carry.loss_agreement(old, new)
        print(f"[paper_table] rebuilt {phase.name}: {carry.describe(agreement)}", flush=True)
        self._save(
            phase.name,
            {
                **old,
                "rebuilds": [
                    *old.get("rebuilds", []),
                    {**agreement, "host": where(), "ended": _now()},
                ],
            },
        )


def _now() -> str:
    """UTC, to the microsecond: when a phase or a rebuild finished (the report orders them by
    it)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")


@functools.cache
def where() -> dict[str, Any]:
    """The CPU, its kernels and the commit this process runs phases on (``bench.host``): a record
    from one CPU kind does not rebuild bit for bit on another (their bf16 kernels round
    differently)."""
    from bench.host import host_record

    h = host_record()
    keys = ("cpu_model", "torch_cpu_capability", "isa_overrides", "commit")
    return {**{k: h[k] for k in keys}, "flags": sorted(f for f, on in h["flags"].items() if on)}


def stop_on_sigterm(after_s: float | None = None) -> None:
    """SIGTERM cancels the calling task as Ctrl-C does, so that the servers and the training child
    stop with it (the finished phases are already saved; the running one starts again next time, a
    training from the checkpoint of the step its child was in: ``children.TRAIN_GRACE_S``); with
    ``after_s``, so does that much time (``--stop-minutes``: a working period's end)."""
    task = asyncio.current_task()
    if task is not None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        if after_s is not None:
            loop.call_later(after_s, task.cancel)


async def run_experiment(
    cfg: PaperConfig,
    work: Path,
    results: Path,
    max_minutes: float,
    stop_minutes: float | None = None,
) -> None:
    """Start the log, the servers and the engine client, run the plan, write the report; stop after
    ``stop_minutes`` whatever runs."""
    from contextlib import AsyncExitStack

    from leafe.actors.client import SGLangClient
    from leafe.learner.model_io import HFChatTokenizer, resolve_model
    from leafe.services.bus import connect, ensure_streams
    from leafe.services.bus.nats_server import EmbeddedNats
    from leafe.services.inference.fleet import FleetConfig, ServerFleet

    stop_on_sigterm(None if stop_minutes is None else 60 * stop_minutes)
    started = time.monotonic()
    deadline = started + 60 * max_minutes
    work.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (once, before anything runs)
    runner = Runner(cfg, work, results, deadline, carried=True)
    if runner.restored:
        print(
            f"[paper_table] restored {len(runner.restored)} finished phase(s) from the repository",
            flush=True,
        )
    runner.report()
    (work / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg), indent=1))
    async with AsyncExitStack() as stack:
        nats = EmbeddedNats(work / "nats", log_file=work / "nats.log").start()
        stack.callback(nats.stop)
        base = await asyncio.to_thread(resolve_model, cfg.model)
        runner.base_model = str(base)
        urls = list(cfg.serving.engines)
        s, key_file, admin_key_file = cfg.serving, "", ""
        if (
            not urls
        ):  # one server process per core (services/inference/fleet.py), not in this process
            fleet = FleetConfig(
                model=str(base),
                servers=s.servers,
                dtype=s.dtype,
                max_batch=s.concurrency,
                threads=s.threads,
                served_model_name="paper-table",
                weight_version="base",
                extra_args=("--weights-root", str(work)),
            )
            servers = await stack.enter_async_context(ServerFleet(fleet))
            urls, key_file = list(servers.urls), servers.api_key_file
            admin_key_file = servers.admin_key_file  # its phases reload the servers' weights
        engine = await stack.enter_async_context(
            SGLangClient(urls, api_key_file=key_file, admin_key_file=admin_key_file)
        )
        nc = await connect(nats.url, name="paper-table")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        ctx = lib.Ctx(
            work=work,
            logs=results / "paper_logs" / cfg.name,
            nats_url=nats.url,
            js=js,
            engine=engine,
            tokenizer=HFChatTokenizer.from_dir(base),
            base_model=await asyncio.to_thread(_base_export, base, work / "base-weights"),
            env=cfg.env,
            concurrency=s.concurrency,
        )
        steps = Steps(cfg, ctx, runner.state.plan, runner.state.phases.get)
        try:
            await runner.run(steps)
        finally:
            wall = time.monotonic() - started
            runner.state.invocations.append({"wall_s": wall, "max_minutes": max_minutes})
            runner.state.inference = await lib.server_stats(urls[0], key_file)
            _save_invocations(work, wall, max_minutes, runner.state)
            carry.save_state(work, results, cfg.name)
            runner.report()


def _save_invocations(work: Path, wall: float, max_minutes: float, state: State) -> None:
    """Append this invocation to ``<work>/invocations.json`` (the report lists them all)."""
    path = work / "invocations.json"
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    old.append(
        {"ended": now, "wall_s": wall, "max_minutes": max_minutes, "phases_done": len(state.phases)}
    )
    path.write_text(json.dumps(old, indent=1) + "\n", encoding="utf-8")
    state.invocations = old


def rewrite_report(cfg: PaperConfig, work: Path, results: Path) -> None:
    """The report (md, json, png, reproduction script) from the finished phases in ``work``,
    starting no service and no phase (the protocol must be the registered one)."""
    from leafe.learner.model_io import resolve_model

    runner = Runner(cfg, work, results, deadline=0.0, carried=True)
    runner.base_model = str(resolve_model(cfg.model))
    path = work / "invocations.json"
    runner.state.invocations = (
        json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    )
    old = results / f"{cfg.report_name}.json"  # the servers' counters of the last invocation
    if old.is_file():
        runner.state.inference = json.loads(old.read_text(encoding="utf-8")).get("inference", {})
    runner.report(figure=True)


def _base_export(base: Path, out: Path) -> Path:
    """The base model as an export under the work dir, with a manifest: the servers load weights
    only from under their weights root (the work dir) and only with a manifest, and Base is loaded
    back after other rows. Written once; the same weights bit for bit (float32, as converted)."""
    if (out / "manifest.json").is_file():
        return out
    import torch

    from leafe.learner.model_io import export_weights, load_model

    model = load_model(base)
    export_weights(model.state_dict(), out, config_dir=base, version="base", dtype=torch.float32)
    return out
