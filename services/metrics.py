"""Every Prometheus metric of the leafe services, defined in one place, and how a service serves
them.

Each long-running service owns one ``*Metrics`` object with its own ``CollectorRegistry`` (never the
process-global default, so in-process tests and services never collide) and serves it on
``--metrics-port`` (0 = off, the default; deploy/ passes 9464, the weight-sync sidecars 9465):

- actor ``leafe_actor_*``: episodes by mode and outcome, steps, unparseable actions, reflections,
  rollbacks, branches, engine latency, episodes in flight;
- replayer ``leafe_replayer_*``: events, samples by kind, dead letters by reason, open episodes,
  lag;
- learner ``leafe_learner_*``: steps, loss by term, tokens/s, dropped samples, policy lag,
  checkpoint and push durations, the step and the samples sequence reached;
- weight-sync ``leafe_weight_sync_*``: served version per engine, update durations, failures per
  engine;
- inference ``leafe_inference_*``: queue depth, decode batch size, prefill/decode/prefix-cache-hit
  tokens;
- run ``leafe_run_validation_*``: the learning curve of ``leafe run``'s online evaluator.

deploy/components/monitoring/metrics.txt lists exactly :func:`metric_names` (a test checks it).
Label values come from small fixed sets (``EPISODE_OUTCOMES``, ``DEAD_LETTER_REASONS``, loss terms,
sample kinds, engine URLs), never from free text. Under torchrun only ``LOCAL_RANK`` 0 binds the
port (one per pod). ``leafe run``'s own ``leafe_run_*`` (:class:`RunMetrics`) are here too; it reads
the services' with ``leafe.services.run.metrics.scrape``.
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from leafe.learner.weight_store import version_index
from leafe.protocol.codec import REFUSALS
from leafe.protocol.events import Branch, EpisodeEvent, Reflection, Rollback, Step
from leafe.services.probes import start_server

if TYPE_CHECKING:
    from leafe.services.probes import ProbeServer

__all__ = [
    "DEAD_LETTER_REASONS",
    "EPISODE_OUTCOMES",
    "LOSS_TERMS",
    "ActorMetrics",
    "InferenceCollector",
    "LearnerMetrics",
    "MetricsServer",
    "ReplayerMetrics",
    "RunMetrics",
    "WeightSyncMetrics",
    "add_metrics_arguments",
    "metric_names",
    "serve_metrics",
]

log = structlog.get_logger(__name__)

EPISODE_OUTCOMES = ("success", "failure", "error", "abandoned")
"""``leafe_actor_episodes_total{outcome}``: finished with a success; finished without one; the
attempt raised (nak'ed for a retry, or terminated); cancelled by a shutdown (nak'ed for
redelivery)."""
DEAD_LETTER_REASONS = (*REFUSALS, "rejected", "other")
"""``leafe_replayer_dead_letters_total{reason}``: the admission refusals of
``leafe.protocol.codec.REFUSALS`` (not decodable, oversized, no codec header, wrong subject, another
run's event, a forged id); refused by the fold (``ReplayError``); anything else."""
LOSS_TERMS = {
    "total": "loss",
    "cf": "loss_cf",
    "reh": "loss_reh",
    "rft": "loss_rft",
    "grpo": "loss_grpo",
    "kl": "kl",
}
"""``leafe_learner_loss{term}`` -> the ``leafe.learner.trainer.StepStats`` field it shows (unset
when ``None``)."""
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Buckets of every duration histogram: CPU generation and checkpoints take seconds to minutes."""
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Buckets of ``leafe_inference_batch_size``."""


def add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    """``--metrics-port`` (0 = no metrics endpoint, the default) and ``--metrics-host``."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this port "
        "(0 = off; under torchrun only LOCAL_RANK 0 binds)",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="interface of the metrics endpoint")


class MetricsServer:
    """A running /metrics endpoint (a daemon thread); :meth:`close` stops it."""

    def __init__(self, httpd: ProbeServer, thread: threading.Thread) -> None:
        self.httpd = httpd
        self.thread = thread
        self.port = int(httpd.server_port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5.0)


def serve_metrics(
    port: int, registry: CollectorRegistry, host: str = "0.0.0.0"
) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port``; ``None`` when ``port`` is 0 or this is not local rank
    0."""
    local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    if port == 0 or local_rank != 0:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"--metrics-port {port}: not a TCP port")
    disable_created_metrics()  # the *_created series double the series count and nothing reads them
    httpd, thread = start_server(
        port, host, registry
    )  # /metrics, and /healthz (services/probes.py)
    log.info("metrics.serving", url=f"http://{host}:{port}/metrics")
    return MetricsServer(httpd, thread)


class ActorMetrics:
    """``leafe_actor_*``: fed by the events an actor publishes and the fate of each delivery."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.episodes = Counter(
            "leafe_actor_episodes_total",
            "Episode attempts by mode and outcome",
            ["mode", "outcome"],
            registry=r,
        )
        self.steps = Counter(
            "leafe_actor_steps_total", "Policy actions published (Step events)", registry=r
        )
        self.unparseable = Counter(
            "leafe_actor_unparseable_total",
            "Steps whose completion held no valid action",
            registry=r,
        )
        self.reflections = Counter("leafe_actor_reflections_total", "Reflection events", registry=r)
        self.rollbacks = Counter("leafe_actor_rollbacks_total", "Rollback events", registry=r)
        self.branches = Counter(
            "leafe_actor_branches_total", "Branch events (root excluded)", registry=r
        )
        self.engine_latency = Histogram(
            "leafe_actor_engine_latency_seconds",
            "Duration of one generate call",
            buckets=_SECONDS,
            registry=r,
        )
        self.in_flight = Gauge("leafe_actor_episodes_in_flight", "Episodes running now", registry=r)
        self.gate_wait = Counter(
            "leafe_actor_gate_wait_seconds_total",
            "Seconds the staleness gate held new training episodes back (actors/staleness.py)",
            registry=r,
        )
        self.gate_lent = Counter(
            "leafe_actor_gate_lent_total",
            "Versions of credit the staleness gate lent after max_wait_s without a push",
            registry=r,
        )

    def observe_event(self, event: EpisodeEvent) -> None:
        """Count one published event."""
        match event:
            case Step():
                self.steps.inc()
                if not event.parse_ok:
                    self.unparseable.inc()
            case Reflection():
                self.reflections.inc()
            case Rollback():
                self.rollbacks.inc()
            case Branch():
                self.branches.inc()

    def episode_ended(self, mode: str, outcome: str) -> None:
        """Count one delivery's end (``outcome`` in :data:`EPISODE_OUTCOMES`)."""
        if outcome not in EPISODE_OUTCOMES:
            raise ValueError(f"episode outcome {outcome!r} is not one of {EPISODE_OUTCOMES}")
        self.episodes.labels(mode=mode, outcome=outcome).inc()


class ReplayerMetrics:
    """``leafe_replayer_*``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.events = Counter(
            "leafe_replayer_events_total", "Events delivered and folded", registry=r
        )
        self.samples = Counter(
            "leafe_replayer_samples_total",
            "Samples published (acknowledged) by kind",
            ["kind"],
            registry=r,
        )
        self.dead_letters = Counter(
            "leafe_replayer_dead_letters_total",
            "Messages moved to the dead-letter subject",
            ["reason"],
            registry=r,
        )
        self.open_episodes = Gauge(
            "leafe_replayer_open_episodes", "Episodes the fold holds open", registry=r
        )
        self.held_anchors = Gauge(
            "leafe_replayer_held_anchors",
            "Anchors (open episodes' EpisodeStarted) held unacked; all else delivered is acked "
            "when idle",
            registry=r,
        )
        self.consumer_lag = Gauge(
            "leafe_replayer_consumer_lag",
            "Events not yet delivered to the replayer (num_pending)",
            registry=r,
        )
        self._refusals_seen: dict[str, int] = {}

    def dead_letter(self, reason: str) -> None:
        """Count one dead letter under its category (unknown categories count as ``other``)."""
        self.dead_letters.labels(reason=reason if reason in DEAD_LETTER_REASONS else "other").inc()

    def admission_refusals(self, counts: dict[str, int]) -> None:
        """Catch up with the consumer's own counts of the messages it refused (per category)."""
        for category, total in counts.items():
            new = total - self._refusals_seen.get(category, 0)
            if new > 0:
                reason = category if category in DEAD_LETTER_REASONS else "other"
                self.dead_letters.labels(reason=reason).inc(new)
                self._refusals_seen[category] = total


LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Buckets of the per-sample policy-lag histogram (versions)."""


class _TrainingPosition:
    """``leafe_learner_step`` and ``leafe_learner_samples_seq`` as one collector: both are set and
    read under one lock, so a scrape never pairs a step with another step's sequence (``leafe
    run`` decides from the pair whether a step's push is still to come)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step = 0
        self._samples_seq = 0

    def set(self, step: int, samples_seq: int) -> None:
        with self._lock:
            self._step, self._samples_seq = step, samples_seq

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            step, seq = self._step, self._samples_seq
        yield GaugeMetricFamily(
            "leafe_learner_step", "Optimizer steps so far (checkpointed ones included)", value=step
        )
        yield GaugeMetricFamily(
            "leafe_learner_samples_seq",
            "Every samples-stream sequence <= this was consumed",
            value=seq,
        )


class LearnerMetrics:
    """``leafe_learner_*``; ``step`` and ``samples_seq`` are where training stands (a restarted
    learner resumes them from its checkpoint), ``steps_total`` counts this process's steps."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.steps = Counter(
            "leafe_learner_steps_total", "Optimizer steps taken by this process", registry=r
        )
        self.loss = Gauge(
            "leafe_learner_loss", "Loss terms of the latest step", ["term"], registry=r
        )
        self.tokens_per_second = Gauge(
            "leafe_learner_tokens_per_second",
            "Non-pad tokens per second of the latest step",
            registry=r,
        )
        self.samples_dropped = Counter(
            "leafe_learner_samples_dropped_total",
            "Samples consumed but not trained (stale, ignored_kind, unusable)",
            ["reason"],
            registry=r,
        )
        self.flagged_steps = Counter(
            "leafe_learner_flagged_steps_total",
            "Steps taken that were partial (fewer samples than the global batch), had their "
            "gradient norm clipped (grad_clipped) or a GRPO token capped by the dual clip "
            "(dual_clipped)",
            ["why"],
            registry=r,
        )
        self.skipped_batches = Counter(
            "leafe_learner_skipped_batches_total",
            "Batches consumed with nothing left to train (all stale, of an untrained kind or "
            "unusable): no step taken",
            registry=r,
        )
        self.policy_lag = Gauge(
            "leafe_learner_policy_lag",
            "Largest policy lag (versions) among the latest step's samples",
            registry=r,
        )
        self.sample_lag = Histogram(
            "leafe_learner_sample_policy_lag",
            "Policy lag (versions behind the learner's latest push) of each trained sample at "
            "training "
            "time; samples of unknown versions are not in it, stale ones are counted as dropped",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "leafe_learner_checkpoint_seconds",
            "Duration of a checkpoint",
            buckets=_SECONDS,
            registry=r,
        )
        self.push_seconds = Histogram(
            "leafe_learner_push_seconds",
            "Duration of a push (checkpoint, export, announce)",
            buckets=_SECONDS,
            registry=r,
        )
        self._where = _TrainingPosition()
        r.register(self._where)

    def observe_step(self, stats: Any, *, tokens_per_second: float, policy_lag: int) -> None:
        """One step's ``leafe.learner.trainer.StepStats``, its throughput and its largest policy
        lag."""
        self.steps.inc()
        for term, field in LOSS_TERMS.items():
            value = getattr(stats, field)
            if value is not None:
                self.loss.labels(term=term).set(value)
        self.tokens_per_second.set(tokens_per_second)
        self.policy_lag.set(policy_lag)

    def observe_lags(self, lags: list[int]) -> None:
        """The policy lag of each sample a step trained."""
        for lag in lags:
            self.sample_lag.observe(lag)

    def dropped(self, reason: str, count: int) -> None:
        """``count`` samples consumed without training, for ``reason``."""
        if count:
            self.samples_dropped.labels(reason=reason).inc(count)

    def progress(self, *, step: int, samples_seq: int) -> None:
        """Where training stands (a scrape sees both values of one call, never one of each)."""
        self._where.set(step, samples_seq)


class WeightSyncMetrics:
    """``leafe_weight_sync_*`` (``engine`` is the server's base URL)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.version = Gauge(
            "leafe_weight_sync_version",
            "Version index each engine serves (0 = base model)",
            ["engine"],
            registry=r,
        )
        self.push_seconds = Histogram(
            "leafe_weight_sync_push_seconds",
            "Duration of one /update_weights_from_disk call",
            buckets=_SECONDS,
            registry=r,
        )
        self.failures = Counter(
            "leafe_weight_sync_failures_total",
            "Failed weight updates per engine",
            ["engine"],
            registry=r,
        )

    def served(self, engine: str, version: str) -> None:
        """``engine`` serves ``version`` (names this learner did not produce are not shown)."""
        index = version_index(version)
        if index is not None:
            self.version.labels(engine=engine).set(index)


class RunMetrics:
    """``leafe_run_validation_*``: the learning curve of ``leafe run``'s online evaluator (served by
    the supervisor; ``services/run/rounds.py`` sets them at every curve point)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.passk = Gauge(
            "leafe_run_validation_passk",
            "Pass@k of the served version on the validation slice, last curve point",
            ["k"],
            registry=r,
        )
        self.unparseable = Gauge(
            "leafe_run_validation_unparseable",
            "Unparseable answers on the validation slice, last curve point (fraction)",
            registry=r,
        )
        self.learner_step = Gauge(
            "leafe_run_validation_learner_step", "Learner step of the last curve point", registry=r
        )
        self.points = Counter(
            "leafe_run_validation_points_total", "Curve points measured", registry=r
        )

    def point(self, passk: dict[int, float], unparseable: float, learner_step: int) -> None:
        """A new curve point."""
        for k, v in passk.items():
            self.passk.labels(k=str(k)).set(v)
        self.unparseable.set(unparseable)
        self.learner_step.set(learner_step)
        self.points.inc()


class InferenceCollector:
    """``leafe_inference_*`` read at scrape time from the engine's own counters: ``state`` returns
    ``GenerationEngine.describe()`` (what ``/get_server_info`` shows as ``internal_states``), or
    ``None`` before the engine exists. The engine counts decode steps per batch size in
    ``batch_sizes``."""

    def __init__(self, state: Callable[[], Mapping[str, Any] | None]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        """The families, with samples once the engine runs."""
        s = self.state()
        queue = GaugeMetricFamily("leafe_inference_queue_depth", "Requests waiting to be admitted")
        sizes = HistogramMetricFamily("leafe_inference_batch_size", "Sequences per decode step")
        tokens = {
            "prefill_tokens": CounterMetricFamily(
                "leafe_inference_prefill_tokens", "Prompt tokens run through prefill"
            ),
            "decode_tokens": CounterMetricFamily(
                "leafe_inference_decode_tokens", "Tokens generated by decode steps"
            ),
            "cached_tokens": CounterMetricFamily(
                "leafe_inference_prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache",
            ),
        }
        if s is not None:
            queue.add_metric([], float(s["waiting"]))
            counts = {int(k): int(v) for k, v in dict(s.get("batch_sizes") or {}).items()}
            buckets = [
                (floatToGoString(le), sum(c for n, c in counts.items() if n <= le)) for le in _BATCH
            ]
            buckets.append(("+Inf", sum(counts.values())))
            sizes.add_metric([], buckets, sum_value=sum(n * c for n, c in counts.items()))
            for key, family in tokens.items():
                family.add_metric([], float(s[key]))
        yield queue
        yield sizes
        yield from tokens.values()


def _exposition_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def metric_names() -> list[str]:
    """Every ``leafe_*`` metric name as Prometheus shows it (counters with ``_total``), sorted."""
    names: set[str] = set()
    for cls in (ActorMetrics, ReplayerMetrics, LearnerMetrics, WeightSyncMetrics, RunMetrics):
        names |= _exposition_names(cls().registry)
    inference = CollectorRegistry()
    inference.register(InferenceCollector(lambda: None))
    return sorted(names | _exposition_names(inference))
