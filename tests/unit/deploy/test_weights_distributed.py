"""components/weights-distributed on the gpu overlay: weight pushes over the wire. One weight-sync
Deployment (rank 0, NCCL, a GPU of its own) finds the SGLang pods through a headless Service and
broadcasts each version to them; the SGLang pods lose their disk sidecar; NetworkPolicies open the
rendezvous port and NCCL's pinned port range between exactly these pods. Without the component the
gpu overlay is what it was. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from leafe.services.config import load_config
from leafe.services.weight_sync.main import _parser
from leafe.services.weight_sync.service import WeightSyncConfig
from tests.support.clihelp import command_of, verb_help
from tests.support.manifests import (
    K8S_VERSION,
    Doc,
    flags_of,
    leafe_invocation,
    pod_templates,
    render_stack,
)
from tests.support.policies import (
    egress_peers,
    ingress_peers,
    pod_labels,
    restricted_violations,
    selects,
)

Docs = list[Doc]
ADDED = {
    ("Deployment", "weight-sync"),
    ("Service", "sglang-engines"),
    ("NetworkPolicy", "weight-sync"),
    ("NetworkPolicy", "sglang-weights"),
}
CHANGED = {("Deployment", "sglang")}
DATA_PORTS = ("40000-40999", "TCP")
RENDEZVOUS = (29600, "TCP")
HTTP = (30000, "TCP")


@pytest.fixture(scope="module")
def wired(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> Docs:
    return render_stack(
        "gpu", ["weights-distributed"], tmp_path_factory.mktemp("wire") / "gpu", kubectl
    )


def _key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], re.sub(r"-[a-z0-9]{10}$", "", doc["metadata"]["name"])


def _by_key(docs: Docs) -> dict[tuple[str, str], Doc]:
    return {_key(d): d for d in docs}


def _pod(docs: Docs, name: str) -> Doc:
    return _by_key(docs)[("Deployment", name)]["spec"]["template"]


def _container(docs: Docs, workload: str, name: str) -> Doc:
    [c] = [c for c in _pod(docs, workload)["spec"]["containers"] if c["name"] == name]
    return c


def test_it_adds_the_sender_and_changes_only_the_sglang_pods(
    wired: Docs, rendered: dict[str, Docs]
) -> None:
    """Everything but the four new documents and the SGLang Deployment renders exactly as the plain
    gpu overlay, and the plain overlay still pushes by disk (a sidecar per SGLang pod)."""
    plain, wire = _by_key(rendered["gpu"]), _by_key(wired)
    assert set(wire) - set(plain) == ADDED and set(plain) <= set(wire)
    assert {k for k in plain if plain[k] != wire[k]} == CHANGED
    assert [c["name"] for c in _pod(rendered["gpu"], "sglang")["spec"]["containers"]] == [
        "sglang",
        "weight-sync",
    ]
    assert [c["name"] for c in _pod(wired, "sglang")["spec"]["containers"]] == ["sglang"]


def test_every_document_validates_strictly(wired: Docs) -> None:
    for doc in wired:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_sender_is_one_least_privileged_pod(wired: Docs) -> None:
    deployment = _by_key(wired)[("Deployment", "weight-sync")]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two senders
    pod = deployment["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False
    for c in pod["initContainers"] + pod["containers"]:
        ctx = c["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"] == {"drop": ["ALL"]}
    [sync] = pod["containers"]
    weights = {m["mountPath"]: m for m in sync["volumeMounts"] if m["name"] == "weights"}
    assert weights["/weights"]["readOnly"] is True
    assert set(weights) == {"/weights", "/weights/store/.in_use"}  # the markers, nothing else
    assert weights["/weights/store/.in_use"]["subPath"] == "store/.in_use"
    assert sync["resources"]["limits"]["nvidia.com/gpu"] == "1"  # NCCL sends from a GPU
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm["medium"] == "Memory"


def _argv(docs: Docs) -> list[str]:
    sync = _container(docs, "weight-sync", "weight-sync")
    return [str(a) for a in sync["command"] + sync.get("args", [])]


def test_the_sender_runs_the_distributed_transport_with_flags_that_exist(wired: Docs) -> None:
    """Its flags are real (``leafe weight-sync --help``) and load into a valid config: distributed
    over NCCL, a fixed rendezvous port, the pod's own address, and servers found by DNS."""
    invocation = leafe_invocation(_argv(wired))
    assert invocation is not None
    verb, args = invocation
    command, args = command_of(verb, args)
    info = verb_help(command)
    assert flags_of(args) <= info.options and info.required <= flags_of(args)
    a = _parser().parse_args([re.sub(r"\$\((\w+)\)", "x", arg) for arg in args])
    cfg = load_config(
        WeightSyncConfig,
        overrides={
            "transport": a.transport,
            "group_backend": a.group_backend,
            "master_address": a.master_address,
            "rendezvous_port": a.rendezvous_port,
            "engines_dns": a.engines_dns,
        },
    )
    assert (cfg.transport, cfg.group_backend, cfg.rendezvous_port) == ("distributed", "nccl", 29600)
    assert args[args.index("--master-address") + 1] == "$(POD_IP)"
    env = {e["name"]: e for e in _container(wired, "weight-sync", "weight-sync")["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    ports = {p["containerPort"] for p in _container(wired, "weight-sync", "weight-sync")["ports"]}
    assert cfg.rendezvous_port in ports


def test_the_dns_name_lists_every_sglang_pod_on_its_port(wired: Docs) -> None:
    argv = _argv(wired)
    name, port = argv[argv.index("--engines-dns") + 1].split(":")
    service = _by_key(wired)[("Service", name)]
    assert service["spec"]["clusterIP"] == "None"  # one record per pod, no load balancing
    assert not service["spec"].get("publishNotReadyAddresses")  # a loading server is not a member
    assert (
        service["spec"]["selector"].items()
        <= pod_labels(_by_key(wired)[("Deployment", "sglang")]).items()
    )
    [sp] = service["spec"]["ports"]
    sglang = _container(wired, "sglang", "sglang")
    sglang_ports = {p["name"]: p["containerPort"] for p in sglang["ports"]}
    assert sp["port"] == int(port) == sglang_ports[sp["targetPort"]]


def test_sglang_pods_lose_the_sidecar_and_what_only_it_used(wired: Docs) -> None:
    pod = _pod(wired, "sglang")
    assert "leafe.io/nats-client" not in pod["metadata"]["labels"]  # no NATS from SGLang pods
    assert not pod["spec"].get("initContainers")
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert volumes == {"weights", "tmp", "dshm", "engine-lock", "liveness"}
    assert restricted_violations(pod["spec"]) == []


def _range(pod: Doc) -> str:
    [sysctl] = pod["spec"]["securityContext"]["sysctls"]
    assert sysctl["name"] == "net.ipv4.ip_local_port_range"
    return "-".join(sysctl["value"].split())


def test_nccl_is_set_alike_in_every_member_and_its_ports_are_the_opened_range(wired: Docs) -> None:
    for workload, container in (("weight-sync", "weight-sync"), ("sglang", "sglang")):
        env = {e["name"]: e.get("value") for e in _container(wired, workload, container)["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_IB_DISABLE"] == "1"
        assert env["NCCL_DEBUG"] == "WARN"
        assert _range(_pod(wired, workload)) == DATA_PORTS[0]


def _reach(docs: Docs, workload: str, direction: str) -> dict[str, set[Any]]:
    """``{workload: ports}`` this workload's pods may send to (receive from), pod peers only (DNS
    and the monitoring namespaces are the base policies', checked there)."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = pod_labels(_by_key(docs)[("Deployment", workload)])
    peers = (egress_peers if direction == "egress" else ingress_peers)(policies, labels)
    out: dict[str, set[Any]] = {}
    for peer in peers:
        if peer.pod_selector is None or peer.namespace_selector is not None:
            continue
        for w, _ in pod_templates(docs):
            if selects(peer.pod_selector, pod_labels(w)):
                ports = peer.ports if peer.ports is not None else {"all"}
                out.setdefault(w["metadata"]["name"], set()).update(ports)
    return out


def test_the_policies_admit_exactly_the_group(wired: Docs, rendered: dict[str, Docs]) -> None:
    """weight-sync: to SGLang on HTTP and the data ports, from SGLang on the rendezvous port and the
    data ports, nobody else. SGLang: the same from its side, plus each other on the data ports (NCCL
    forwards along a ring or tree), plus what it had (the routers on HTTP, NATS gone with the
    sidecar)."""
    assert _reach(wired, "weight-sync", "egress") == {
        "sglang": {HTTP, DATA_PORTS},
        "nats": {(4222, "TCP")},
    }
    assert _reach(wired, "weight-sync", "ingress") == {"sglang": {RENDEZVOUS, DATA_PORTS}}
    assert _reach(wired, "sglang", "egress") == {
        "weight-sync": {RENDEZVOUS, DATA_PORTS},
        "sglang": {DATA_PORTS},
    }
    assert _reach(wired, "sglang", "ingress") == {
        "sglang-router": {HTTP},
        "weight-sync": {HTTP, DATA_PORTS},
        "sglang": {DATA_PORTS},
    }
    assert _reach(rendered["gpu"], "sglang", "ingress") == {"sglang-router": {HTTP}}
    for policy in (d for d in wired if d["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            for p in rule.get("ports", []):
                if "endPort" in p:
                    assert f"{p['port']}-{p['endPort']}" == DATA_PORTS[0], policy["metadata"]


def test_on_cilium_the_data_range_is_opened_by_cilium_policies_between_the_same_pods(
    kubectl: str, tmp_path: Path, wired: Docs
) -> None:
    """Cilium opens only a NetworkPolicy's first port (no ``endPort``): the Cilium component allows
    the range with CiliumNetworkPolicies, between exactly the pods the NetworkPolicies name, and
    changes nothing else."""
    docs = render_stack(
        "gpu", ["weights-distributed", "weights-distributed-cilium"], tmp_path / "c", kubectl
    )
    cilium = [d for d in docs if d["kind"] == "CiliumNetworkPolicy"]
    assert [d for d in docs if d["kind"] != "CiliumNetworkPolicy"] == wired
    pods = {
        w["metadata"]["name"]: pod_labels(w)
        for w, _ in pod_templates(docs)
        if w["metadata"]["name"] in ("weight-sync", "sglang")
    }

    def names(selectors: list[dict[str, Any]]) -> set[str]:
        return {n for s in selectors for n, labels in pods.items() if selects(s, labels)}

    reach: dict[tuple[str, str], set[str]] = {}
    for policy in cilium:
        assert policy["apiVersion"] == "cilium.io/v2" and policy["metadata"]["namespace"] == "leafe"
        [own] = names([policy["spec"]["endpointSelector"]])
        for direction, key in (("ingress", "fromEndpoints"), ("egress", "toEndpoints")):
            for rule in policy["spec"][direction]:
                assert set(rule) == {key, "toPorts"}
                [ports] = rule["toPorts"]
                assert ports == {"ports": [{"port": "40000", "endPort": 40999, "protocol": "TCP"}]}
                reach.setdefault((own, direction), set()).update(names(rule[key]))
    assert reach == {
        ("weight-sync", "ingress"): {"sglang"},
        ("weight-sync", "egress"): {"sglang"},
        ("sglang", "ingress"): {"weight-sync", "sglang"},
        ("sglang", "egress"): {"weight-sync", "sglang"},
    }
    assert DATA_PORTS[0] == "40000-40999"
