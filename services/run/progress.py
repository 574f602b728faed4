"""Live progress of a run, read from the log itself: episodes, successes, reflections, rollbacks,
branches, events/s, samples, weight versions, policy lag, and the learner's step and loss.

Counters are fed by ordered (ephemeral) JetStream consumers from the start of the run's subjects, so
a resumed run shows its whole history; the learner's step, loss and consumed sample sequence are
read from its Prometheus metrics (:meth:`RunProgress.on_learner_metrics`). Shown as a rich table on
a terminal (:meth:`RunProgress.table`) and as one line per change elsewhere
(:meth:`RunProgress.status_line`)::

    [exploring 03:12] episodes 5/8 (1 ok) steps 214 (31% unparseable) refl/rb/br 12/12/12
        samples cf=3 reh=9 learner step 4 loss 1.92 weights v000004         (one line, wrapped here)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec
import structlog
from rich.table import Table

from leafe.protocol import (
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Step,
    decode_event,
    decode_weights,
)
from leafe.protocol.events import Branch, Reflection, Rollback
from leafe.protocol.subjects import events_filter, samples_filter
from leafe.services.run.metrics import parse_samples, scrape

__all__ = ["RunProgress"]

log = structlog.get_logger(__name__)


class RunProgress(msgspec.Struct, kw_only=True):
    """Counters of one run (mutable; updated by :meth:`follow`)."""

    run_id: str
    started_at: float = msgspec.field(default_factory=time.time)
    events: int = 0
    episodes_started: dict[str, int] = msgspec.field(default_factory=dict)
    episodes_finished: dict[str, int] = msgspec.field(default_factory=dict)
    successes: dict[str, int] = msgspec.field(default_factory=dict)
    finished_keys: set[str] = msgspec.field(default_factory=set)
    steps: int = 0
    parse_failures: int = 0
    reflections: int = 0
    rollbacks: int = 0
    replay_steps: int = 0
    branches: int = 0
    successful_branches: int = 0
    samples: dict[str, int] = msgspec.field(default_factory=dict)
    weights_version: str = "default"
    weights_step: int = 0
    """The learner step of the newest published version (0 before any push)."""
    learner_step: int = 0
    lag_buckets: dict[str, float] = msgspec.field(default_factory=dict)
    """The learner's cumulative per-sample policy-lag histogram as scraped
    (``..._bucket{le="k"}``)."""
    stale_dropped: int = 0
    """Samples the learner dropped for exceeding ``max_policy_lag``."""
    step_counts: dict[str, int] = msgspec.field(default_factory=dict)
    """The learner process's steps: ``taken``, of them ``partial``, ``grad_clipped`` and
    ``dual_clipped``, and ``skipped`` batches (nothing left to train)."""
    learner_loss: float | None = None
    learner_samples_seq: int = 0
    policy_version: str = "default"
    _task_keys: dict[str, str] = msgspec.field(default_factory=dict)

    def on_event(self, data: bytes) -> None:
        """Count one event (undecodable ones are counted as events only)."""
        self.events += 1
        try:
            ev = decode_event(data)
        except ValueError:
            return
        match ev:
            case EpisodeStarted():
                self.episodes_started[ev.mode] = self.episodes_started.get(ev.mode, 0) + 1
                self._task_keys[ev.episode_id] = f"{ev.mode}:{ev.task_key}"
            case Step():
                self.steps += 1
                self.parse_failures += not ev.parse_ok
                self.policy_version = ev.policy_version
            case Reflection():
                self.reflections += 1
            case Rollback():
                self.rollbacks += 1
                self.replay_steps += ev.replay_steps
            case Branch():
                self.branches += 1
            case Outcome():
                self.successful_branches += ev.success
            case EpisodeFinished():
                mode_key = self._task_keys.pop(ev.episode_id, "?:?")
                mode, _, key = mode_key.partition(":")
                self.episodes_finished[mode] = self.episodes_finished.get(mode, 0) + 1
                self.successes[mode] = self.successes.get(mode, 0) + ev.success
                self.finished_keys.add(key)

    def on_sample(self, subject: str) -> None:
        """Count one sample by kind (the subject's last token)."""
        kind = subject.rsplit(".", 1)[-1]
        self.samples[kind] = self.samples.get(kind, 0) + 1

    def on_weights(self, data: bytes) -> None:
        """Track the newest published version."""
        try:
            w = decode_weights(data)
        except ValueError:
            return
        self.weights_version, self.weights_step = w.version, w.learner_step
        self.learner_step = max(self.learner_step, w.learner_step)

    def on_learner_metrics(self, samples: Mapping[str, float]) -> None:
        """Take the learner's step, loss and consumed sample sequence from its scraped metrics
        (``leafe.services.metrics.parse_samples``); what the scrape lacks keeps its last value."""
        if "leafe_learner_step" in samples:
            self.learner_step = int(samples["leafe_learner_step"])
        if "leafe_learner_samples_seq" in samples:
            self.learner_samples_seq = int(samples["leafe_learner_samples_seq"])
        loss = samples.get('leafe_learner_loss{term="total"}')
        if loss is not None:
            self.learner_loss = loss
        buckets = {
            k: v
            for k, v in samples.items()
            if k.startswith("leafe_learner_sample_policy_lag_bucket")
        }
        if buckets:
            self.lag_buckets = buckets
        stale = samples.get('leafe_learner_samples_dropped_total{reason="stale"}')
        if stale is not None:
            self.stale_dropped = int(stale)
        counts = {
            "taken": samples.get("leafe_learner_steps_total"),
            **{
                why: samples.get(f'leafe_learner_flagged_steps_total{{why="{why}"}}')
                for why in ("partial", "grad_clipped", "dual_clipped")
            },
            "skipped": samples.get("leafe_learner_skipped_batches_total"),
        }
        if counts["taken"] is not None:
            self.step_counts = {k: int(v or 0) for k, v in counts.items()}

    async def read_learner(self, url: str) -> bool:
        """Refresh the learner's figures from its /metrics at ``url``; False when it does not answer
        (while it starts or restarts), and the last values stay."""
        try:
            text = await scrape(url)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.debug("run.learner.metrics_unreadable", url=url, error=f"{type(e).__name__}: {e}")
            return False
        self.on_learner_metrics(parse_samples(text))
        return True

    def summary(self) -> str:
        """The counters on one line (what :meth:`status_line` shows after its stage and clock)."""
        modes = sorted(set(self.episodes_started) | set(self.episodes_finished))
        parts = [
            f"{m + ' ' if len(modes) > 1 else ''}{self.episodes_finished.get(m, 0)}/"
            f"{self.episodes_started.get(m, 0)} ({self.successes.get(m, 0)} ok)"
            for m in modes
        ]
        unparseable = (
            f" ({100 * self.parse_failures / self.steps:.0f}% unparseable)" if self.steps else ""
        )
        samples = " ".join(f"{k}={v}" for k, v in sorted(self.samples.items())) or "0"
        loss = f"{self.learner_loss:.2f}" if self.learner_loss is not None else "-"
        return (
            f"episodes {', '.join(parts) or '0'} steps {self.steps}{unparseable} "
            f"refl/rb/br {self.reflections}/{self.rollbacks}/{self.branches} samples {samples} "
            f"learner step {self.learner_step} loss {loss} weights {self.weights_version}"
        )

    def status_line(self, stage: str, elapsed_s: float, plan: str = "") -> str:
        """``[<stage> <mm:ss> | <plan>] <summary>`` (``h:mm:ss`` past an hour; ``plan``: the stage's
        work done of planned and the time left, ``RunPlan.line``), for logs and non-terminal
        output."""
        minutes, seconds = divmod(int(elapsed_s), 60)
        hours, minutes = divmod(minutes, 60)
        clock = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"
        return f"[{stage} {clock}{' | ' + plan if plan else ''}] {self.summary()}"

    def policy_lag(self) -> int | None:
        """Versions between the newest published weights and the weights of the latest step."""

        def index(v: str) -> int | None:
            return (
                0 if v == "default" else (int(v[1:]) if v[:1] == "v" and v[1:].isdigit() else None)
            )

        a, b = index(self.weights_version), index(self.policy_version)
        return None if a is None or b is None else max(0, a - b)

    def table(self, stage: str, plan: str = "") -> Table:
        """A rich table of the counters (``plan``: work done of planned and time left, a row
        first)."""
        elapsed = max(1e-6, time.time() - self.started_at)
        t = Table(title=f"leafe run {self.run_id} — {stage}", show_header=False, min_width=60)
        t.add_column("what", style="bold")
        t.add_column("value")
        if plan:
            t.add_row("work, time left", plan)
        for mode in sorted(set(self.episodes_started) | set(self.episodes_finished)):
            done, ok = self.episodes_finished.get(mode, 0), self.successes.get(mode, 0)
            rate = f"{100 * ok / done:.0f}%" if done else "-"
            t.add_row(
                f"episodes ({mode})",
                f"{done}/{self.episodes_started.get(mode, 0)} done, success {rate}",
            )
        t.add_row("steps", f"{self.steps} ({self.parse_failures} unparseable)")
        t.add_row(
            "reflections / rollbacks / branches",
            f"{self.reflections} / {self.rollbacks} / {self.branches}",
        )
        t.add_row("env steps replayed", str(self.replay_steps))
        t.add_row("events", f"{self.events} ({self.events / elapsed:.1f}/s)")
        t.add_row("samples", ", ".join(f"{k} {v}" for k, v in sorted(self.samples.items())) or "0")
        loss = f"{self.learner_loss:.4f}" if self.learner_loss is not None else "-"
        t.add_row("learner step / loss", f"{self.learner_step} / {loss}")
        lag = self.policy_lag()
        t.add_row(
            "weights published / policy lag",
            f"{self.weights_version} / {lag if lag is not None else '-'}",
        )
        return t

    async def follow(self, js: Any, stop: asyncio.Event) -> None:
        """Feed the counters from the run's events, samples and weights subjects until ``stop``."""
        from leafe.protocol.subjects import weights_subject

        subs = [
            await js.subscribe(events_filter(self.run_id), ordered_consumer=True),
            await js.subscribe(samples_filter(self.run_id), ordered_consumer=True),
            await js.subscribe(weights_subject(self.run_id), ordered_consumer=True),
        ]
        handlers = [
            lambda m: self.on_event(m.data),
            lambda m: self.on_sample(m.subject),
            lambda m: self.on_weights(m.data),
        ]

        async def pump(sub: Any, handle: Any) -> None:
            while not stop.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:  # nats.errors.TimeoutError is one too
                    continue
                handle(msg)

        try:
            await asyncio.gather(*(pump(s, h) for s, h in zip(subs, handlers, strict=True)))
        finally:
            for s in subs:
                await s.unsubscribe()
