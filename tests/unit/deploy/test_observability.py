"""Observability on the rendered manifests: actor, replayer and learner are probed on /healthz of
their metrics port (services/probes.py); the monitoring component runs a NATS exporter beside every
NATS server and scrapes it, SGLang's own /metrics and the router's, with dashboard panels for each.
Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from leafe.services.learner.service import PROBE_STALE_S
from tests.support.manifests import (
    DEPLOY,
    OVERLAYS,
    Stacks,
    container_named,
    find,
    leafe_invocation,
    pod_templates,
)
from tests.support.policies import ingress_peers, pod_labels, selects

Docs = list[dict[str, Any]]
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def _budget(probe: dict[str, Any]) -> int:
    return int(probe["periodSeconds"]) * int(probe["failureThreshold"])


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("service", ["actor", "replayer", "learner"])
def test_nats_services_are_probed_on_healthz_of_their_metrics_port(
    rendered: dict[str, Docs], overlay: str, service: str
) -> None:
    """Startup, liveness and readiness all GET /healthz on the port the service serves metrics on;
    startup allows for the slow part before the consumer binds; liveness rides out a NATS restart
    (>= 5 min)."""
    c = container_named(rendered[overlay], service, service)
    invocation = leafe_invocation(c.argv)
    assert invocation is not None and invocation[0] == service, c.where
    args = invocation[1]
    metrics_port = int(args[args.index("--metrics-port") + 1])
    ports = {p["name"]: p["containerPort"] for p in c.spec["ports"]}
    for name in PROBES:
        probe = c.spec.get(name)
        assert probe is not None, f"{c.where}: no {name}"
        assert probe["httpGet"]["path"] == "/healthz", (c.where, name)
        assert ports[probe["httpGet"]["port"]] == metrics_port, (c.where, name)
        assert probe["timeoutSeconds"] >= 5, (c.where, name)
    assert _budget(c.spec["livenessProbe"]) >= 300, c.where
    assert _budget(c.spec["startupProbe"]) >= (600 if service == "actor" else 1800), c.where
    assert PROBE_STALE_S >= 1800  # the learner's own staleness limit covers a slow export


def _monitoring_stacks(full_stacks: Stacks) -> Stacks:
    stacks = {k: v for k, v in full_stacks.items() if "monitoring" in k[1]}
    assert {overlay for overlay, _ in stacks} == set(OVERLAYS)
    return stacks


def test_every_nats_server_has_an_exporter_that_is_scraped_and_admitted(
    full_stacks: Stacks,
) -> None:
    """With the monitoring component: a pinned prometheus-nats-exporter sidecar in the NATS
    StatefulSet reads its own server's monitoring port with JetStream (all streams and consumers),
    varz and connz; a PodMonitor scrapes its port and a NetworkPolicy admits Prometheus's namespaces
    to it; kubectl still defaults to the server container."""
    for (overlay, combo), docs in _monitoring_stacks(full_stacks).items():
        exporter = container_named(docs, "nats", "nats-exporter")
        server = container_named(docs, "nats", "nats")
        image = exporter.spec["image"]
        assert re.fullmatch(r"natsio/prometheus-nats-exporter:\d+\.\d+\.\d+", image), image
        args = exporter.argv
        assert {"-jsz=all", "-varz", "-connz"} <= set(args), args
        monitor = next(p["containerPort"] for p in server.spec["ports"] if p["name"] == "monitor")
        assert args[-1] == f"http://localhost:{monitor}", args
        port = next(p for p in exporter.spec["ports"] if p["name"] == "nats-metrics")
        assert f"-port={port['containerPort']}" in args
        annotations = exporter.pod["metadata"].get("annotations") or {}
        assert annotations.get("kubectl.kubernetes.io/default-container") == "nats"
        monitor_doc = find(docs, "PodMonitor", "nats")
        labels = pod_labels(exporter.workload)
        assert selects(monitor_doc["spec"]["selector"], labels)
        assert [e["port"] for e in monitor_doc["spec"]["podMetricsEndpoints"]] == ["nats-metrics"]
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        admitted = [
            peer
            for peer in ingress_peers(policies, labels)
            if peer.namespace_selector == {"matchLabels": {"leafe.io/monitoring": "true"}}
            and peer.ports is not None
            and (port["containerPort"], "TCP") in peer.ports
        ]
        assert admitted, (overlay, combo)


def test_gpu_engines_are_scraped_on_their_own_metrics_endpoints(full_stacks: Stacks) -> None:
    """SGLang (--enable-metrics: /metrics on its serving port) and the router (--prometheus-port)
    are scraped by PodMonitors naming exactly those ports."""
    for (overlay, _), docs in _monitoring_stacks(full_stacks).items():
        if overlay != "gpu":
            continue
        sglang = container_named(docs, "sglang", "sglang")
        assert "--enable-metrics" in sglang.argv
        serving = int(sglang.argv[sglang.argv.index("--port") + 1])
        sglang_ports = {p["name"]: p["containerPort"] for p in sglang.spec["ports"]}
        endpoints = [
            e["port"] for e in find(docs, "PodMonitor", "sglang")["spec"]["podMetricsEndpoints"]
        ]
        assert sglang_ports[endpoints[0]] == serving, endpoints
        router = container_named(docs, "sglang-router", "router")
        prometheus_port = int(router.argv[router.argv.index("--prometheus-port") + 1])
        router_ports = {p["name"]: p["containerPort"] for p in router.spec["ports"]}
        [endpoint] = find(docs, "PodMonitor", "sglang-router")["spec"]["podMetricsEndpoints"]
        assert router_ports[endpoint["port"]] == prometheus_port
        assert {w["metadata"]["name"] for w, _ in pod_templates(docs)} >= {
            "sglang",
            "sglang-router",
            "nats",
        }


def test_dashboard_has_sglang_router_and_jetstream_panels() -> None:
    """The gpu overlay's engines and the log have panels: SGLang's own metrics, the router's
    per-worker health and load (sglang-router 0.3.2's ``smg_*`` names:
    tests/integration/test_router.py checks them against its real /metrics), JetStream consumer
    backlogs and streams, NATS server totals; all per namespace."""
    dashboard = json.loads(
        (DEPLOY / "components/monitoring/dashboard.json").read_text(encoding="utf-8")
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets") or []]
    for metric in (
        "sglang:num_running_reqs",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "smg_worker_health",
        "smg_worker_cb_outcomes_total",
        "smg_worker_requests_active",
        "jetstream_consumer_num_pending",
        "jetstream_consumer_num_ack_pending",
        "jetstream_stream_total_messages",
        "gnatsd_varz_slow_consumers",
    ):
        using = [e for e in exprs if metric in e]
        assert using, f"no panel uses {metric}"
        assert all('namespace="$namespace"' in e for e in using), using
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
