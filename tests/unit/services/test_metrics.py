"""The Prometheus metrics of the services (services/metrics.py): exactly the names deploy/'s
dashboard uses, counters fed by what a service does, per-service registries, and the /metrics
endpoint itself."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from leafe.actors.engine import EngineError, SamplingParams
from leafe.actors.fake_episodes import ExploreSpec, build_explore_episode
from leafe.actors.fakes import ScriptedEngine
from leafe.protocol.events import Branch, Reflection, Rollback, Step
from leafe.services.actor.episode import TimedEngine
from leafe.services.bus.nats_server import free_port
from leafe.services.metrics import (
    ActorMetrics,
    InferenceCollector,
    LearnerMetrics,
    ReplayerMetrics,
    WeightSyncMetrics,
    metric_names,
    serve_metrics,
)
from leafe.services.run.metrics import parse_samples

MONITORING = Path(__file__).resolve().parents[3] / "deploy" / "components" / "monitoring"


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return parse_samples(generate_latest(registry).decode())


def test_metrics_txt_lists_exactly_the_defined_metrics() -> None:
    """deploy/components/monitoring/metrics.txt names every metric the services define, and no
    other."""
    listed = (MONITORING / "metrics.txt").read_text(encoding="utf-8").split()
    assert sorted(listed) == metric_names()


def test_every_metric_the_dashboard_queries_is_defined() -> None:
    """Each ``leafe_*`` name in a dashboard.json expression is a defined metric (histograms through
    their ``_bucket`` series), so no panel stays empty for want of a metric."""
    dashboard = json.loads((MONITORING / "dashboard.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets") or []]
    used = {re.sub(r"_bucket$", "", m) for e in exprs for m in re.findall(r"\bleafe_[a-z_]+", e)}
    assert used and used <= set(metric_names()), used - set(metric_names())


def test_each_service_owns_its_registry() -> None:
    """Two actors in one process (tests, benchmarks) keep separate counters; nothing is registered
    in the process-global default registry."""
    a, b = ActorMetrics(), ActorMetrics()
    a.steps.inc(3)
    assert _samples(a.registry)["leafe_actor_steps_total"] == 3
    assert _samples(b.registry)["leafe_actor_steps_total"] == 0
    from prometheus_client import REGISTRY

    assert not any(f.name.startswith("leafe_") for f in REGISTRY.collect())


def test_actor_counts_the_events_it_publishes() -> None:
    """Steps, unparseable steps, reflections, rollbacks and branches equal those in the published
    events."""
    events = build_explore_episode(
        ExploreSpec(seed=3, max_depth=2, p_success=0.0, p_parse_fail=0.3, reflect_every=2),
        run_id="r1",
        episode_id="r1-ep0",
    )
    metrics = ActorMetrics()
    for event in events:
        metrics.observe_event(event)
    got = _samples(metrics.registry)
    steps = [e for e in events if isinstance(e, Step)]
    want = {
        "leafe_actor_steps_total": len(steps),
        "leafe_actor_unparseable_total": sum(not s.parse_ok for s in steps),
        "leafe_actor_reflections_total": sum(isinstance(e, Reflection) for e in events),
        "leafe_actor_rollbacks_total": sum(isinstance(e, Rollback) for e in events),
        "leafe_actor_branches_total": sum(isinstance(e, Branch) for e in events),
    }
    assert {k: got[k] for k in want} == want
    assert want["leafe_actor_branches_total"] > 0 and want["leafe_actor_unparseable_total"] > 0


def test_episode_outcomes_are_a_fixed_set() -> None:
    """An outcome outside EPISODE_OUTCOMES is a bug (label cardinality), raised naming it."""
    metrics = ActorMetrics()
    metrics.episode_ended("explore", "success")
    assert (
        _samples(metrics.registry)['leafe_actor_episodes_total{mode="explore",outcome="success"}']
        == 1
    )
    with pytest.raises(ValueError, match="'timeout'"):
        metrics.episode_ended("explore", "timeout")


@pytest.mark.anyio
async def test_timed_engine_records_every_generate_call() -> None:
    """Successful and failed generate calls both land in the latency histogram; results pass
    through."""

    class Failing(ScriptedEngine):
        async def generate(self, input_ids: list[int], params: SamplingParams, **kw: Any) -> Any:
            raise EngineError("every server down")

    metrics = ActorMetrics()
    engine = TimedEngine(
        ScriptedEngine(default_action="<action>up</action>"), metrics.engine_latency
    )
    [completion] = await engine.generate([1, 2, 3], SamplingParams())
    assert completion.text == "<action>up</action>" and await engine.weight_version() == "v0"
    with pytest.raises(EngineError):
        await TimedEngine(Failing(), metrics.engine_latency).generate([1], SamplingParams())
    assert _samples(metrics.registry)["leafe_actor_engine_latency_seconds_count"] == 2


def test_replayer_dead_letter_reasons_stay_categories() -> None:
    """Free-text reasons never become label values: unknown categories count as ``other``; the
    consumer's refusal counts (per admission category) are added once, by their increase."""
    metrics = ReplayerMetrics()
    metrics.dead_letter("rejected")
    metrics.dead_letter("unknown branch 'b7' (known: ['b0'])")
    metrics.admission_refusals({"undecodable": 2})
    metrics.admission_refusals({"undecodable": 2, "wrong_run": 1})
    metrics.admission_refusals({"undecodable": 3, "wrong_run": 1})
    got = _samples(metrics.registry)
    dead = {k: v for k, v in got.items() if k.startswith("leafe_replayer_dead_letters_total")}
    assert dead == {
        'leafe_replayer_dead_letters_total{reason="rejected"}': 1,
        'leafe_replayer_dead_letters_total{reason="other"}': 1,
        'leafe_replayer_dead_letters_total{reason="undecodable"}': 3,
        'leafe_replayer_dead_letters_total{reason="wrong_run"}': 1,
    }


def test_learner_step_sets_every_present_loss_term() -> None:
    """A step shows its loss terms (absent ones stay unset), tokens/s, lag, and where training
    stands."""
    stats = SimpleNamespace(
        loss=1.5, loss_cf=2.0, loss_reh=0.5, loss_rft=None, loss_grpo=None, kl=None
    )
    metrics = LearnerMetrics()
    metrics.observe_step(stats, tokens_per_second=120.0, policy_lag=2)
    metrics.progress(step=7, samples_seq=41)
    metrics.dropped("stale", 0)
    metrics.dropped("unusable", 3)
    got = _samples(metrics.registry)
    losses = {k: v for k, v in got.items() if k.startswith("leafe_learner_loss{")}
    assert losses == {
        'leafe_learner_loss{term="total"}': 1.5,
        'leafe_learner_loss{term="cf"}': 2.0,
        'leafe_learner_loss{term="reh"}': 0.5,
    }
    assert got["leafe_learner_steps_total"] == 1 and got["leafe_learner_tokens_per_second"] == 120.0
    assert (
        got["leafe_learner_step"],
        got["leafe_learner_samples_seq"],
        got["leafe_learner_policy_lag"],
    ) == (
        7,
        41,
        2,
    )
    assert got['leafe_learner_samples_dropped_total{reason="unusable"}'] == 3
    assert 'leafe_learner_samples_dropped_total{reason="stale"}' not in got


def test_weight_sync_version_is_the_numeric_index() -> None:
    """``default`` is 0, ``v000004`` is 4; a version this learner never names leaves the gauge
    alone."""
    metrics = WeightSyncMetrics()
    metrics.served("http://a:30000", "default")
    metrics.served("http://b:30000", "v000004")
    metrics.served("http://b:30000", "final-step9")
    got = _samples(metrics.registry)
    assert got['leafe_weight_sync_version{engine="http://a:30000"}'] == 0
    assert got['leafe_weight_sync_version{engine="http://b:30000"}'] == 4


def test_inference_collector_reads_the_engine_counters() -> None:
    """Queue depth, tokens and the decode batch-size histogram (cumulative buckets) come from the
    engine's ``describe()``; before the engine exists the families are there without samples."""
    state: dict[str, Any] | None = None
    registry = CollectorRegistry()
    registry.register(InferenceCollector(lambda: state))
    assert not any(k.startswith("leafe_inference") for k in _samples(registry))
    state = {
        "waiting": 3,
        "prefill_tokens": 900,
        "decode_tokens": 120,
        "cached_tokens": 400,
        "batch_sizes": {1: 10, 4: 20, 9: 5},
    }
    got = _samples(registry)
    assert got["leafe_inference_queue_depth"] == 3
    assert got["leafe_inference_prefill_tokens_total"] == 900
    assert got["leafe_inference_decode_tokens_total"] == 120
    assert got["leafe_inference_prefix_cache_hit_tokens_total"] == 400
    buckets = {k: v for k, v in got.items() if k.startswith("leafe_inference_batch_size_bucket")}
    assert buckets['leafe_inference_batch_size_bucket{le="1.0"}'] == 10
    assert buckets['leafe_inference_batch_size_bucket{le="4.0"}'] == 30
    assert buckets['leafe_inference_batch_size_bucket{le="8.0"}'] == 30
    assert buckets['leafe_inference_batch_size_bucket{le="16.0"}'] == 35
    assert got["leafe_inference_batch_size_count"] == 35
    assert got["leafe_inference_batch_size_sum"] == 10 + 80 + 45


def test_the_endpoint_serves_parseable_metrics_and_is_off_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Port 0 serves nothing; a port serves the registry as Prometheus text; under torchrun only
    local rank 0 binds (one endpoint per pod)."""
    metrics = ReplayerMetrics()
    metrics.events.inc(5)
    assert serve_metrics(0, metrics.registry) is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert serve_metrics(free_port(), metrics.registry, "127.0.0.1") is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    server = serve_metrics(free_port(), metrics.registry, "127.0.0.1")
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    assert parse_samples(text)["leafe_replayer_events_total"] == 5


@pytest.mark.anyio
async def test_replayer_lag_is_the_durables_num_pending() -> None:
    """The replayer's housekeeping sets ``leafe_replayer_consumer_lag`` from its durable's
    ``num_pending``, and a failed consumer-info read leaves the last value instead of stopping the
    replayer."""
    from leafe.services.replayer.service import Replayer, ReplayerConfig

    class FakeJs:
        def __init__(self) -> None:
            self.pending: int | Exception = 7

        async def consumer_info(self, stream: str, durable: str) -> Any:
            if isinstance(self.pending, Exception):
                raise self.pending
            return SimpleNamespace(num_pending=self.pending)

    js = FakeJs()
    fold = SimpleNamespace(name="leafe", open_episodes=2)
    replayer = Replayer(js, run_id="r1", fold=fold, config=ReplayerConfig())  # type: ignore[arg-type]
    replayer.consumer = SimpleNamespace(dead_letters=1, dead_letters_by_category={"undecodable": 1})
    await replayer._housekeeping()
    got = _samples(replayer.metrics.registry)
    assert got["leafe_replayer_consumer_lag"] == 7 and got["leafe_replayer_open_episodes"] == 2
    assert got['leafe_replayer_dead_letters_total{reason="undecodable"}'] == 1
    js.pending = TimeoutError("nats: timeout")
    replayer._last_lag = 0.0  # the next check is due
    await replayer._housekeeping()
    assert _samples(replayer.metrics.registry)["leafe_replayer_consumer_lag"] == 7


def test_a_scrape_never_sees_the_learners_step_and_samples_seq_torn_apart() -> None:
    """``leafe run`` reads where training stands (``leafe_learner_samples_seq``) and the step that
    got there (``leafe_learner_step``) from one scrape; a scrape taken while a step's progress is
    being set must see both old or both new. A torn read (the old step with the new sequence) let a
    phased run skip waiting for the step's push and evaluate on two weight versions at once."""
    import sys
    import threading

    metrics = LearnerMetrics()
    stop = threading.Event()

    def train() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            metrics.progress(step=k, samples_seq=k)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    writer = threading.Thread(target=train, daemon=True)
    writer.start()
    torn = []
    try:
        for _ in range(3000):
            seen = parse_samples(generate_latest(metrics.registry).decode())
            step, seq = seen["leafe_learner_step"], seen["leafe_learner_samples_seq"]
            if step != seq:
                torn.append((step, seq))
    finally:
        stop.set()
        writer.join(timeout=5)
        sys.setswitchinterval(interval)
    assert torn == []
