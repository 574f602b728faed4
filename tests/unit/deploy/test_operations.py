"""The deployment through its first week, on the rendered manifests: learner restarts that keep
their stop-time checkpoint, a router that neither stops for client errors nor waits out a hung
engine at the client's timeout, engines spread over nodes, and a weight volume a non-root namespace
can own.
Run: ``.venv/bin/python -m pytest tests/unit/deploy/test_operations.py -q``."""

from __future__ import annotations

import tomllib
from typing import Any

import msgspec
import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.services.run.router import router_command
from tests.support.manifests import (
    DEPLOY,
    KUSTOMIZATIONS,
    Stacks,
    config_map_value,
    container_named,
    containers,
    env_value,
    pod_templates,
)

Docs = list[dict[str, Any]]
EXAMPLE_PARAMS = {"gpu": 7.62e9, "dev": 135e6}
"""Parameters of each overlay's example model (as test_gpu_cluster.py's)."""
STOP_WRITE_BYTES_PER_PARAM = 12 + 2
"""What a learner writes when it stops: a checkpoint (fp32 master weights and AdamW's two fp32
moments, 12 B/param) and an export (bf16, 2 B/param)."""
VOLUME_WRITE_BYTES_PER_S = 250e6
"""The weight volume's sustained write rate the grace is sized for (deploy/README.md)."""
STEP_S = 60
"""The longest step a stop waits for before it writes."""


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
def test_torchrun_gives_the_ranks_the_pods_grace(rendered: dict[str, Docs], overlay: str) -> None:
    """torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s when unset) between the SIGTERM it
    forwards and SIGKILL: it is set 15-60 s under the pod's terminationGracePeriodSeconds, and the
    grace covers the example model's stop-time checkpoint and export at the volume's rate plus a
    step."""
    docs = rendered[overlay]
    learner = container_named(docs, "learner", "learner")
    assert learner.argv[0] == "torchrun"
    grace = learner.pod["spec"]["terminationGracePeriodSeconds"]
    timeout = int(env_value(learner, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    assert 15 <= grace - timeout <= 60, (grace, timeout)
    write_s = EXAMPLE_PARAMS[overlay] * STOP_WRITE_BYTES_PER_PARAM / VOLUME_WRITE_BYTES_PER_S
    assert timeout >= write_s + STEP_S, f"{overlay}: {timeout} s < {write_s + STEP_S:.0f} s"


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def _router_argvs(rendered: dict[str, Docs]) -> dict[str, list[str]]:
    """The gpu overlay's router and the one ``leafe run`` and the integration tests start."""
    return {
        "gpu overlay": container_named(rendered["gpu"], "sglang-router", "router").argv,
        "leafe run": router_command(["http://127.0.0.1:1"], port=2, prometheus_port=3),
    }


def test_router_attempts_fit_in_the_clients_timeout(rendered: dict[str, Docs]) -> None:
    """Every attempt the router makes of one request, each bounded by its request timeout, ends
    before the actors' client gives up (their rendered actor.toml's ``timeout_s``): a hung engine's
    request is retried by the router, not failed at the client."""
    actor_toml = config_map_value(rendered["gpu"], "leafe-run-config", "actor.toml")
    client_timeout = msgspec.convert(tomllib.loads(actor_toml), ActorServiceConfig).engine.timeout_s
    for where, argv in _router_argvs(rendered).items():
        attempts = int(_flag(argv, "--retry-max-retries"))
        per_attempt = int(_flag(argv, "--request-timeout-secs"))
        backoff_s = 30.0  # the router's largest backoff between attempts (--retry-max-backoff-ms)
        assert attempts * per_attempt + (attempts - 1) * backoff_s < client_timeout, where
        assert per_attempt >= 60, f"{where}: {per_attempt} s would cut long generations short"


def test_the_circuit_breaker_outlasts_a_few_refused_requests(rendered: dict[str, Docs]) -> None:
    """The router's breaker counts requests an engine refused (400) as failures: it opens only
    after more than four in a row and for seconds, not sglang-router's minute, and stays on (a dead
    worker's attempts must go elsewhere)."""
    for where, argv in _router_argvs(rendered).items():
        assert "--disable-circuit-breaker" not in argv, where
        assert int(_flag(argv, "--cb-failure-threshold")) > 4, where
        assert int(_flag(argv, "--cb-timeout-duration-secs")) <= 15, where


def test_cache_aware_routing_balances_a_shared_prefix(rendered: dict[str, Docs]) -> None:
    """Cache-aware routing with balance thresholds low enough that a shared-prefix load spreads
    (bench/router.py): engines at most 4 requests and 1.2x apart before the router balances."""
    for where, argv in _router_argvs(rendered).items():
        assert _flag(argv, "--policy") == "cache_aware", where
        assert int(_flag(argv, "--balance-abs-threshold")) <= 4, where
        assert float(_flag(argv, "--balance-rel-threshold")) <= 1.2, where


def test_the_engines_prefer_different_nodes(rendered: dict[str, Docs]) -> None:
    """The SGLang pods prefer (not require: a one-node GPU pool still runs them) to be on different
    nodes, so one node's loss leaves the `inference` Service an engine."""
    template = container_named(rendered["gpu"], "sglang", "sglang").pod
    terms = template["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    labels = template["metadata"]["labels"]
    assert any(
        t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        and t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
        and t["weight"] >= 50
        for t in terms
    ), terms
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution"
        not in template["spec"]["affinity"]["podAntiAffinity"]
    )


def _mounts_weights(template: dict[str, Any]) -> bool:
    return any(
        (v.get("persistentVolumeClaim") or {}).get("claimName") == "leafe-weights"
        for v in template["spec"].get("volumes") or []
    )


def test_every_pod_on_the_weight_volume_can_own_it(
    rendered: dict[str, Docs], stacks: Stacks
) -> None:
    """Every pod that mounts the weight volume, in every kustomization and component stack, runs as
    uid 10001 with fsGroup 10001 and ``fsGroupChangePolicy: OnRootMismatch`` (the kubelet makes a
    root-owned volume the group's where it manages ownership, without a walk of every file at each
    start); the init container that finds the volume not writable names the README's section on
    fixing it from outside the namespace, which exists."""
    all_docs = [*(rendered[n] for n in KUSTOMIZATIONS), *stacks.values()]
    checked = set()
    for docs in all_docs:
        for workload, template in pod_templates(docs):
            if not _mounts_weights(template):
                continue
            context = template["spec"]["securityContext"]
            where = f"{workload['kind']}/{workload['metadata']['name']}"
            assert context["runAsUser"] == 10001 and context["fsGroup"] == 10001, where
            assert context.get("fsGroupChangePolicy") == "OnRootMismatch", where
            checked.add(where)
    assert {"StatefulSet/learner", "Deployment/sglang", "StatefulSet/actor"} <= checked, checked
    init = next(c for c in containers(rendered["gpu"]) if c.spec["name"] == "weights-dirs")
    script = " ".join(init.argv)
    assert "chown" not in script and "Volume ownership" in script, script
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "**Volume ownership.**" in readme and "fsGroupChangePolicy: OnRootMismatch" in readme
