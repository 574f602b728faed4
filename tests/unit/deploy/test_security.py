"""Trust boundaries in the rendered manifests: Pod Security "restricted" everywhere, secrets only as
files where model-written code could see the environment, the engine API key, and TLS for NATS in
gpu.

Every kustomization and every optional-component combination is checked, because a component (a
sandbox runtime, user namespaces) must not need an exemption. Run: ``.venv/bin/python -m pytest
tests/unit/deploy -q``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.manifests import (
    KUSTOMIZATIONS,
    OVERLAYS,
    Container,
    Stacks,
    config_map_value,
    container_named,
    containers,
    env_value,
    find,
    leafe_invocation,
    mounted_secret_file,
    pod_templates,
)
from tests.support.policies import restricted_violations

Docs = list[dict[str, Any]]
# SGLang writes JIT artefacts in places that cannot all be redirected to a volume ("restricted"
# allows it).
WRITABLE_ROOT_ALLOWED = {"sglang"}
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/warn": "restricted",
    "pod-security.kubernetes.io/audit": "restricted",
}


def _all(rendered: dict[str, Docs], stacks: Stacks) -> dict[str, Docs]:
    return rendered | {
        f"{overlay}+{'+'.join(combo)}": docs for (overlay, combo), docs in stacks.items()
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_enforces_the_restricted_pod_security_standard(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """The overlay's namespace enforces, warns and audits "restricted" (no pod is exempt)."""
    namespaces = [d for d in rendered[overlay] if d["kind"] == "Namespace"]
    assert len(namespaces) == 1
    labels = namespaces[0]["metadata"]["labels"]
    assert {k: labels.get(k) for k in RESTRICTED} == RESTRICTED


def test_every_pod_of_every_combination_meets_restricted(
    rendered: dict[str, Docs], stacks: Stacks
) -> None:
    """Every pod, with every optional component (gVisor, user namespaces, autoscaling, monitoring),
    passes the "restricted" checks: non-root, no escalation, ALL capabilities dropped,
    RuntimeDefault seccomp, restricted volume types, no host namespaces or ports; every container
    but SGLang has a read-only root."""
    problems = []
    for name, docs in _all(rendered, stacks).items():
        for workload, template in pod_templates(docs):
            problems += [
                f"{name} {workload['metadata']['name']}: {p}"
                for p in restricted_violations(template["spec"])
            ]
        for c in containers(docs):
            read_only = c.spec["securityContext"].get("readOnlyRootFilesystem")
            if read_only is not (c.spec["name"] not in WRITABLE_ROOT_ALLOWED):
                problems.append(f"{name} {c.where}: readOnlyRootFilesystem={read_only}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_restricted_check_catches_what_it_should() -> None:
    """The checker flags root, escalation, kept capabilities, unconfined seccomp, hostPath
    volumes and sysctls outside the safe set."""
    good = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "volumes": [{"name": "v", "emptyDir": {}}],
    }
    assert restricted_violations(good) == []
    bad = {
        "securityContext": {
            "seccompProfile": {"type": "Unconfined"},
            "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}],
        },
        "containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}],
        "volumes": [{"name": "v", "hostPath": {"path": "/"}}],
        "hostNetwork": True,
    }
    pinned = {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": "40000 40999"}],
    }
    assert restricted_violations({**good, "securityContext": pinned}) == []
    text = " ".join(restricted_violations(bad))
    for expected in (
        "hostNetwork",
        "hostPath",
        "allowPrivilegeEscalation",
        "drop ALL",
        "SYS_ADMIN",
        "runAsNonRoot",
        "seccomp",
        "net.core.somaxconn",
    ):
        assert expected in text


def _secret_env(c: Container) -> list[str]:
    names = [
        e["name"] for e in c.spec.get("env") or [] if "secretKeyRef" in (e.get("valueFrom") or {})
    ]
    names += [
        f"envFrom {s['secretRef']['name']}" for s in c.spec.get("envFrom") or [] if "secretRef" in s
    ]
    return names


def test_no_leafe_container_has_a_secret_in_its_environment(
    rendered: dict[str, Docs], stacks: Stacks
) -> None:
    """No container that runs a leafe verb (actors run model-written code) gets a Secret through env
    or envFrom, and no plain env value or ConfigMap value carries credentials in a URL."""
    problems = []
    for name, docs in _all(rendered, stacks).items():
        for c in containers(docs):
            if leafe_invocation(c.argv) and (secret := _secret_env(c)):
                problems.append(f"{name} {c.where}: {secret}")
            for e in c.spec.get("env") or []:
                if re.search(r"://[^/@\s]+:[^/@\s]+@", str(e.get("value", ""))):
                    problems.append(f"{name} {c.where}: credentials in {e['name']}")
        for doc in docs:
            if doc["kind"] == "ConfigMap" and any(
                "@" in str(v) and "://" in str(v) for v in (doc.get("data") or {}).values()
            ):
                problems.append(
                    f"{name} ConfigMap {doc['metadata']['name']}: a URL with credentials"
                )
    assert not problems, "\n".join(problems)


def test_secrets_in_env_are_only_the_sglang_api_key_of_non_leafe_containers(
    rendered: dict[str, Docs],
) -> None:
    """The only Secret-backed environment: SGLang's API and admin keys, the router's API and
    control-plane keys (neither takes a key file; neither runs model-written code), and the NATS
    server's user public keys."""
    found = {c.where: _secret_env(c) for c in containers(rendered["gpu"]) if _secret_env(c)}
    assert found == {
        "Deployment/sglang:sglang": ["ENGINE_API_KEY", "ENGINE_ADMIN_API_KEY"],
        "Deployment/sglang-router:router": ["ENGINE_API_KEY", "ROUTER_CONTROL_KEY"],
        "StatefulSet/nats:nats": ["envFrom nats-auth"],
    }
    sglang = container_named(rendered["gpu"], "sglang", "sglang").raw_argv
    assert sglang[sglang.index("--admin-api-key") + 1] == "$(ENGINE_ADMIN_API_KEY)"
    router = container_named(rendered["gpu"], "sglang-router", "router").raw_argv
    control = router[router.index("--control-plane-api-keys") + 1]
    assert control.split(":", 3)[2:] == ["admin", "$(ROUTER_CONTROL_KEY)"], control
    for where in ("sglang:sglang", "sglang-router:router"):
        c = container_named(rendered["gpu"], *where.split(":"))
        argv = c.raw_argv
        assert argv[argv.index("--api-key") + 1] == "$(ENGINE_API_KEY)", c.where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_clients_and_the_cpu_server_read_the_api_key_from_a_file(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Actors and weight-sync sidecars name the API key file in LEAFE_ENGINE_API_KEY_FILE; the CPU
    server reads it with --api-key-file; each is a mounted file of Secret leafe-engine-api-key, mode
    0440."""
    docs = rendered[overlay]
    expected = ("leafe-engine-api-key", "api-key")
    clients = [
        c
        for c in containers(docs)
        if (inv := leafe_invocation(c.argv)) and inv[0] in ("actor", "weight-sync")
    ]
    assert {c.spec["name"] for c in clients} == {"actor", "weight-sync"}
    for c in clients:
        assert mounted_secret_file(c, env_value(c, "LEAFE_ENGINE_API_KEY_FILE")) == expected, (
            c.where
        )
    if overlay == "dev":
        server = container_named(docs, "inference", "inference")
        assert (
            mounted_secret_file(server, server.argv[server.argv.index("--api-key-file") + 1])
            == expected
        )


ENGINE_SECRETS = {
    "leafe-engine-api-key": "api",
    "leafe-engine-admin-key": "admin",
    "leafe-router-control-key": "router-control",
}


def _engine_keys(c: Container) -> set[str]:
    """Which engine keys a container can read: Secrets in its environment or mounted into it."""
    names = {
        (e.get("valueFrom") or {}).get("secretKeyRef", {}).get("name")
        for e in c.spec.get("env") or []
    }
    names |= {s["secretRef"]["name"] for s in c.spec.get("envFrom") or [] if "secretRef" in s}
    mounted = {m["name"] for m in c.spec.get("volumeMounts") or []}
    for volume in c.pod["spec"].get("volumes") or []:
        if volume["name"] not in mounted:
            continue
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "secret" in source:
                names.add(source["secret"]["name"])
    return {ENGINE_SECRETS[n] for n in names if n in ENGINE_SECRETS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_engines_and_weight_sync_can_read_the_admin_key(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Which containers can read which engine key: actors only the API key (what /generate
    needs); the engine and its weight-sync sidecar the API and admin keys (weight updates); the
    router (gpu) the API key and its own control-plane key; nothing else any of them."""
    found = {c.where: keys for c in containers(rendered[overlay]) if (keys := _engine_keys(c))}
    engine = {"gpu": "Deployment/sglang:sglang", "dev": "Deployment/inference:inference"}[overlay]
    sidecar = engine.rsplit(":", 1)[0] + ":weight-sync"
    expected = {
        "StatefulSet/actor:actor": {"api"},
        engine: {"api", "admin"},
        sidecar: {"api", "admin"},
    }
    if overlay == "gpu":
        expected["Deployment/sglang-router:router"] = {"api", "router-control"}
    assert found == expected
    sync = container_named(rendered[overlay], *sidecar.split("/", 1)[1].split(":"))
    assert mounted_secret_file(sync, env_value(sync, "LEAFE_ENGINE_ADMIN_KEY_FILE")) == (
        "leafe-engine-admin-key",
        "admin-key",
    )
    if overlay == "dev":
        server = container_named(rendered["dev"], "inference", "inference")
        admin = server.argv[server.argv.index("--admin-key-file") + 1]
        assert mounted_secret_file(server, admin) == ("leafe-engine-admin-key", "admin-key")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_secret_files_are_readable_by_the_pod_group_only(
    rendered: dict[str, Docs], name: str
) -> None:
    """Mounted credential Secrets (NATS nkey seeds, API key) have mode 0440: root and the pod's
    fsGroup."""
    for _, template in pod_templates(rendered[name]):
        for volume in template["spec"].get("volumes") or []:
            secret = volume.get("secret")
            if secret and secret["secretName"].startswith(("leafe-nats-", "leafe-engine-")):
                assert secret["defaultMode"] == 0o440, volume


def test_gpu_nats_uses_tls_for_clients_and_mutual_tls_for_routes(rendered: dict[str, Docs]) -> None:
    """gpu: nats-server loads the certificate from Secret nats-tls (cert-manager key names) for
    clients and verifies route peers; every client connects with tls:// and the CA file mounted from
    that Secret."""
    docs = rendered["gpu"]
    tls = config_map_value(docs, "nats-config", "tls.conf")
    routes = config_map_value(docs, "nats-config", "cluster-tls.conf")
    for conf in (tls, routes):
        for key in ("tls.crt", "tls.key", "ca.crt"):
            assert f"/etc/nats/tls/{key}" in conf
    assert "verify: true" in routes and "verify" not in tls
    nats = container_named(docs, "nats", "nats")
    mount = next(m for m in nats.spec["volumeMounts"] if m["mountPath"] == "/etc/nats/tls")
    volume = next(v for v in nats.pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "nats-tls" and volume["secret"]["optional"] is False
    assert config_map_value(docs, "leafe-nats", "LEAFE_NATS_URL") == "tls://nats:4222"
    ca = config_map_value(docs, "leafe-nats", "LEAFE_NATS_TLS_CA")
    for name in ("gpu", "gpu-replay"):
        for c in containers(rendered[name]):
            if "LEAFE_NATS_NKEY" in {e["name"] for e in c.spec.get("env") or []}:
                assert mounted_secret_file(c, ca) == ("nats-tls", "ca.crt"), c.where


def test_dev_nats_is_plaintext_without_tls_settings(rendered: dict[str, Docs]) -> None:
    """dev skips TLS on purpose (one node, NetworkPolicies): comment-only TLS includes and a nats://
    URL."""
    docs = rendered["dev"]
    for key in ("tls.conf", "cluster-tls.conf"):
        assert all(
            line.startswith("#") for line in config_map_value(docs, "nats-config", key).splitlines()
        )
    assert config_map_value(docs, "leafe-nats", "LEAFE_NATS_URL") == "nats://nats:4222"
    assert "LEAFE_NATS_TLS_CA" not in find(docs, "ConfigMap", "leafe-nats")["data"]
