"""The optional components (deploy/components/: prometheus-annotations, monitoring, keda-actors,
sandbox-gvisor, sandbox-userns) stacked on each overlay, and the metrics ports they rely on.

PodMonitor and ScaledObject are CRDs without a schema in kubernetes-validate, so their fields are
checked here instead: ports that exist on the selected pods, the actors' real consumer name (from
the actor config type), the NATS monitoring endpoint of the overlay's namespace. The Grafana
dashboard may use only the metric names listed in monitoring/metrics.txt, and shows every one of
them. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.support.manifests import (
    DEPLOY,
    NAMESPACES,
    OVERLAYS,
    Stacks,
    config_map_value,
    containers,
    find,
    leafe_invocation,
    pod_templates,
)
from tests.support.policies import pod_labels, selects

Docs = list[dict[str, Any]]
MONITORING = DEPLOY / "components/monitoring"
METRICS_PORT = {"weight-sync": 9465}
"""--metrics-port per verb: 9464, except the weight-sync sidecar, which shares a pod with a server
on 9464."""


def _ports(template: dict[str, Any]) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in template["spec"]["containers"]
        for p in c.get("ports") or []
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_leafe_service_serves_metrics_on_a_declared_port(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Each long-running leafe service passes --metrics-port (9464; 9465 for weight-sync) and
    declares it as a container port; no two containers of a pod declare the same port; SGLang has
    --enable-metrics."""
    docs = rendered[overlay]
    services = {"actor", "replayer", "learner", "weight-sync", "inference"}
    seen = set()
    for c in containers(docs):
        invocation = leafe_invocation(c.argv)
        if invocation is None or invocation[0] not in services:
            continue
        verb, args = invocation
        port = int(args[args.index("--metrics-port") + 1])
        assert port == METRICS_PORT.get(verb, 9464), c.where
        assert port in {p["containerPort"] for p in c.spec.get("ports") or []}, c.where
        seen.add(verb)
    assert seen == services - ({"inference"} if overlay == "gpu" else set())
    for _, template in pod_templates(docs):
        ports = [
            p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports") or []
        ]
        assert len(ports) == len(set(ports)), template["metadata"]["labels"]
    if overlay == "gpu":
        sglang = next(c for c in containers(docs) if c.spec["name"] == "sglang")
        assert "--enable-metrics" in sglang.argv


def test_scrape_annotations_name_a_port_the_pod_declares(stacks: Stacks) -> None:
    """With prometheus-annotations, every pod that serves metrics says where; the port is one it
    declares."""
    for (overlay, combo), docs in stacks.items():
        if "prometheus-annotations" not in combo:
            continue
        annotated = set()
        for workload, template in pod_templates(docs):
            notes = template["metadata"].get("annotations") or {}
            if "prometheus.io/scrape" not in notes:
                continue
            annotated.add(workload["metadata"]["name"])
            assert notes["prometheus.io/path"] == "/metrics"
            assert int(notes["prometheus.io/port"]) in _ports(template).values(), workload[
                "metadata"
            ]["name"]
        expected = {"actor", "replayer", "learner"} | (
            {"inference"} if overlay == "dev" else {"sglang", "sglang-router"}
        )
        assert annotated == expected, (overlay, combo)


def test_pod_monitors_scrape_ports_that_exist(full_stacks: Stacks) -> None:
    """Every PodMonitor endpoint names a port of the pods it selects (in the overlay that runs
    them), and every pod with a metrics port is scraped by some PodMonitor."""
    for (overlay, _), docs in full_stacks.items():
        monitors = [d for d in docs if d["kind"] == "PodMonitor"]
        scraped: dict[str, set[str]] = {}
        for monitor in monitors:
            for workload, template in pod_templates(docs):
                if selects(monitor["spec"]["selector"], pod_labels(workload)):
                    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                        assert endpoint["port"] in _ports(template), (
                            monitor["metadata"]["name"],
                            endpoint,
                        )
                        assert endpoint["path"] == "/metrics"
                        scraped.setdefault(workload["metadata"]["name"], set()).add(
                            endpoint["port"]
                        )
        for workload, template in pod_templates(docs):
            wanted = {"metrics", "sync-metrics"} & set(_ports(template))
            assert wanted <= scraped.get(workload["metadata"]["name"], set()), (
                overlay,
                workload["metadata"]["name"],
            )
        dashboard = find(docs, "ConfigMap", "leafe-grafana-dashboard")
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["leafe-loop.json"])["uid"] == "leafe-loop"


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads((MONITORING / "dashboard.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets") or []]
    names = {m for expr in exprs for m in re.findall(r"\bleafe_[a-z_]+", expr)}
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in names}


def test_dashboard_shows_every_listed_metric_and_no_other() -> None:
    """dashboard.json uses exactly the metric names of metrics.txt (histograms through _bucket), so
    a test that checks metrics.txt against the code also covers the dashboard."""
    listed = (MONITORING / "metrics.txt").read_text(encoding="utf-8").split()
    assert len(listed) == len(set(listed)) and all(
        re.fullmatch(r"leafe_[a-z_]+", m) for m in listed
    )
    assert _dashboard_metrics() == set(listed)


def test_dashboard_shows_the_loop() -> None:
    """The first row holds the loop: events/s, samples/s, consumer lag, policy version per engine,
    learner loss, success rate."""
    dashboard = json.loads((MONITORING / "dashboard.json").read_text(encoding="utf-8"))
    first_row = [p for p in dashboard["panels"] if p["type"] != "row" and p["gridPos"]["y"] < 17]
    used = {
        m
        for p in first_row
        for t in p["targets"]
        for m in re.findall(r"\bleafe_[a-z_]+", t["expr"])
    }
    assert used == {
        "leafe_replayer_events_total",
        "leafe_replayer_samples_total",
        "leafe_replayer_consumer_lag",
        "leafe_weight_sync_version",
        "leafe_learner_loss",
        "leafe_actor_episodes_total",
    }


def test_keda_scales_the_actors_on_their_runs_task_consumer(stacks: Stacks) -> None:
    """The ScaledObject targets StatefulSet actor (at most its 16 NATS users' worth of pods) with
    the nats-jetstream scaler on stream LEAFE_TASKS and the consumer the actors really use
    (`<ActorServiceConfig.durable>-<run>`), at the monitoring endpoint of the overlay's namespace;
    KEDA owns the replica count (none left in the StatefulSet)."""
    from leafe.actors.config import ActorServiceConfig

    for (overlay, combo), docs in stacks.items():
        if "keda-actors" not in combo:
            continue
        scaled = find(docs, "ScaledObject", "actor")
        target = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "actor"}
        assert scaled["spec"]["scaleTargetRef"] == target
        assert scaled["spec"]["maxReplicaCount"] <= 16
        [trigger] = scaled["spec"]["triggers"]
        run = config_map_value(docs, "leafe-env", "LEAFE_RUN_ID")
        assert trigger["type"] == "nats-jetstream"
        assert trigger["metadata"] | {"lagThreshold": "?"} == {
            "natsServerMonitoringEndpoint": (
                f"nats-headless.{NAMESPACES[overlay]}.svc.cluster.local:8222"
            ),
            "account": "$G",
            "stream": "LEAFE_TASKS",
            "consumer": f"{ActorServiceConfig().durable}-{run}",
            "lagThreshold": "?",
            "activationLagThreshold": "0",
            "useHttps": "false",
        }
        assert int(trigger["metadata"]["lagThreshold"]) >= 1
        assert "replicas" not in find(docs, "StatefulSet", "actor")["spec"]
        assert scaled["metadata"]["namespace"] == NAMESPACES[overlay]


@pytest.mark.parametrize(
    ("component", "field", "value"),
    [("sandbox-gvisor", "runtimeClassName", "gvisor"), ("sandbox-userns", "hostUsers", False)],
)
def test_sandbox_components_change_only_the_actor_pods(
    stacks: Stacks, component: str, field: str, value: object
) -> None:
    """A sandbox component sets its field on the actor pods and on no other pod."""
    for (_, combo), docs in stacks.items():
        if component not in combo:
            continue
        for workload, template in pod_templates(docs):
            has = template["spec"].get(field)
            assert (has == value) == (workload["metadata"]["name"] == "actor"), (
                combo,
                workload["metadata"]["name"],
            )
