"""The gpu overlay's inference tier as an operator runs it: the router's own image, rollouts that
need no spare GPU, probes that survive a weight reload, bounded retries, and the Dockerfile recipe
of the router image. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from typing import Any

import msgspec
import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.services.weight_sync.service import WeightSyncConfig
from tests.support.manifests import DEPLOY, config_map_value, container_named, find

Docs = list[dict[str, Any]]
ROUTER_VERSION = "0.3.2"


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def test_the_router_runs_an_image_that_contains_sglang_router(rendered: dict[str, Docs]) -> None:
    """The router container runs the pinned leafe-router image (not lmsysorg/sglang, which has no
    sglang_router module), and the Dockerfile's `router` stage installs that exact release and
    imports it."""
    router = container_named(rendered["gpu"], "sglang-router", "router")
    image = router.spec["image"]
    assert not image.startswith("lmsysorg/sglang"), image
    assert image == f"registry.example.com/leafe-router:{ROUTER_VERSION}"
    assert router.argv[:3] == ["python3", "-m", "sglang_router.launch_router"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+(?: AS (\w+))?$", dockerfile, flags=re.M)
    assert "router" in stages and stages[-1] == "", (
        "the router stage must not be the default (last) one"
    )
    stage = dockerfile.split(" AS router", 1)[1].split("\nFROM ", 1)[0]
    assert f"ARG SGLANG_ROUTER_VERSION={ROUTER_VERSION}" in stage
    assert 'pip install "sglang-router==${SGLANG_ROUTER_VERSION}"' in stage
    assert "import sglang_router" in stage and "USER 10001" in stage


def test_router_flags_parse_under_sglang_router(rendered: dict[str, Docs]) -> None:
    """The router's command line is accepted by sglang-router's own parser (where it is installed;
    it is not a dependency of this project: `pip install sglang-router==0.3.2` to run this)."""
    router_args = pytest.importorskip("sglang_router.router_args")
    argv = container_named(rendered["gpu"], "sglang-router", "router").argv[3:]
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    args = router_args.RouterArgs.from_cli_args(parser.parse_args(argv))
    assert args.health_check_endpoint == "/ready" and args.retry_max_retries == 2


def test_sglang_rolls_out_without_a_spare_gpu(rendered: dict[str, Docs]) -> None:
    """A template change replaces one SGLang pod at a time and never adds one (maxSurge 0)."""
    deployment = find(rendered["gpu"], "Deployment", "sglang")
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "Recreate" or (
        strategy["type"] == "RollingUpdate"
        and strategy["rollingUpdate"]["maxSurge"] in (0, "0", "0%")
        and strategy["rollingUpdate"]["maxUnavailable"] not in (0, "0", "0%")
    ), strategy


def test_probes_survive_a_weight_reload(rendered: dict[str, Docs]) -> None:
    """SGLang's startup and readiness use /ready (cheap, auth-exempt); liveness runs deploy's
    liveness.py (the ConfigMap holds exactly that file) on the lock file the weight-sync sidecar
    holds while it loads (one emptyDir shared by both containers), so no generating /health lands in
    a load; its timeout is above the script's own; the router checks its workers on /ready, not on
    the generating /health."""
    docs = rendered["gpu"]
    pod = container_named(docs, "sglang", "sglang")
    sglang = pod.spec
    for probe in ("startupProbe", "readinessProbe"):
        assert sglang[probe]["httpGet"]["path"] == "/ready", probe
    live = sglang["livenessProbe"]
    python, isolated, nosite, script, lock, health, max_load = live["exec"]["command"]
    assert (python, isolated, nosite, health) == (
        "python3",
        "-I",
        "-S",
        "http://127.0.0.1:30000/health",
    )
    liveness_py = DEPLOY / "components" / "sglang" / "liveness.py"
    mounts = {m["mountPath"]: m["name"] for m in sglang["volumeMounts"]}
    volumes = {v["name"]: v for v in pod.pod["spec"]["volumes"]}
    probe_dir, name = script.rsplit("/", 1)
    config_map = volumes[mounts[probe_dir]]["configMap"]["name"]
    assert find(docs, "ConfigMap", config_map)["data"][name] == liveness_py.read_text(
        encoding="utf-8"
    )
    sidecar = container_named(docs, "sglang", "weight-sync")
    assert _flag(sidecar.argv, "--engine-lock") == lock
    lock_dir = lock.rsplit("/", 1)[0]
    shared = {m["name"] for m in sidecar.spec["volumeMounts"] if m["mountPath"] == lock_dir}
    assert shared == {mounts[lock_dir]} and "emptyDir" in volumes[mounts[lock_dir]]
    timeout = float(re.search(r"HEALTH_TIMEOUT_S = ([\d.]+)", liveness_py.read_text()).group(1))  # type: ignore[union-attr]
    assert 20 < timeout < live["timeoutSeconds"]
    # the probe caps a held lock's deadline at the sidecar's own load deadline
    assert float(max_load) == WeightSyncConfig().update_timeout_s + 60
    assert (
        sglang["startupProbe"]["periodSeconds"] * sglang["startupProbe"]["failureThreshold"] >= 1800
    )
    router = container_named(docs, "sglang-router", "router")
    assert _flag(router.argv, "--health-check-endpoint") == "/ready"
    assert router.spec["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert router.spec["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_ci_runs_the_router_with_the_clusters_flags(rendered: dict[str, Docs]) -> None:
    """The router that the integration tests and ``leafe run`` start (services/run/router.py)
    routes, checks workers and retries with exactly the gpu overlay's settings; only how it finds
    workers, where it listens, its key and its logs differ."""
    from leafe.services.run.router import ROUTER_VERSION as CI_ROUTER_VERSION
    from leafe.services.run.router import router_command

    def flags(argv: list[str]) -> dict[str, str]:
        pairs = {}
        for i, token in enumerate(argv):
            if token.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                pairs[token] = argv[i + 1]
        return pairs

    cluster = flags(container_named(rendered["gpu"], "sglang-router", "router").argv)
    ci = flags(router_command(["http://127.0.0.1:1"], port=2, prometheus_port=3))
    local_only = {
        "--host",
        "--port",
        "--prometheus-host",
        "--prometheus-port",
        "--worker-urls",
        "--log-level",
    }
    cluster_only = {
        "--selector", "--service-discovery-port", "--service-discovery-namespace", "--api-key",
        "--control-plane-api-keys", "--shutdown-grace-period-secs",
    }  # fmt: skip
    assert {k: v for k, v in ci.items() if k not in local_only} == {
        k: v for k, v in cluster.items() if k not in local_only | cluster_only
    }
    assert CI_ROUTER_VERSION == ROUTER_VERSION


def test_one_failing_request_costs_at_most_six_upstream_attempts(
    rendered: dict[str, Docs],
) -> None:
    """Router attempts (--retry-max-retries counts attempts: --disable-retries sets it to 1) times
    the actors' client attempts (retries + 1) stays <= 6, and exceeds the router's circuit breaker
    threshold: a request that met a dead worker first gets an attempt after the breaker has taken
    it out."""
    router = container_named(rendered["gpu"], "sglang-router", "router")
    router_attempts = int(_flag(router.argv, "--retry-max-retries"))
    actor_toml = config_map_value(rendered["gpu"], "leafe-run-config", "actor.toml")
    config = msgspec.convert(tomllib.loads(actor_toml), ActorServiceConfig)
    attempts = router_attempts * (config.engine.retries + 1)
    assert int(_flag(router.argv, "--cb-failure-threshold")) < attempts <= 6
