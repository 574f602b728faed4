"""The gpu overlay through its first day on a real cluster, on the rendered manifests: GPU-only node
pools, a weight volume that holds the example model's checkpoints, NATS with fewer actor keys,
KEDA's lag, the router's drain, the Cilium form of the router's API egress, and the learner's
rendezvous. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest

from leafe.learner.config import LearnerConfig, TrainerConfig
from tests.support.manifests import (
    K8S_VERSION,
    KUSTOMIZATIONS,
    Doc,
    Stacks,
    config_map_value,
    container_named,
    containers,
    env_value,
    expand_shell,
    find,
    parse_quantity,
    pod_templates,
    render_stack,
)

Docs = list[Doc]
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
EXAMPLE_PARAMS = {"gpu": 7.62e9, "dev": 135e6}
"""Parameters of each overlay's example model: Qwen2.5-7B-Instruct (deploy/README.md's
weights-loader example; its model card: 7.61B), SmolLM2-135M-Instruct (dev's LEAFE_MODEL)."""


def test_every_gpu_pod_runs_on_tainted_gpu_nodes(rendered: dict[str, Docs], stacks: Stacks) -> None:
    """Every pod of the gpu overlay, of its replay and tasks Jobs and of every optional component
    stacked on it tolerates the nvidia.com/gpu NoSchedule taint, so a cluster of tainted GPU nodes
    alone runs it."""
    gpu_docs = [rendered[n] for n in KUSTOMIZATIONS if n.startswith("gpu")]
    gpu_docs += [docs for (overlay, _), docs in stacks.items() if overlay == "gpu"]
    for docs in gpu_docs:
        for workload, template in pod_templates(docs):
            assert GPU_TAINT in (template["spec"].get("tolerations") or []), workload["metadata"][
                "name"
            ]


def weight_volume_bytes(params: float, trainer: TrainerConfig) -> float:
    """What the weight volume holds at its fullest for a model of ``params`` parameters: the
    checkpoints kept plus the one being written (fp32 master weights and AdamW's two fp32 moments:
    12 B/param), the exports kept plus one in use and one being written, and the base model
    (bf16)."""
    export = (2 if trainer.export_dtype == "bf16" else 4) * params
    checkpoints = (trainer.keep_checkpoints + 1) * 12 * params
    return checkpoints + (trainer.retain_versions + 2) * export + 2 * params


@pytest.mark.parametrize("overlay", ["gpu", "dev"])
def test_the_weight_volume_holds_the_example_models_run(
    rendered: dict[str, Docs], overlay: str
) -> None:
    """The weight PVC is at least what the example model's run fills it with at its peak, computed
    from the learner.toml the overlay renders (keep_checkpoints, retain_versions, export dtype)."""
    docs = rendered[overlay]
    learner = msgspec.convert(
        tomllib.loads(config_map_value(docs, "leafe-run-config", "learner.toml")), LearnerConfig
    )
    need = weight_volume_bytes(EXAMPLE_PARAMS[overlay], learner.trainer)
    size = parse_quantity(
        find(docs, "PersistentVolumeClaim", "leafe-weights")["spec"]["resources"]["requests"][
            "storage"
        ]
    )
    assert size >= need, f"{overlay}: {size / 2**30:.0f} GiB < {need / 2**30:.0f} GiB"
    assert (
        weight_volume_bytes(7.62e9, TrainerConfig()) / 2**30 > 200
    )  # the old 200 Gi could not hold it


def _actor_users(authorization: str) -> list[str]:
    return [
        f"ACTOR_{i}_NKEY"
        for i in range(64)
        if f"${{ACTOR_{i}_NKEY}}" in authorization or f"$ACTOR_{i}_NKEY," in authorization
    ]


def test_nats_starts_with_keys_for_fewer_actors(rendered: dict[str, Docs], tmp_path: Path) -> None:
    """NATS reads the actor slots' placeholders first and Secret nats-auth second (which wins), the
    placeholders are distinct valid user keys for exactly the actor users authorization.conf names,
    and a real nats-server accepts the config with keys for 8 actors only (it refuses it without the
    placeholders, naming the first missing key)."""
    import nkeys

    from leafe.services.bus.nats_server import find_nats_server

    docs = rendered["dev"]
    nats = container_named(docs, "nats", "nats")
    sources = [next(iter(s.values()))["name"] for s in nats.spec["envFrom"]]
    assert [re.sub(r"-[a-z0-9]{10}$", "", s) for s in sources] == ["nats-actor-slots", "nats-auth"]
    placeholders = find(docs, "ConfigMap", "nats-actor-slots")["data"]
    config = find(docs, "ConfigMap", "nats-config")["data"]
    assert sorted(placeholders) == sorted(_actor_users(config["authorization.conf"]))
    assert len(set(placeholders.values())) == len(placeholders)
    for key in placeholders.values():
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
        body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
        assert body[0] == nkeys.PREFIX_BYTE_USER and len(body) == 33 and nkeys.crc16(body) == crc, (
            key
        )
    for name, text in config.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    secret = find(docs, "Secret", "nats-auth")
    real = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    some = {k: v for k, v in real.items() if not k.startswith("ACTOR_") or int(k.split("_")[1]) < 8}
    assert not set(placeholders.values()) & set(real.values())
    conf = next(n for n in ("nats-single.conf", "nats.conf") if n in config)

    def check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [str(find_nats_server()), "-c", str(tmp_path / conf), "-t"]
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=30, env=env | {"POD_NAME": "nats-0"}
        )

    started = check({**placeholders, **some})
    assert started.returncode == 0, started.stdout + started.stderr
    refused = check(some)
    assert refused.returncode != 0 and "ACTOR_8_NKEY" in refused.stdout + refused.stderr


def test_keda_counts_held_tasks_as_the_pods_holding_them(stacks: Stacks) -> None:
    """KEDA's nats-jetstream lag is waiting + held (ack pending) tasks; with lagThreshold = one
    pod's ACTOR_CONCURRENCY, busy pods ask for themselves and the backlog adds a pod per that many
    tasks."""
    checked = 0
    for (overlay, combo), docs in stacks.items():
        if "keda-actors" not in combo:
            continue
        trigger = find(docs, "ScaledObject", "actor")["spec"]["triggers"][0]["metadata"]
        concurrency = env_value(container_named(docs, "actor", "actor"), "ACTOR_CONCURRENCY")
        assert trigger["lagThreshold"] == concurrency, (overlay, combo)
        checked += 1
    assert checked


def test_the_router_drains_before_it_is_killed(rendered: dict[str, Docs]) -> None:
    """The router finishes its requests in flight on SIGTERM for longer than an actor's request may
    take, and the kubelet gives it more than that before SIGKILL."""
    from leafe.actors.config import ActorServiceConfig

    router = container_named(rendered["gpu"], "sglang-router", "router")
    drain = int(router.argv[router.argv.index("--shutdown-grace-period-secs") + 1])
    actor = msgspec.convert(
        tomllib.loads(config_map_value(rendered["gpu"], "leafe-run-config", "actor.toml")),
        ActorServiceConfig,
    )
    assert actor.engine.timeout_s <= drain < router.pod["spec"]["terminationGracePeriodSeconds"]


def test_the_cilium_component_opens_only_the_api_server(kubectl: str, tmp_path: Path) -> None:
    """With components/sglang-cilium the routers reach the Kubernetes API as Cilium matches it (the
    kube-apiserver entity, HTTPS ports), and no NetworkPolicy lets them out to 0.0.0.0/0 any
    more."""
    docs = render_stack("gpu", ["sglang-cilium"], tmp_path / "cilium", kubectl)
    [policy] = [d for d in docs if d["kind"] == "CiliumNetworkPolicy"]
    assert policy["apiVersion"] == "cilium.io/v2" and policy["metadata"]["namespace"] == "leafe"
    router_labels = find(docs, "Deployment", "sglang-router")["spec"]["template"]["metadata"][
        "labels"
    ]
    selector = policy["spec"]["endpointSelector"]["matchLabels"]
    assert selector.items() <= router_labels.items()
    [rule] = policy["spec"]["egress"]
    assert rule["toEntities"] == ["kube-apiserver"]
    assert {p["port"] for p in rule["toPorts"][0]["ports"]} == {"443", "6443"}
    for doc in docs:
        if doc["kind"] == "NetworkPolicy":
            peers = [peer for e in doc["spec"].get("egress") or [] for peer in e.get("to") or []]
            assert not [p for p in peers if "ipBlock" in p], doc["metadata"]["name"]
    narrowed = find(docs, "NetworkPolicy", "sglang-router")
    kubernetes_validate.validate(narrowed, K8S_VERSION, strict=True)
    egress = narrowed["spec"]["egress"]
    assert [peer["podSelector"]["matchLabels"] for e in egress for peer in e["to"]] == [
        {"app.kubernetes.io/name": "sglang"}
    ]


def _rendezvous_wait(docs: Docs, tmp_path: Path, *, pod: str, resolves_to: str, pod_ip: str) -> int:
    """The learner's rendezvous-dns init script run as that pod, with ``getent`` answering
    ``resolves_to`` (nothing if empty) and ``sleep`` returning at once."""
    script = expand_shell(container_named(docs, "learner", "rendezvous-dns").raw_argv)[1][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    answer = f'echo "{resolves_to}    $2.leafe.svc.cluster.local"' if resolves_to else "exit 2"
    for name, body in {"getent": answer, "sleep": "exit 0"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOSTNAME": pod, "POD_IP": pod_ip}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, timeout=60).returncode


def test_the_learner_waits_for_its_rendezvous_name(
    rendered: dict[str, Docs], tmp_path: Path
) -> None:
    """Before torchrun starts, learner-0 waits until the rendezvous host resolves to its own address
    (then torchrun's c10d hosts the store there instead of failing as a client), the other pods
    until it resolves at all; a name that never resolves fails the init container with a message."""
    from torch.distributed.run import get_args_parser

    docs = rendered["gpu"]
    learner = container_named(docs, "learner", "learner")
    host = get_args_parser().parse_args(learner.raw_argv[1:]).rdzv_endpoint.rsplit(":", 1)[0]
    script = expand_shell(container_named(docs, "learner", "rendezvous-dns").raw_argv)[1][0]
    assert f"host={host};" in script and "learner-0" in script
    assert (
        _rendezvous_wait(docs, tmp_path, pod="learner-0", resolves_to="10.0.0.5", pod_ip="10.0.0.5")
        == 0
    )
    assert (
        _rendezvous_wait(docs, tmp_path, pod="learner-0", resolves_to="10.0.0.9", pod_ip="10.0.0.5")
        == 1
    )
    assert (
        _rendezvous_wait(docs, tmp_path, pod="learner-1", resolves_to="10.0.0.5", pod_ip="10.0.0.7")
        == 0
    )
    assert _rendezvous_wait(docs, tmp_path, pod="learner-1", resolves_to="", pod_ip="10.0.0.7") == 1
    assert all(
        c.spec["name"] != "rendezvous-dns" or c.workload["metadata"]["name"] == "learner"
        for c in containers(docs)
    )
