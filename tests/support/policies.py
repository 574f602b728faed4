"""Helpers that read security settings out of rendered manifests: NetworkPolicy reachability, Pod
Security "restricted" checks, and NATS subject permissions (permissions.json), as pure functions.

NetworkPolicy semantics implemented (enough for these manifests, and strict where they are not): a
policy applies to the pods its podSelector selects, for the policyTypes it lists; traffic is allowed
when any rule of any applying policy allows it; a peer is a podSelector (same namespace), a
namespaceSelector with an optional podSelector, or an ipBlock. Label selectors support matchLabels
and matchExpressions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALLOWED_VOLUME_TYPES",
    "SAFE_SYSCTLS",
    "Peer",
    "egress_peers",
    "ingress_peers",
    "nats_allows",
    "pod_labels",
    "restricted_violations",
    "selects",
    "subject_matches",
]

Doc = dict[str, Any]


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector matches ``labels`` (``{}`` matches everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def pod_labels(workload: Doc) -> dict[str, str]:
    """Labels of a workload's pods."""
    template = (
        workload["spec"].get("template") or workload["spec"]["jobTemplate"]["spec"]["template"]
    )
    return dict(template["metadata"].get("labels") or {})


@dataclass(frozen=True, kw_only=True)
class Peer:
    """One allowed peer of a rule, with the ports of that rule (``None``: every port)."""

    policy: str
    pod_selector: dict[str, Any] | None
    """Selects pods (in the policy's namespace unless ``namespace_selector`` is set); None: not a
    pod peer."""
    namespace_selector: dict[str, Any] | None
    """Selects namespaces; None: the policy's own namespace."""
    ip_block: dict[str, Any] | None
    ports: frozenset[tuple[int | str, str]] | None
    """``(port, protocol)`` pairs (a range as ``"FIRST-LAST"``); None when the rule lists no ports
    (all ports)."""


def _rules(
    policies: list[Doc], labels: dict[str, str], direction: str
) -> Iterator[tuple[str, Doc]]:
    key = {"Ingress": "ingress", "Egress": "egress"}[direction]
    for policy in policies:
        spec = policy["spec"]
        if direction in spec.get("policyTypes", []) and selects(spec["podSelector"], labels):
            for rule in spec.get(key) or []:
                yield policy["metadata"]["name"], rule


def _port(rule_port: dict[str, Any]) -> int | str:
    """A rule's port: the number (or name), or ``"FIRST-LAST"`` for a range (``endPort``)."""
    if "endPort" in rule_port:
        return f"{rule_port['port']}-{rule_port['endPort']}"
    return rule_port["port"]  # type: ignore[no-any-return]


def _peers(policies: list[Doc], labels: dict[str, str], direction: str) -> list[Peer]:
    side = "to" if direction == "Egress" else "from"
    out = []
    for name, rule in _rules(policies, labels, direction):
        ports = rule.get("ports")
        port_set = (
            None if not ports else frozenset((_port(p), p.get("protocol", "TCP")) for p in ports)
        )
        peers = rule.get(side)
        if not peers:  # an empty `to`/`from` means everywhere
            everywhere = {"cidr": "0.0.0.0/0"}
            out.append(
                Peer(
                    policy=name,
                    pod_selector=None,
                    namespace_selector=None,
                    ip_block=everywhere,
                    ports=port_set,
                )
            )
            continue
        for peer in peers:
            out.append(
                Peer(
                    policy=name,
                    pod_selector=peer.get(
                        "podSelector", {} if "namespaceSelector" in peer else None
                    ),
                    namespace_selector=peer.get("namespaceSelector"),
                    ip_block=peer.get("ipBlock"),
                    ports=port_set,
                )
            )
    return out


def egress_peers(policies: list[Doc], labels: dict[str, str]) -> list[Peer]:
    """Every peer that pods with ``labels`` may send to."""
    return _peers(policies, labels, "Egress")


def ingress_peers(policies: list[Doc], labels: dict[str, str]) -> list[Peer]:
    """Every peer that may send to pods with ``labels``."""
    return _peers(policies, labels, "Ingress")


ALLOWED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
"""Volume types the "restricted" Pod Security Standard allows."""
_ALLOWED_CAPS = frozenset({"NET_BIND_SERVICE"})
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
"""Sysctls the "baseline" (and so "restricted") Pod Security Standard allows (Kubernetes 1.32)."""


def _seccomp_ok(context: dict[str, Any] | None) -> bool | None:
    kind = ((context or {}).get("seccompProfile") or {}).get("type")
    return None if kind is None else kind in ("RuntimeDefault", "Localhost")


def restricted_violations(pod: Doc) -> list[str]:
    """How a pod spec breaks the Pod Security "restricted" profile (Kubernetes 1.32); [] when it
    does not."""
    problems = []
    pod_ctx = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            problems.append(f"{flag} is set")
    for volume in pod.get("volumes") or []:
        kind = next(k for k in volume if k != "name")
        if kind not in ALLOWED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} has type {kind}")
    if pod_ctx.get("runAsUser") == 0:
        problems.append("pod runs as uid 0")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"sysctl {sysctl['name']} is not allowed")
    for c in (pod.get("initContainers") or []) + pod["containers"]:
        ctx = c.get("securityContext") or {}
        where = c["name"]
        if ctx.get("privileged"):
            problems.append(f"{where}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where}: does not drop ALL capabilities")
        if set(caps.get("add") or []) - _ALLOWED_CAPS:
            problems.append(
                f"{where}: adds capabilities {sorted(set(caps['add']) - _ALLOWED_CAPS)}"
            )
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            problems.append(f"{where}: runAsNonRoot is not true")
        if ctx.get("runAsUser") == 0:
            problems.append(f"{where}: runs as uid 0")
        seccomp = _seccomp_ok(ctx)
        if seccomp is False or (seccomp is None and not _seccomp_ok(pod_ctx)):
            problems.append(f"{where}: seccomp profile is not RuntimeDefault or Localhost")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append(f"{where}: uses a hostPort")
    return problems


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` matches one token, a final ``>`` one or more tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def nats_allows(permissions: dict[str, Any], action: str, subject: str) -> bool:
    """Whether a role's permissions (publish/subscribe -> allow/deny lists) allow ``action`` on
    ``subject``; deny wins over allow, as in nats-server."""
    rules = permissions.get(action) or {}
    allowed = any(subject_matches(p, subject) for p in rules.get("allow") or [])
    denied = any(subject_matches(p, subject) for p in rules.get("deny") or [])
    return allowed and not denied
