"""Invariants of the rendered deploy/ manifests, beyond schema validity (see test_manifests.py for
that).

Resources on every container; probes (no generating health check for startup or readiness); GPU
counts that match torchrun; NATS cluster size vs routes vs stream replicas, servers spread over
nodes; one weight volume at one path, with the sidecars' writable in-use markers and dev's
single-node placement; images and the replay Job following their overlay; the inference tier's
replicas and disruption budgets; the streams Job as the only NATS admin; and the run config files
that decode into each service's config type. Run: ``.venv/bin/python -m pytest tests/unit/deploy
-q``.
"""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from tests.support.manifests import (
    KUSTOMIZATIONS,
    NAMESPACES,
    OVERLAYS,
    config_map_value,
    container_named,
    containers,
    env_value,
    expand_shell,
    find,
    flags_of,
    leafe_invocation,
    parse_quantity,
    pod_templates,
    weight_mounts,
)
from tests.support.policies import selects

Docs = list[dict[str, Any]]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_container_has_resource_requests_and_limits(
    rendered: dict[str, Docs], name: str
) -> None:
    """cpu and memory requests and limits are set on every container, and no limit is below its
    request."""
    problems = []
    for c in containers(rendered[name]):
        resources = c.spec.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource in ("cpu", "memory"):
            if resource not in requests or resource not in limits:
                problems.append(
                    f"{c.where}: {resource} request and limit required, got {resources}"
                )
            elif parse_quantity(limits[resource]) < parse_quantity(requests[resource]):
                problems.append(
                    f"{c.where}: {resource} limit {limits[resource]} < request {requests[resource]}"
                )
    assert not problems, "\n".join(problems)


_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
_GENERATING = {"/health", "/health_generate"}
"""SGLang's generating health checks: a one-token generation, >= 1 s, up to 20 s before it fails."""


def _probe_port(probe: dict[str, Any]) -> int | str:
    """The port a probe checks: an HTTP or TCP probe's, or the one SGLang's liveness.py asks
    ``/health`` on."""
    if "exec" in probe:
        command = probe["exec"]["command"]
        script = next(a for a in command if a.endswith(".py"))
        _, url, *_ = command[command.index(script) + 1 :]  # LOCK_FILE HEALTH_URL [MAX_LOAD_S]
        assert script.endswith("/liveness.py") and url.endswith("/health"), probe
        return int(url.removeprefix("http://127.0.0.1:").split("/")[0])
    action = probe.get("httpGet") or probe.get("tcpSocket")
    assert action, f"probe {probe} is neither httpGet, tcpSocket nor SGLang's liveness.py"
    return action["port"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servers_have_readiness_and_liveness_probes_on_their_own_ports(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Containers serving HTTP (a port named http or monitor) have readiness and liveness probes on
    a port they declare; liveness is an HTTP check (SGLang's, an HTTP check run by liveness.py)."""
    servers = set()
    for c in containers(rendered[overlay]):
        ports = {p["name"]: p["containerPort"] for p in c.spec.get("ports") or []}
        if not {"http", "monitor"} & set(ports):
            continue
        servers.add(c.spec["name"])
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in c.spec, f"{c.where} serves HTTP but has no {probe}"
            port = _probe_port(c.spec[probe])
            assert port in ports or port in ports.values(), f"{c.where}: {probe} port {port}"
        assert "httpGet" in c.spec["livenessProbe"] or c.spec["name"] == "sglang", c.where
    expected = {"dev": {"nats", "inference"}, "gpu": {"nats", "sglang", "router"}}[overlay]
    assert servers == expected


def test_sglang_startup_and_readiness_never_run_a_generation(rendered: dict[str, Docs]) -> None:
    """SGLang's startup and readiness probes call the cheap /ready (auth-exempt in 0.5.23); only the
    liveness probe reaches the generating /health, through liveness.py (never during a weight load:
    tests/unit/deploy/test_gpu_tier.py), rarely, with a timeout beyond SGLang's own 20 s."""
    sglang = container_named(rendered["gpu"], "sglang", "sglang").spec
    for probe in ("startupProbe", "readinessProbe"):
        assert sglang[probe]["httpGet"]["path"] == "/ready", probe
    liveness = sglang["livenessProbe"]
    assert liveness["exec"]["command"][-2].endswith("/health")
    assert liveness["timeoutSeconds"] > 20 and liveness["periodSeconds"] >= 30
    assert (
        liveness["failureThreshold"] * liveness["periodSeconds"] >= 180
    )  # a busy minute is not a death
    assert (
        sglang["startupProbe"]["failureThreshold"] * sglang["startupProbe"]["periodSeconds"] >= 1800
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_startup_or_readiness_probe_calls_a_generating_route(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """No startup or readiness probe anywhere calls /health or /health_generate on an inference
    server; the CPU server's use its cheap /ready."""
    engines = {"inference", "sglang", "router"}
    for c in containers(rendered[overlay]):
        if c.spec["name"] not in engines:
            continue
        for probe in ("startupProbe", "readinessProbe"):
            path = (c.spec.get(probe) or {}).get("httpGet", {}).get("path")
            assert path not in _GENERATING, f"{c.where}: {probe} calls {path}"
    if overlay == "dev":
        server = container_named(rendered["dev"], "inference", "inference").spec
        assert (
            server["startupProbe"]["httpGet"]["path"]
            == server["readinessProbe"]["httpGet"]["path"]
            == "/ready"
        )


def test_gpus_are_requested_only_in_the_gpu_overlay_and_match_torchrun(
    rendered: dict[str, Docs],
) -> None:
    """SGLang pods request GPUs, the learner one GPU per torchrun rank; dev requests no GPU at
    all."""
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
    """gpu: 3 JetStream servers routed to each other, streams replicated 3 times; dev: one server,
    R1."""
    docs = rendered[overlay]
    sts = find(docs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == servers
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert (
        headless["spec"]["clusterIP"] == "None"
        and headless["spec"]["publishNotReadyAddresses"] is True
    )
    conf = config_map_value(docs, "nats-config", "nats.conf")
    routes = [f"nats://nats-{i}.{sts['spec']['serviceName']}:6222" for i in range(servers)]
    assert all(route in conf for route in routes) == (servers > 1) and ("cluster {" in conf) == (
        servers > 1
    )
    job = container_named(docs, "leafe-streams", "streams")
    assert int(job.argv[job.argv.index("--stream-replicas") + 1]) == servers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_weight_store_is_one_volume_at_the_same_path_everywhere(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """The learner writes /weights; servers and weight-sync sidecars read that volume there; each
    sidecar's one writable piece of it is <store>/.in_use, the directory the learner's pruning reads
    its markers from; in gpu an init container of the SGLang pod makes that directory (as uid 10001)
    before the sidecar's subPath mount would make it root's, and writes nothing else. gpu's volume
    is ReadWriteMany, dev's ReadWriteOnce."""
    docs = rendered[overlay]
    modes = find(docs, "PersistentVolumeClaim", "leafe-weights")["spec"]["accessModes"]
    assert modes == {"gpu": ["ReadWriteMany"], "dev": ["ReadWriteOnce"]}[overlay]
    learner = leafe_invocation(container_named(docs, "learner", "learner").argv)
    assert learner is not None
    store = learner[1][learner[1].index("--store") + 1]
    writers: set[str] = set()
    readers: set[str] = set()
    for c in containers(docs):
        for mount in weight_mounts(c):
            if mount.get("subPath"):
                assert c.spec["name"] == "weight-sync" and not mount.get("readOnly"), c.where
                assert (
                    mount["subPath"] == "store/.in_use" and mount["mountPath"] == f"{store}/.in_use"
                ), c.where
                continue
            assert mount["mountPath"] == "/weights", c.where
            (readers if mount.get("readOnly") else writers).add(c.spec["name"])
    assert writers == ({"learner", "weights-dirs"} if overlay == "gpu" else {"learner"})
    if overlay == "gpu":
        script = expand_shell(container_named(docs, "sglang", "weights-dirs").raw_argv)[1][0]
        assert (
            script.startswith(f"mkdir -p {store}/.in_use/reload &&") and script.count("mkdir") == 1
        )
    assert {
        "weight-sync",
        "sglang" if overlay == "gpu" else "inference",
        "actor",
        "replayer",
    } <= readers
    assert store.startswith("/weights/")
    sidecars = [c for c in containers(docs) if c.spec["name"] == "weight-sync"]
    assert sidecars and all(any(m.get("subPath") for m in weight_mounts(c)) for c in sidecars)


def test_dev_keeps_every_pod_of_the_weight_volume_on_one_node(rendered: dict[str, Docs]) -> None:
    """dev's ReadWriteOnce volume attaches to one node: every pod that mounts it (the replay Job's
    too) carries leafe.io/weights and requires the company of the others on one node."""
    term = {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": {"leafe.io/weights": "true"}},
    }
    mounting = set()
    for name in ("dev", "dev-replay"):
        for workload, template in pod_templates(rendered[name]):
            if not any(weight_mounts(c) for c in containers([workload])):
                continue
            mounting.add(workload["metadata"]["name"])
            assert template["metadata"]["labels"]["leafe.io/weights"] == "true", workload[
                "metadata"
            ]["name"]
            affinity = template["spec"]["affinity"]["podAffinity"]
            assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == [term]
    assert mounting == {"actor", "replayer", "learner", "inference", "leafe-replay"}


def _config_types() -> dict[str, type]:
    from leafe.actors.config import ActorServiceConfig
    from leafe.learner.config import LearnerConfig
    from leafe.services.replayer.service import ReplayerConfig

    return {
        "actor.toml": ActorServiceConfig,
        "replayer.toml": ReplayerConfig,
        "learner.toml": LearnerConfig,
    }


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
            if volumes.get(m["name"], {}).get("configMap", {}).get("name")
            == config_map["metadata"]["name"]
            for key in config_map["data"]
        }
        assert path in mounted and path.endswith(f"/{verb}.toml"), (
            f"{c.where}: --config {path} is not mounted"
        )
        verbs.add(verb)
    assert verbs == {"actor", "replayer", "learner"}


def test_run_config_files_decode_into_the_service_config_types(rendered: dict[str, Docs]) -> None:
    """Each TOML file of the run config is a valid config of its service (unknown keys would be
    rejected)."""
    from leafe.services.config import load_config

    data = find(rendered["gpu"], "ConfigMap", "leafe-run-config")["data"]
    configs: dict[str, Any] = {
        key: load_config(type_, overrides=tomllib.loads(data[key]))
        for key, type_ in _config_types().items()
    }
    actor_pod = find(rendered["gpu"], "StatefulSet", "actor")["spec"]["template"]["spec"]
    grace = actor_pod["terminationGracePeriodSeconds"]
    assert (
        configs["actor.toml"].drain_timeout_s < grace
    )  # episodes drain before the kubelet kills the pod
    assert configs["learner.toml"].stop_after_steps == 0  # a StatefulSet service runs until stopped


def _leafe_images(docs: Docs) -> set[str]:
    return {
        c.spec["image"]
        for c in containers(docs)
        if c.spec["image"].rpartition(":")[0].endswith("leafe")
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_follow_the_overlay_including_the_one_off_jobs(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """Every leafe container of an overlay, and of its replay and tasks Jobs, runs the one image the
    overlay names (base's bare `leafe` never survives); SGLang's image is pinned to a version
    tag."""
    expected = {"dev": {"leafe:dev"}, "gpu": {"registry.example.com/leafe:0.1.0"}}[overlay]
    for name in (overlay, f"{overlay}-replay", f"{overlay}-tasks"):
        assert _leafe_images(rendered[name]) == expected, name
    for c in containers(rendered[overlay]):
        image = c.spec["image"]
        assert ":" in image and not image.endswith(":latest"), f"{c.where}: unpinned image {image}"
        pinned_upstream = image.startswith("lmsysorg/sglang:v") or image.startswith(
            "registry.example.com/leafe-router:"
        )
        assert image in expected or pinned_upstream, f"{c.where}: {image}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replay_and_tasks_jobs_work_on_the_overlays_run_with_its_nats_settings(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """The replay Job of an overlay replays that overlay's run with its tokenizer and the tasks Job
    submits to that run; both reach NATS exactly as the services do (same ConfigMap, so same URL and
    TLS settings), in the same namespace."""
    services, replay = rendered[overlay], rendered[f"{overlay}-replay"]
    for key in ("LEAFE_RUN_ID", "LEAFE_MODEL"):
        assert config_map_value(replay, "leafe-replay-env", key) == config_map_value(
            services, "leafe-env", key
        )
    assert find(replay, "ConfigMap", "leafe-nats") == find(services, "ConfigMap", "leafe-nats")
    assert {d["metadata"].get("namespace") for d in replay} == {NAMESPACES[overlay]}
    tasks = rendered[f"{overlay}-tasks"]
    run = config_map_value(services, "leafe-env", "LEAFE_RUN_ID")
    assert config_map_value(tasks, "leafe-tasks-env", "LEAFE_RUN_ID") == run
    assert find(tasks, "ConfigMap", "leafe-nats") == find(services, "ConfigMap", "leafe-nats")
    assert {d["metadata"].get("namespace") for d in tasks} == {NAMESPACES[overlay]}


def test_gpu_nats_servers_must_run_on_three_different_nodes(rendered: dict[str, Docs]) -> None:
    """A node loss never takes two of the three JetStream peers: the anti-affinity across hostnames
    is required in gpu (preferred only in base, for one-node dev clusters)."""
    pod = find(rendered["gpu"], "StatefulSet", "nats")["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]
    assert anti == {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "nats"}},
            }
        ]
    }
    assert find(rendered["gpu"], "PodDisruptionBudget", "nats")["spec"]["maxUnavailable"] == 1


def test_inference_tier_survives_one_disruption(rendered: dict[str, Docs]) -> None:
    """gpu runs at least two routers and two SGLang servers, each behind a PodDisruptionBudget that
    keeps all but one of them up during drains."""
    docs = rendered["gpu"]
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for name in ("sglang-router", "sglang"):
        deployment = find(docs, "Deployment", name)
        replicas = deployment["spec"]["replicas"]
        assert replicas >= 2, name
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        assert len(covering) == 1, name
        assert 1 <= covering[0]["spec"]["maxUnavailable"] < replicas, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_streams_job_administers_streams(rendered: dict[str, Docs], overlay: str) -> None:
    """`leafe streams ensure` runs once per apply as the NATS admin with the overlay's stream
    replicas as a flag (no behaviour in environment variables); no long-running service uses the
    admin's nkey."""
    docs = rendered[overlay]
    job = container_named(docs, "leafe-streams", "streams")
    verb, args = leafe_invocation(job.argv)
    assert (verb, args[:3]) == ("streams", ["ensure", "--nats", "$(LEAFE_NATS_URL)"])
    assert args[3:5] == ["--stream-replicas", {"dev": "1", "gpu": "3"}[overlay]]
    assert args[5:7] == [
        "--run",
        "$(LEAFE_RUN_ID)",
    ]  # the run's durables too: no service may make one
    assert env_value(job, "LEAFE_NATS_NKEY") == "/var/run/secrets/leafe/nats/admin.nk"
    config_maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert not any("STREAM_REPLICAS" in k for c in config_maps for k in c.get("data") or {})
    spec = find(docs, "Job", "leafe-streams")["spec"]
    assert spec["ttlSecondsAfterFinished"] > 0 and spec["backoffLimit"] >= 5
    admins = {
        c.where
        for c in containers(docs)
        if any(str(e.get("value")).endswith("/admin.nk") for e in c.spec.get("env") or [])
    }
    assert admins == {job.where}
