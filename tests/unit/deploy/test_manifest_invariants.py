"""Invariants of the rendered deploy/ manifests, beyond schema validity (see test_manifests.py for that).

Resources and probes on every container, GPU counts that match torchrun, NATS cluster size vs routes vs
stream replicas (and `nats-server -t` on the rendered configs), NetworkPolicy labels that match what each
pod runs, non-root security contexts, one RWX weight volume at one path, and the run config files that
decode into each service's config type. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import base64
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.support.manifests import (
    KUSTOMIZATIONS,
    NATS_VERBS,
    OVERLAYS,
    config_map_value,
    container_named,
    containers,
    env_value,
    find,
    flags_of,
    leafe_invocation,
    parse_quantity,
    pod_templates,
    pods_running,
    pods_with_label,
)

Docs = list[dict[str, Any]]
# SGLang writes JIT artefacts in places that cannot all be redirected to a volume.
WRITABLE_ROOT_ALLOWED = {"sglang"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_container_has_resource_requests_and_limits(rendered: dict[str, Docs], name: str) -> None:
    """cpu and memory requests and limits are set on every container, and no limit is below its request."""
    problems = []
    for c in containers(rendered[name]):
        resources = c.spec.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource in ("cpu", "memory"):
            if resource not in requests or resource not in limits:
                problems.append(f"{c.where}: {resource} request and limit required, got {resources}")
            elif parse_quantity(limits[resource]) < parse_quantity(requests[resource]):
                problems.append(
                    f"{c.where}: {resource} limit {limits[resource]} < request {requests[resource]}"
                )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_http_servers_have_readiness_and_liveness_probes(rendered: dict[str, Docs], overlay: str) -> None:
    """Containers serving HTTP (a port named http or monitor) have httpGet readiness and liveness probes."""
    servers = set()
    for c in containers(rendered[overlay]):
        ports = {p["name"]: p["containerPort"] for p in c.spec.get("ports") or []}
        if not {"http", "monitor"} & set(ports):
            continue
        servers.add(c.spec["name"])
        for probe in ("readinessProbe", "livenessProbe"):
            http = (c.spec.get(probe) or {}).get("httpGet")
            assert http, f"{c.where} serves HTTP but has no httpGet {probe}"
            assert http["port"] in ports or http["port"] in ports.values(), (
                f"{c.where}: {probe} port {http['port']}"
            )
    expected = {"dev": {"nats", "inference"}, "gpu": {"nats", "sglang", "router"}}[overlay]
    assert servers == expected


def test_gpus_are_requested_only_in_the_gpu_overlay_and_match_torchrun(rendered: dict[str, Docs]) -> None:
    """SGLang pods request GPUs, the learner one GPU per torchrun rank; dev requests no GPU at all."""
    for c in containers(rendered["dev"]):
        assert "nvidia.com/gpu" not in str(c.spec.get("resources")), c.where
    gpu = rendered["gpu"]
    sglang = container_named(gpu, "sglang", "sglang")
    resources = sglang.spec["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
    assert sglang.argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert {"--model-path", "--host", "--port"} <= flags_of(sglang.argv)
    learner = container_named(gpu, "learner", "learner")
    nproc = int(env_value(learner, "LEARNER_NPROC_PER_NODE"))
    assert int(learner.spec["resources"]["limits"]["nvidia.com/gpu"]) == nproc > 1


@pytest.mark.parametrize(("overlay", "servers"), [("dev", 1), ("gpu", 3)])
def test_nats_cluster_size_matches_routes_and_stream_replicas(
    rendered: dict[str, Docs], overlay: str, servers: int
) -> None:
    """gpu: 3 JetStream servers routed to each other, streams replicated 3 times; dev: one server, R1."""
    docs = rendered[overlay]
    sts = find(docs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == servers
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    conf = config_map_value(docs, "nats-config", "nats.conf")
    routes = [f"nats://nats-{i}.{sts['spec']['serviceName']}:6222" for i in range(servers)]
    assert all(route in conf for route in routes) == (servers > 1) and ("cluster {" in conf) == (servers > 1)
    assert int(config_map_value(docs, "leafe-env", "LEAFE_STREAM_REPLICAS")) == servers


def _nats_auth_conf(docs: Docs) -> str:
    secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "nats-auth"]
    if secrets:  # dev generates it; gpu expects it from the operator (deploy/README.md)
        return base64.b64decode(secrets[0]["data"]["auth.conf"]).decode()
    bcrypt = "$2a$11$0123456789012345678901uABCDEFGHIJKLMNOPQRSTUVWXYZ0123"
    return f'authorization {{ users: [ {{ user: leafe, password: "{bcrypt}" }} ] }}\n'


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_config_is_accepted_by_nats_server(
    rendered: dict[str, Docs], overlay: str, tmp_path: Path
) -> None:
    """The rendered nats.conf, with the auth include at its mount path, passes `nats-server -t`."""
    from services.bus.nats_server import find_nats_server

    docs = rendered[overlay]
    mounts = {m["name"]: m["mountPath"] for m in container_named(docs, "nats", "nats").spec["volumeMounts"]}
    config_dir = tmp_path / mounts["config"].lstrip("/")
    auth_dir = tmp_path / mounts["auth"].lstrip("/")
    config_dir.mkdir(parents=True)
    auth_dir.mkdir(parents=True)
    (config_dir / "nats.conf").write_text(
        config_map_value(docs, "nats-config", "nats.conf"), encoding="utf-8"
    )
    (auth_dir / "auth.conf").write_text(_nats_auth_conf(docs), encoding="utf-8")
    proc = subprocess.run(
        [str(find_nats_server()), "-c", str(config_dir / "nats.conf"), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"POD_NAME": "nats-0"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_network_policy_labels_match_what_each_pod_runs(rendered: dict[str, Docs], name: str) -> None:
    """Exactly the pods running a NATS-using verb reach NATS; actors (and the router) reach the engines."""
    docs = rendered[name]
    assert pods_with_label(docs, "leafe.io/nats-client") == pods_running(docs, NATS_VERBS)
    engine_clients = pods_running(docs, {"actor", "eval"}) | ({"sglang-router"} if name == "gpu" else set())
    assert pods_with_label(docs, "leafe.io/engine-client") == engine_clients


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default_and_open_only_labelled_paths(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Ingress is denied by default; NATS clients reach 4222, engine clients reach 30000 on engine pods."""
    docs = rendered[overlay]
    deny = find(docs, "NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    nats = find(docs, "NetworkPolicy", "nats")["spec"]
    client_rule = nats["ingress"][0]
    assert client_rule["from"] == [{"podSelector": {"matchLabels": {"leafe.io/nats-client": "true"}}}]
    assert [p["port"] for p in client_rule["ports"]] == [4222]
    engine = find(docs, "NetworkPolicy", "inference")["spec"]
    assert engine["podSelector"] == {"matchLabels": {"leafe.io/engine": "true"}}
    assert engine["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"leafe.io/engine-client": "true"}}}],
            "ports": [{"port": 30000, "protocol": "TCP"}],
        }
    ]
    engines = {"dev": {"inference"}, "gpu": {"sglang", "sglang-router"}}[overlay]
    assert pods_with_label(docs, "leafe.io/engine") == engines


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_run_non_root_without_privilege(rendered: dict[str, Docs], name: str) -> None:
    """Pods run non-root; containers drop all capabilities, never escalate; most have a read-only root."""
    for _, template in pod_templates(rendered[name]):
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    for c in containers(rendered[name]):
        context = c.spec["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, c.where
        assert context["capabilities"]["drop"] == ["ALL"], c.where
        assert context["readOnlyRootFilesystem"] is (c.spec["name"] not in WRITABLE_ROOT_ALLOWED), c.where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_weight_store_is_one_rwx_volume_at_the_same_path_everywhere(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """The learner writes /weights; inference servers and weight-sync sidecars read that RWX volume there."""
    docs = rendered[overlay]
    assert find(docs, "PersistentVolumeClaim", "leafe-weights")["spec"]["accessModes"] == ["ReadWriteMany"]
    writers: set[str] = set()
    readers: set[str] = set()
    for c in containers(docs):
        volumes = {v["name"]: v for v in c.pod["spec"].get("volumes") or []}
        for mount in c.spec.get("volumeMounts") or []:
            claim = volumes.get(mount["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
            if claim == "leafe-weights":
                assert mount["mountPath"] == "/weights", c.where
                (readers if mount.get("readOnly") else writers).add(c.spec["name"])
    assert writers == {"learner"}
    assert {"weight-sync", "sglang" if overlay == "gpu" else "inference"} <= readers
    learner = leafe_invocation(container_named(docs, "learner", "learner").argv)
    assert learner is not None and learner[1][learner[1].index("--store") + 1].startswith("/weights/")


def _config_types() -> dict[str, type]:
    from actors.config import ActorServiceConfig
    from learner.config import LearnerConfig
    from services.replayer_service import ReplayerConfig

    return {"actor.toml": ActorServiceConfig, "replayer.toml": ReplayerConfig, "learner.toml": LearnerConfig}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_reads_its_own_config_file_from_the_run_config(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """`leafe <verb> --config PATH` points at <verb>.toml of the mounted run-config ConfigMap."""
    docs = rendered[overlay]
    config_map = find(docs, "ConfigMap", "leafe-run-config")
    assert set(config_map["data"]) == set(_config_types())
    verbs = set()
    for c in containers(docs):
        invocation = leafe_invocation(c.argv)
        if invocation is None or "--config" not in invocation[1]:
            continue
        verb, args = invocation
        path = args[args.index("--config") + 1]
        volumes = {v["name"]: v for v in c.pod["spec"]["volumes"]}
        mounted = {
            f"{m['mountPath']}/{key}"
            for m in c.spec["volumeMounts"]
            if volumes.get(m["name"], {}).get("configMap", {}).get("name") == config_map["metadata"]["name"]
            for key in config_map["data"]
        }
        assert path in mounted and path.endswith(f"/{verb}.toml"), (
            f"{c.where}: --config {path} is not mounted"
        )
        verbs.add(verb)
    assert verbs == {"actor", "replayer", "learner"}


def test_run_config_files_decode_into_the_service_config_types(rendered: dict[str, Docs]) -> None:
    """Each TOML file of the run config is a valid config of its service (unknown keys would be rejected)."""
    from services.config import load_config

    data = find(rendered["gpu"], "ConfigMap", "leafe-run-config")["data"]
    configs: dict[str, Any] = {
        key: load_config(type_, overrides=tomllib.loads(data[key])) for key, type_ in _config_types().items()
    }
    actor_pod = find(rendered["gpu"], "Deployment", "actor")["spec"]["template"]["spec"]
    grace = actor_pod["terminationGracePeriodSeconds"]
    assert configs["actor.toml"].drain_timeout_s < grace  # episodes drain before the kubelet kills the pod
    assert configs["learner.toml"].stop_after_steps == 0  # a StatefulSet service runs until stopped
