"""The NetworkPolicies of every rendered kustomization: deny by default in both directions, then
exactly the paths the system uses (tests/support/policies.py evaluates selectors and rules).

Actors run model-written code, so their egress is pinned down completely: DNS, NATS and the
inference entry point, nothing else (no internet, no cloud metadata address, no Kubernetes API). In
gpu they reach SGLang only through the router. Run: ``.venv/bin/python -m pytest tests/unit/deploy
-q``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.manifests import (
    KUSTOMIZATIONS,
    NATS_VERBS,
    OVERLAYS,
    Stacks,
    find,
    pod_templates,
    pods_running,
    pods_with_label,
)
from tests.support.policies import Peer, egress_peers, ingress_peers, pod_labels, selects

Docs = list[dict[str, Any]]
KUBE_DNS = "kube-dns"
MONITORING = {"leafe.io/monitoring": "true"}


def _policies(docs: Docs) -> Docs:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def _labels(docs: Docs, workload: str) -> dict[str, str]:
    return next(pod_labels(w) for w, _ in pod_templates(docs) if w["metadata"]["name"] == workload)


def _destinations(peer: Peer, docs: Docs) -> set[str]:
    """Names of what a peer reaches: workloads of this namespace, ``kube-dns``, or a description of
    what lies outside (``namespaces:<selector>``, ``ip:<cidr>``)."""
    if peer.ip_block is not None:
        return {f"ip:{peer.ip_block['cidr']}"}
    if peer.namespace_selector is not None:
        dns = {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
        if peer.namespace_selector == dns and peer.pod_selector == {
            "matchLabels": {"k8s-app": "kube-dns"}
        }:
            return {KUBE_DNS}
        return {f"namespaces:{peer.namespace_selector}"}
    return {
        w["metadata"]["name"]
        for w, _ in pod_templates(docs)
        if selects(peer.pod_selector, pod_labels(w))
    }


def _reach(docs: Docs, workload: str, direction: str = "egress") -> dict[str, set[Any]]:
    """``{destination: ports}`` a workload's pods may send to (or, for ingress, receive from)."""
    labels = _labels(docs, workload)
    peers = (egress_peers if direction == "egress" else ingress_peers)(_policies(docs), labels)
    out: dict[str, set[Any]] = {}
    for peer in peers:
        for name in _destinations(peer, docs):
            out.setdefault(name, set()).update(peer.ports if peer.ports is not None else {"all"})
    return out


DNS_PORTS = {(53, "UDP"), (53, "TCP")}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_everything_is_denied_by_default_in_both_directions(
    rendered: dict[str, Docs], name: str
) -> None:
    """One policy selects every pod for ingress and egress and allows nothing; the overlays ship it,
    and the replay and tasks kustomizations run inside an overlay's namespace under it."""
    if name.endswith(("-replay", "-tasks")):
        assert not _policies(rendered[name])
        return
    deny = find(rendered[name], "NetworkPolicy", "default-deny")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_network_policy_labels_match_what_each_pod_runs(
    rendered: dict[str, Docs], name: str
) -> None:
    """Exactly the pods running a NATS-using verb carry the NATS client label; only actors are
    engine clients; the engine entry point is the CPU server (dev) or the router (gpu), never an
    SGLang server."""
    docs = rendered[name]
    assert pods_with_label(docs, "leafe.io/nats-client") == pods_running(docs, NATS_VERBS)
    assert pods_with_label(docs, "leafe.io/engine-client") == pods_running(docs, {"actor", "eval"})
    engines = {"dev": {"inference"}, "gpu": {"sglang-router"}}.get(name, set())
    assert pods_with_label(docs, "leafe.io/engine") == engines


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_actors_reach_only_dns_nats_and_the_engine_entry_point(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Actor pods may send to kube-dns on 53, the NATS servers on 4222 and the engine entry point on
    30000: no IP block (so no internet, no 169.254.169.254, no API server), no other pod or
    namespace."""
    docs = rendered[overlay]
    entry = {"dev": "inference", "gpu": "sglang-router"}[overlay]
    assert _reach(docs, "actor") == {
        KUBE_DNS: DNS_PORTS,
        "nats": {(4222, "TCP")},
        entry: {(30000, "TCP")},
    }


def test_in_gpu_sglang_accepts_requests_only_from_the_router(rendered: dict[str, Docs]) -> None:
    """SGLang's port takes traffic from router pods (and metric scrapes from monitoring namespaces)
    only; the router reaches SGLang, DNS and, for pod discovery, HTTPS ports outside except the
    metadata address."""
    docs = rendered["gpu"]
    assert _reach(docs, "sglang", "ingress") == {
        "sglang-router": {(30000, "TCP")},
        f"namespaces:{ {'matchLabels': MONITORING} }": {
            (30000, "TCP"),
            (9464, "TCP"),
            (9465, "TCP"),
        },
    }
    router_out = _reach(docs, "sglang-router")
    assert router_out == {
        KUBE_DNS: DNS_PORTS,
        "sglang": {(30000, "TCP")},
        "ip:0.0.0.0/0": {(443, "TCP"), (6443, "TCP")},
    }
    api = next(
        p.ip_block
        for p in egress_peers(_policies(docs), _labels(docs, "sglang-router"))
        if p.ip_block
    )
    assert api["except"] == ["169.254.169.254/32"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_takes_clients_on_4222_and_routes_from_nats_pods_only(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """NATS servers accept 4222 from NATS clients, 6222 from each other, and send only routes and
    DNS."""
    docs = rendered[overlay]
    clients = pods_with_label(docs, "leafe.io/nats-client")
    inbound = _reach(docs, "nats", "ingress")
    metrics = inbound.pop(f"namespaces:{ {'matchLabels': MONITORING} }")
    assert metrics == {
        (9464, "TCP"),
        (9465, "TCP"),
    }  # no NATS port there: the monitor port is not opened
    assert inbound == {name: {(4222, "TCP")} for name in clients - {"nats"}} | {
        "nats": {(6222, "TCP")}
    }
    assert _reach(docs, "nats") == {KUBE_DNS: DNS_PORTS, "nats": {(6222, "TCP")}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_learner_reaches_nats_and_its_own_peers(rendered: dict[str, Docs], overlay: str) -> None:
    """Learner pods send to DNS, NATS and other learner pods (rendezvous, collectives on any
    port)."""
    assert _reach(rendered[overlay], "learner") == {
        KUBE_DNS: DNS_PORTS,
        "nats": {(4222, "TCP")},
        "learner": {"all"},
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_other_pod_stays_inside_the_namespace(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Apart from the router's API access, no pod may send anywhere but DNS and pods of this
    namespace."""
    docs = rendered[overlay]
    for workload, _ in pod_templates(docs):
        name = workload["metadata"]["name"]
        if name == "sglang-router":
            continue
        outside = {d for d in _reach(docs, name) if d.startswith(("ip:", "namespaces:"))}
        assert not outside, f"{name} reaches {outside}"


def test_keda_component_opens_the_nats_monitor_port_to_keda_only(full_stacks: Stacks) -> None:
    """With components/keda-actors, the KEDA namespace (and nothing else) reaches NATS on 8222."""
    for (overlay, combo), docs in full_stacks.items():
        inbound = _reach(docs, "nats", "ingress")
        monitor = {name for name, ports in inbound.items() if (8222, "TCP") in ports}
        keda = {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}
        assert monitor == {f"namespaces:{keda}"}, (overlay, combo)
